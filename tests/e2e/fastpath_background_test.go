package e2e

import (
	"fmt"
	"strings"
	"testing"

	"deltabox/internal/api"
	"deltabox/internal/apitypes"
	"deltabox/internal/testutil"
)

// bgCounter is a process an exec leaves running: on each SIGUSR1 it counts, in its
// memory, and appends "PID COUNT" to /workspace/bg.out. It is not in a session. It
// takes SIGUSR1 by sigwait, blocked, as mtCounter (criutrees_test.go) does and for its
// reason: with a handler and pause(), a signal that comes just before the pause is
// lost.
const bgCounter = `
import os, signal
n = 0
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
open('/workspace/bg.pid', 'w').write(str(os.getpid()))
while True:
    signal.sigwait([signal.SIGUSR1])
    n += 1
    with open('/workspace/bg.out', 'a') as f:
        f.write('%d %d\n' % (os.getpid(), n))
`

// TestFastPathBackgroundProcess: a process outside the sessions (a background job an
// exec left, its fds on /dev/null) is checkpointed with its state: after a restore it
// runs again with its PID and the count it had in memory at that node, beside the
// node's files; the restore to a later node brings that node's count. A background
// process the fast path cannot take (it holds a pipe) goes through CRIU
// (TestCRIUTreesRoundTrip); with end_background the checkpoint ends it and still keeps
// the counter.
func TestFastPathBackgroundProcess(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "bp")
	if r := dbxExec(t, d, "bp", api.ExecRequest{Argv: []string{"bash", "-c", `nohup python3 -c "$1" </dev/null >/dev/null 2>&1 &
for i in $(seq 500); do [ -s /workspace/bg.pid ] && exit 0; sleep 0.01; done; exit 1`, "sh", bgCounter}}); r.ExitCode != 0 {
		t.Fatalf("start the counter: %+v", r)
	}
	pid := strings.TrimSpace(dbxSh(t, d, "bp", "cat /workspace/bg.pid"))
	// bump signals the counter and waits for its line.
	bump := func(lines int) {
		t.Helper()
		dbxSignal(t, d, "bp", "USR1", pid)
		dbxSh(t, d, "bp", fmt.Sprintf(`for i in $(seq 500); do [ "$(wc -l < /workspace/bg.out)" = %d ] && exit 0; sleep 0.01; done; cat /workspace/bg.out; exit 1`, lines))
	}
	out := func(what, want string) {
		t.Helper()
		if got := dbxSh(t, d, "bp", "cat /workspace/bg.out"); got != want {
			t.Fatalf("%s: bg.out %q, want %q", what, got, want)
		}
	}
	line := func(n int) string { return fmt.Sprintf("%s %d\n", pid, n) }

	bump(1)
	a := dbxCheckpoint(t, d, "bp", "one")
	if a.Processes != 1 || a.Killed != 0 {
		t.Fatalf("checkpoint A: %d processes, %d killed, want the background counter kept: %v", a.Processes, a.Killed, a.ProcessErrors)
	}
	bump(2)
	bump(3)
	b := dbxCheckpoint(t, d, "bp", "three")
	bump(4)

	if r := dbxRestore(t, d, "bp", a.Node.ID); r.Processes != 1 {
		t.Fatalf("restore A: %d processes: %v", r.Processes, r.ProcessErrors)
	}
	out("restored to A", line(1))
	bump(2) // the restored process counted 1, as at A, and has the same PID
	out("a signal after restoring A", line(1)+line(2))

	dbxRestore(t, d, "bp", b.Node.ID)
	bump(4)
	out("a signal after restoring B", line(1)+line(2)+line(3)+line(4))

	// One that holds a pipe cannot be taken.
	dbxSh(t, d, "bp", `nohup python3 -c "import os, time; r, w = os.pipe(); open('/workspace/pipe.pid', 'w').write(str(os.getpid())); time.sleep(1000)" </dev/null >/dev/null 2>&1 &
for i in $(seq 500); do [ -s /workspace/pipe.pid ] && exit 0; sleep 0.01; done; exit 1`)
	pp := strings.TrimSpace(dbxSh(t, d, "bp", "cat /workspace/pipe.pid"))
	// The fast path cannot take it; CRIU does (state/criutrees.go), and both run on.
	if p := dbxCheckpoint(t, d, "bp", "pipe"); p.Processes != 1 || p.CRIUProcesses != 1 {
		t.Fatalf("checkpoint with a pipe holder: %d processes, %d through CRIU, want 1 and 1: %+v", p.Processes, p.CRIUProcesses, p)
	}
	dbxSh(t, d, "bp", "[ -e /proc/"+pp+" ] && [ -e /proc/"+pid+" ]")
	bump(5)

	c, err := d.C.CheckpointWith(dbxCtx(t), "bp", api.CheckpointRequest{Label: "ended", EndBackground: true})
	if err != nil || c.Processes != 1 || c.Killed != 1 {
		t.Fatalf("checkpoint with end_background: %v %+v", err, c)
	}
	if r := dbxExec(t, d, "bp", api.ExecRequest{Argv: []string{"bash", "-c", "[ -e /proc/" + pp + " ]"}}); r.ExitCode == 0 {
		t.Fatalf("end_background left process %s running", pp)
	}
	bump(6)
	dbxRestore(t, d, "bp", c.Node.ID)
	bump(6)
	out("restored to the node end_background made", line(1)+line(2)+line(3)+line(4)+line(5)+line(6))
}

// TestFastPathBackgroundTracedAndNested: a background process a debugger inside the
// sandbox traces cannot be seized, and its tracer cannot be carried (fork does not copy
// a ptrace relationship): the checkpoint is refused with 409 naming the traced one, and
// with end_background both are ended (the tracer first has to go for its tracee's exit
// to be collected, which a kill of the tracee alone would wait on). A PID namespace of
// its own is refused to a process at unshare.
func TestFastPathBackgroundTracedAndNested(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "tn")
	start := func(script string, args ...string) {
		t.Helper()
		argv := append([]string{"bash", "-c", script, "sh"}, args...)
		if r := dbxExec(t, d, "tn", api.ExecRequest{Argv: argv}); r.ExitCode != 0 {
			t.Fatalf("%s: %+v", script, r)
		}
	}
	start(`nohup sleep 1000 </dev/null >/dev/null 2>&1 & echo $! > /workspace/b.pid
nohup python3 -c "$1" </dev/null >/dev/null 2>&1 &
for i in $(seq 500); do [ -s /workspace/a.out ] && exit 0; sleep 0.01; done; exit 1`, `
import ctypes, time
libc = ctypes.CDLL(None, use_errno=True)
r = libc.ptrace(0x4206, int(open('/workspace/b.pid').read()), 0, 0)  # PTRACE_SEIZE
open('/workspace/a.out', 'w').write('%d %d' % (r, ctypes.get_errno()))
time.sleep(1000)`)
	if out := dbxSh(t, d, "tn", "cat /workspace/a.out"); out != "0 0" {
		t.Fatalf("the tracer's PTRACE_SEIZE: %q", out)
	}
	b := strings.TrimSpace(dbxSh(t, d, "tn", "cat /workspace/b.pid"))
	fpRefused(t, d, "tn", "process "+b, "cannot be seized")
	c, err := d.C.CheckpointWith(dbxCtx(t), "tn", api.CheckpointRequest{Label: "ended", EndBackground: true})
	if err != nil || c.Killed != 2 {
		t.Fatalf("checkpoint with end_background: %v %+v, want the tracer and its tracee ended", err, c)
	}

	// A process in a PID namespace of its own cannot be made any more: the sandbox's
	// seccomp filter refuses unshare and clone with namespace flags
	// (internal/sbinit/seccomp.go). The fast path's refusal of one stays, unreachable.
	if out := dbxSh(t, d, "tn", `python3 -c "import ctypes; l = ctypes.CDLL(None, use_errno=True); print(l.unshare(0x20000000), ctypes.get_errno())"`); out != "-1 1\n" {
		t.Fatalf("unshare(CLONE_NEWPID) inside the sandbox: %q, want -1 EPERM", out)
	}
}

// TestFastPathBackgroundBesideSession: a process outside the sessions is found and
// carried when the sandbox has a session too, whose checkpoints answer early: the
// answer counts both, ends nothing, and a restore brings back the background process's
// count from its memory beside the session's variable. A listing of the namespace
// (state.Manager.holdOthers) that missed the background process would answer 1 process
// (it would run on untouched, on no node).
func TestFastPathBackgroundBesideSession(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "bs"
	dbxCreate(t, d, id)
	if _, err := d.C.StartSession(dbxCtx(t), id, apitypes.SessionOptions{Name: "py", Kind: apitypes.SessionPython}); err != nil {
		t.Fatal(err)
	}
	sessRun(t, d, id, "py", "x = 1")
	if r := dbxExec(t, d, id, api.ExecRequest{Argv: []string{"bash", "-c", `nohup python3 -c "$1" </dev/null >/dev/null 2>&1 &
for i in $(seq 500); do [ -s /workspace/bg.pid ] && exit 0; sleep 0.01; done; exit 1`, "sh", bgCounter}}); r.ExitCode != 0 {
		t.Fatalf("start the counter: %+v", r)
	}
	pid := strings.TrimSpace(dbxSh(t, d, id, "cat /workspace/bg.pid"))
	bump := func(lines int) {
		t.Helper()
		dbxSignal(t, d, id, "USR1", pid)
		dbxSh(t, d, id, fmt.Sprintf(`for i in $(seq 500); do [ "$(wc -l < /workspace/bg.out)" = %d ] && exit 0; sleep 0.01; done; cat /workspace/bg.out; exit 1`, lines))
	}
	bump(1)
	a := dbxCheckpoint(t, d, id, "one")
	if a.Processes != 2 || a.Killed != 0 || a.Node == nil || !a.Node.Pending {
		t.Fatalf("checkpoint: %d processes, %d killed, node %+v, want an early answer carrying the session and the background counter: %+v", a.Processes, a.Killed, a.Node, a)
	}
	bump(2)
	sessRun(t, d, id, "py", "x = 2")
	if r := dbxRestore(t, d, id, a.Node.ID); r.Processes != 2 {
		t.Fatalf("restore: %d processes: %v", r.Processes, r.ProcessErrors)
	}
	bump(2) // counted 1 at the node: this signal makes 2 again
	if got := dbxSh(t, d, id, "cat /workspace/bg.out"); got != fmt.Sprintf("%s 1\n%s 2\n", pid, pid) {
		t.Fatalf("bg.out after the restore and a signal: %q", got)
	}
	if got := strings.TrimSpace(sessRun(t, d, id, "py", "print(x)")); got != "1" {
		t.Fatalf("the session's x after the restore: %q, want 1", got)
	}
}
