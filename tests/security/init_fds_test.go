// Package security holds attacks run from inside a sandbox, each closed by a change of
// the daemon: a test fails if the attack works again. The threat model: code inside a
// sandbox is hostile; the daemon, its socket and the host are outside.
package security

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/testutil"
)

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return c
}

// sh runs a shell script in the sandbox and returns its stdout (exit code ignored: an
// attack's commands are expected to fail).
func sh(t *testing.T, d *testutil.Daemon, id, script string) string {
	t.Helper()
	r, err := d.C.Exec(ctx(t), id, apitypes.ExecRequest{Argv: []string{"bash", "-c", script}, TimeoutMS: 30_000})
	if err != nil {
		t.Fatalf("exec %q: %v", script, err)
	}
	if r.Stdout == "" && (r.ExitCode != 0 || r.Signal != 0) {
		// Nothing printed and a failure: say how it ended, or the caller's check on
		// the output fails with nothing to go on.
		t.Logf("exec %q printed nothing: exit %d, signal %d, timed out %v, oom %q, stderr %q",
			script, r.ExitCode, r.Signal, r.TimedOut, r.OOM, r.Stderr)
	}
	return r.Stdout
}

// TestInitHoldsNoHostFd: the sandbox's init (PID 1 inside, whose fds every process of
// the sandbox reaches as /proc/1/fd/N) holds no fd on the host's /proc and no file of
// the store. The attacks: `cat /proc/1/fd/N/1/root/PATH` read any host file through the
// host /proc that init opened at package init before it pivoted; its log file on the
// store's XFS was a mount fd for open_by_handle_at.
func TestInitHoldsNoHostFd(t *testing.T) {
	d := testutil.StartDaemon(t)
	in, err := d.C.Create(ctx(t), apitypes.CreateOptions{ID: "sec-initfd"})
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 8)
	rand.Read(b)
	secret := "deltabox-secret-" + hex.EncodeToString(b)
	hostFile := filepath.Join(os.TempDir(), secret)
	if err := os.WriteFile(hostFile, []byte(secret), 0o600); err != nil {
		t.Fatal(err)
	}
	defer os.Remove(hostFile)

	// The daemon's root is the host's: through a host /proc, /proc/DAEMON/root/PATH.
	daemon := strconv.Itoa(d.Pid())
	out := sh(t, d, "sec-initfd", `for f in /proc/1/fd/*; do cat "$f/`+daemon+`/root`+hostFile+`" 2>/dev/null; done; true`)
	if strings.Contains(out, secret) {
		t.Fatalf("a host file was read through init's fds: %q", out)
	}

	// And from outside, what each of init's fds is.
	var hostProc, store syscall.Stat_t
	if err := syscall.Stat("/proc", &hostProc); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Stat(d.Root, &store); err != nil {
		t.Fatal(err)
	}
	dir := "/proc/" + strconv.Itoa(in.InitPid) + "/fd"
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		var st syscall.Stat_t
		p := filepath.Join(dir, e.Name())
		if syscall.Stat(p, &st) != nil {
			continue
		}
		link, _ := os.Readlink(p)
		if st.Dev == hostProc.Dev {
			t.Errorf("init's fd %s is on the host's /proc (%s)", e.Name(), link)
		}
		if st.Dev == store.Dev && st.Mode&syscall.S_IFMT == syscall.S_IFREG {
			t.Errorf("init's fd %s is a file of the store (%s)", e.Name(), link)
		}
	}
}
