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

	"golang.org/x/sys/unix"

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

// TestInitMemfdSealed: every sandbox init runs the small init from the daemon's memfd
// (sbinit.InitBinary); were it writable, a sandbox would choose what every later init
// runs, in every sandbox. The attacks, from inside a sandbox and a fast fork's branch
// (as their root): write /proc/1/exe (the memfd) in place or appended, chmod it (a
// reopening for writing also meets ETXTBSY while an init runs it). No process but the
// daemon holds an fd of the memfd (the inits' execs close it; the family init closes its
// copy once the branch init is exec'd). And the memfd's own fd, read-write (as
// memfd_create opens it), taken from the daemon with pidfd_getfd as a leak would hand
// it over, writes, grows and shrinks nothing: it is sealed.
func TestInitMemfdSealed(t *testing.T) {
	d := testutil.StartDaemonEnv(t, testutil.NewStore(t), "DELTABOX_DURABLE=0")
	var memfd os.FileInfo
	fdDir := "/proc/" + strconv.Itoa(d.Pid()) + "/fd"
	ents, err := os.ReadDir(fdDir)
	if err != nil {
		t.Fatal(err)
	}
	memfdNum := -1
	for _, e := range ents {
		if l, _ := os.Readlink(filepath.Join(fdDir, e.Name())); strings.HasPrefix(l, "/memfd:deltabox-init") {
			if memfd, err = os.Stat(filepath.Join(fdDir, e.Name())); err != nil {
				t.Fatal(err)
			}
			memfdNum, _ = strconv.Atoi(e.Name())
		}
	}
	testutil.Require(t, memfd != nil, "the daemon holds no memfd of the small init (built without it?)")
	pidfd, err := unix.PidfdOpen(d.Pid(), 0)
	if err != nil {
		t.Fatal(err)
	}
	leaked, err := unix.PidfdGetfd(pidfd, memfdNum, 0)
	unix.Close(pidfd)
	if err != nil {
		t.Fatalf("pidfd_getfd of the daemon's memfd: %v", err)
	}
	first := make([]byte, 1)
	if _, err := unix.Pread(leaked, first, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := unix.Pwrite(leaked, first, 0); err == nil { // its own byte: harmless if it works
		t.Error("the small init's memfd was written through its fd")
	}
	var st unix.Stat_t
	if err := unix.Fstat(leaked, &st); err != nil {
		t.Fatal(err)
	}
	if unix.Ftruncate(leaked, st.Size+1) == nil || unix.Ftruncate(leaked, st.Size-1) == nil {
		t.Error("the small init's memfd was resized through its fd")
		_ = unix.Ftruncate(leaked, st.Size)
	}
	unix.Close(leaked)

	const src = "sec-memfd"
	if _, err := d.C.Create(ctx(t), apitypes.CreateOptions{ID: src}); err != nil {
		t.Fatal(err)
	}
	if r, err := d.C.Exec(ctx(t), src, apitypes.ExecRequest{Argv: []string{"sh", "-c", "nohup sleep 1000 </dev/null >/dev/null 2>&1 &"}}); err != nil || r.ExitCode != 0 {
		t.Fatalf("start a sleep: %v %+v", err, r)
	}
	res, err := d.C.ForkSandbox(ctx(t), src, apitypes.SandboxForkRequest{ForkRequest: apitypes.ForkRequest{Count: 1, CreateOptions: apitypes.CreateOptions{ID: "sec-memfd-b"}}})
	if err != nil {
		t.Fatal(err)
	}
	if res.Branches[0].Path != "fast" {
		t.Fatalf("the branch took path %s (%s): the test needs the fast path", res.Branches[0].Path, res.Branches[0].Reason)
	}
	for _, id := range []string{src, res.Branches[0].Sandbox.ID} {
		in, err := d.C.Get(ctx(t), id)
		if err != nil {
			t.Fatal(err)
		}
		if fi, err := os.Stat("/proc/" + strconv.Itoa(in.InitPid) + "/exe"); err != nil || !os.SameFile(fi, memfd) {
			t.Fatalf("%s's init does not run the memfd (%v)", id, err)
		}
		out := sh(t, d, id, `{ printf x 1<>/proc/1/exe; } 2>/dev/null && echo WROTE-IN-PLACE
{ printf x >>/proc/1/exe; } 2>/dev/null && echo APPENDED
chmod 0777 /proc/1/exe 2>/dev/null && echo CHMOD
true`)
		if out != "" {
			t.Errorf("from %s, /proc/1/exe (the small init's memfd): %q", id, out)
		}
	}
	pids, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range pids {
		pid, err := strconv.Atoi(p.Name())
		if err != nil || pid == d.Pid() {
			continue
		}
		dir := "/proc/" + p.Name() + "/fd"
		fds, _ := os.ReadDir(dir)
		for _, e := range fds {
			if fi, err := os.Stat(filepath.Join(dir, e.Name())); err == nil && os.SameFile(fi, memfd) {
				cmd, _ := os.ReadFile("/proc/" + p.Name() + "/cmdline")
				t.Errorf("process %d (%q) holds the small init's memfd as fd %s", pid, cmd, e.Name())
			}
		}
	}
}
