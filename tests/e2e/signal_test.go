package e2e

import (
	"errors"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"deltabox/internal/apitypes"
	"deltabox/internal/errdefs"
	"deltabox/internal/testutil"
)

// dbxSignal sends SIG+name to each of pids (in the sandbox) through the daemon: a
// command cannot signal what another command started (internal/landlock). It first
// waits until no signal is pending on each (SigPnd, ShdPnd of /proc/PID/status): right
// after a restore the SIGCONT that resumes a process may still be pending on its main
// thread, and a signal sent then goes to another thread (python's handler then never
// wakes the main thread's pause()). An exec's kill used to come late enough. A signal
// the process blocks is not waited for: a restored bash in `wait` blocks SIGCHLD in its
// waitpid, and the SIGCHLD of its child's resume stays pending until the child ends
// (the loop then ran its 500 rounds; at load 6 past the command's 30 s, CI run s37c).
func dbxSignal(t *testing.T, d *testutil.Daemon, id, name string, pids ...string) {
	t.Helper()
	dbxSh(t, d, id, `for p in `+strings.Join(pids, " ")+`; do for i in $(seq 500); do
python3 -c "
import sys
f = dict(l.split(':', 1) for l in open('/proc/$p/status') if ':' in l)
v = lambda k: int(f[k], 16)
sys.exit(1 if (v('SigPnd') | v('ShdPnd')) & ~v('SigBlk') else 0)" 2>/dev/null && break; sleep 0.01; done; done`)
	sig := unix.SignalNum("SIG" + name)
	if sig == 0 {
		t.Fatalf("no signal SIG%s", name)
	}
	for _, p := range pids {
		pid, err := strconv.Atoi(strings.TrimSpace(p))
		if err != nil {
			t.Fatalf("pid %q: %v", p, err)
		}
		if _, err := d.C.Signal(dbxCtx(t), id, pid, int(sig)); err != nil {
			t.Fatalf("signal SIG%s to %d in %s: %v", name, pid, id, err)
		}
	}
}

// TestSignalFromOutside: a server one exec left in the background cannot be signalled
// by a later exec (each command runs in a Landlock domain of its own, with the signal
// scope), and is ended through the daemon (POST /v1/sandboxes/{id}/signal); init and
// a number that is no signal are refused with 400.
func TestSignalFromOutside(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "sig"
	dbxCreate(t, d, id)
	pid := strings.TrimSpace(dbxSh(t, d, id, "nohup sleep 1000 </dev/null >/dev/null 2>&1 & echo $!"))
	r := dbxExec(t, d, id, apitypes.ExecRequest{Argv: []string{"bash", "-c", "kill " + pid}})
	if r.ExitCode == 0 || !strings.Contains(r.Stderr, "Operation not permitted") {
		t.Fatalf("kill from a later exec: %+v, want EPERM", r)
	}
	if _, err := d.C.Signal(dbxCtx(t), id, 1, 9); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("signal to init: %v, want invalid", err)
	}
	if _, err := d.C.Signal(dbxCtx(t), id, 2, 99); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("signal 99: %v, want invalid", err)
	}
	dbxSignal(t, d, id, "TERM", pid)
	dbxSh(t, d, id, "for i in $(seq 500); do [ -e /proc/"+pid+" ] || exit 0; sleep 0.01; done; exit 1")
}
