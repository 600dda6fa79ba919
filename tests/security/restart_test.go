package security

import (
	"strings"
	"testing"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/testutil"
)

// takeInitFDs tries to take every fd of init (PID 1 of the sandbox) with pidfd_getfd
// and through /proc/1/fd, and, with any socket it gets, to speak for a daemon
// ("hello": init's spare socket makes the speaker init's daemon; "kept": the sessions'
// terminals). It prints "TOOK" for each fd it got.
const takeInitFDs = `
import ctypes, json, os, socket
libc = ctypes.CDLL(None, use_errno=True)
pfd = os.pidfd_open(1)
for n in range(0, 256):
    fd = libc.syscall(438, pfd, n, 0)
    if fd >= 0:
        print('TOOK fd %d by pidfd_getfd' % n)
        try:
            s = socket.socket(fileno=fd)
            s.send(json.dumps({"id": 1, "op": "hello"}).encode())
            s.send(json.dumps({"id": 2, "op": "kept"}).encode())
            print('spoke on fd %d' % n)
        except OSError as e:
            pass
try:
    names = os.listdir('/proc/1/fd')
except OSError as e:
    names = []
    print('listdir /proc/1/fd: errno', e.errno)
for n in names:
    try:
        os.close(os.open('/proc/1/fd/' + n, os.O_RDWR))
        print('TOOK fd %s by /proc/1/fd' % n)
    except OSError:
        pass
print('done')
`

// TestInitSpareUnreachable: init keeps, for the next daemon, its spare control socket
// (fd 100) and the sessions' terminals (sbinit/restart.go). A process of the sandbox
// that took the spare could make init its daemon's (hello): commands spawned at its word,
// the real daemon's requests unanswered after the next restart, the sessions' terminals
// in its hands. Two guards keep pidfd_getfd and /proc/1/fd from them (each alone
// suffices: a build with init dumpable still passes): init is not dumpable, and its
// capabilities are not a subset of the sandbox's bounded set (commoncap refuses the
// ptrace access), while the sandbox has no CAP_SYS_PTRACE to pass either. After the
// attempt the next daemon still adopts the sandbox through the spare, with its session.
func TestInitSpareUnreachable(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "sec-spare"
	if _, err := d.C.Create(ctx(t), apitypes.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	r, err := d.C.Run(ctx(t), id, "main", "X=kept; echo $$", 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	pid := r.Stdout
	for _, user := range []string{"", "root"} {
		res, err := d.C.Exec(ctx(t), id, apitypes.ExecRequest{Argv: []string{"python3", "-c", takeInitFDs}, User: user, TimeoutMS: 30_000})
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("attacker: exit %d\n%s%s", res.ExitCode, res.Stdout, res.Stderr)
		if strings.Contains(res.Stdout, "TOOK") || !strings.Contains(res.Stdout, "done") {
			t.Fatalf("a process of the sandbox reached init's fds:\n%s%s", res.Stdout, res.Stderr)
		}
	}
	d.Kill()
	d = testutil.StartDaemonOn(t, d.Root)
	r, err = d.C.Run(ctx(t), id, "main", "echo $X $$", 30*time.Second)
	if err != nil || r.SessionRestarted || r.Stdout != "kept "+pid {
		t.Fatalf("after the attempt and a daemon restart: session answered %+v %v, want %q from the same shell\ndaemon log:\n%s", r, err, "kept "+pid, d.Log())
	}
}
