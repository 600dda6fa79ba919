package security

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/apitypes"
	"deltabox/internal/testutil"
)

// TestPTYOpenIsNotADeputy: the daemon opened /proc/INIT/root/dev/pts/ptmx as root for
// every session's terminal. /dev is read-only, but a process of the sandbox entered
// init's mount namespace and mounted a tmpfs over /dev/pts holding a symlink ptmx ->
// a host path; an absolute symlink there resolves against the daemon's root, so the
// daemon opened a host file of the sandbox's choosing (O_RDWR). The daemon now opens
// ptmx beneath the devpts mount it took at the sandbox's start, no symlinks followed.
func TestPTYOpenIsNotADeputy(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "sec-deputy"
	if _, err := d.C.Create(ctx(t), apitypes.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	bait := filepath.Join(t.TempDir(), "host-bait")
	if err := os.WriteFile(bait, []byte("host"), 0o600); err != nil {
		t.Fatal(err)
	}
	in, err := unix.InotifyInit1(unix.IN_NONBLOCK | unix.IN_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(in)
	if _, err := unix.InotifyAddWatch(in, bait, unix.IN_OPEN); err != nil {
		t.Fatal(err)
	}
	// nsenter cannot run a program there (init's root holds no binaries): python enters
	// init's mount namespace and mounts from inside it.
	plant := `
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
fd = os.open('/proc/1/ns/mnt', os.O_RDONLY)
if libc.setns(fd, 0x20000) != 0:
    sys.exit('setns: errno %d' % ctypes.get_errno())
if libc.mount(b'none', b'/dev/pts', b'tmpfs', 0, None) != 0:
    sys.exit('mount: errno %d' % ctypes.get_errno())
os.symlink(sys.argv[1], '/dev/pts/ptmx')
print('planted', os.readlink('/dev/pts/ptmx'))
`
	r, err := d.C.Exec(ctx(t), id, apitypes.ExecRequest{Argv: []string{"python3", "-c", plant, bait}, TimeoutMS: 30_000})
	if err != nil {
		t.Fatal(err)
	}
	out := r.Stdout + r.Stderr
	t.Logf("attack: %s", strings.TrimSpace(out))
	// A session's terminal is opened by the daemon (OpenPTY).
	_, serr := d.C.StartSession(ctx(t), id, apitypes.SessionOptions{Name: "s"})
	t.Logf("session start after the attack: %v", serr)
	time.Sleep(100 * time.Millisecond)
	buf := make([]byte, 4096)
	if n, _ := unix.Read(in, buf); n > 0 {
		t.Errorf("the daemon opened the host file %s through a symlink planted in the sandbox", bait)
	}
}
