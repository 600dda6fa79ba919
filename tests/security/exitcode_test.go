package security

import (
	"os"
	"strconv"
	"sync"
	"testing"

	"deltabox/internal/apitypes"
	"deltabox/internal/testutil"
)

// forge sends init's "exit" message for the process whose command line holds marker,
// with status 0, on init's control socket taken with pidfd_getfd (fd 3 of PID 1); it
// prints what it did.
const forge = `
import ctypes, json, os, socket, sys, time
marker = sys.argv[1]
libc = ctypes.CDLL(None, use_errno=True)
pid = 0
for _ in range(200):
    for p in os.listdir('/proc'):
        if p.isdigit() and int(p) != os.getpid():
            try:
                if marker in open('/proc/%s/cmdline' % p).read():
                    pid = int(p)
            except OSError:
                pass
    if pid:
        break
    time.sleep(0.01)
if not pid:
    sys.exit('no target')
pfd = os.pidfd_open(1)
fd = libc.syscall(438, pfd, 3, 0)
if fd < 0:
    sys.exit('pidfd_getfd: errno %d' % ctypes.get_errno())
s = socket.socket(fileno=fd)
s.send(json.dumps({"op": "exit", "pid": pid, "status": 0}).encode())
print('sent exit 0 for', pid)
`

// TestExitCodeCannotBeForged: a process of the sandbox took init's control socket
// (pidfd_getfd on init) and sent init's "exit" message for another command, which then
// reported 0 for "sleep 2; exit 3". The daemon now takes an exec's status from the
// kernel (a pidfd of the process, PIDFD_INFO_EXIT), never from a message.
func TestExitCodeCannotBeForged(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "sec-exitcode"
	if _, err := d.C.Create(ctx(t), apitypes.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	marker := "victim-" + strconv.Itoa(os.Getpid())
	var wg sync.WaitGroup
	var victim *apitypes.ExecResult
	var verr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		victim, verr = d.C.Exec(ctx(t), id, apitypes.ExecRequest{Argv: []string{"bash", "-c", "sleep 2; exit 3", marker}, TimeoutMS: 30_000})
	}()
	r, err := d.C.Exec(ctx(t), id, apitypes.ExecRequest{Argv: []string{"python3", "-c", forge, marker}, TimeoutMS: 30_000})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("attacker: exit %d, %q %q", r.ExitCode, r.Stdout, r.Stderr)
	wg.Wait()
	if verr != nil {
		t.Fatalf("victim exec: %v", verr)
	}
	if victim.ExitCode != 3 {
		t.Errorf("exec of `sleep 2; exit 3` reported exit code %d (signal %d), not 3", victim.ExitCode, victim.Signal)
	}
}
