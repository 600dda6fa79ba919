package e2e

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"deltabox/internal/api"
	"deltabox/internal/client"
	"deltabox/internal/errdefs"
	"deltabox/internal/procfs"
	"deltabox/internal/testutil"
)

// mtCounter is a background process with two threads: on each SIGUSR1 the main thread
// hands the count to a worker thread, which counts in memory and appends "PID COUNT"
// to /workspace/mt.out. A fork copies one thread: the fast path refuses it. The main
// thread takes SIGUSR1 by sigwait, blocked in both threads (a blocked signal stays
// pending until sigwait takes it), not by a handler and pause(): a signal that comes
// between the loop's last look for python's handlers and the pause runs only the C
// handler, and pause() then sleeps with nothing pending. Outside a sandbox, a python
// with a handler and pause(), signalled again as soon as it answered, with three busy
// loops on two cores, slept so at the 36th signal in one run and the 390th in another.
const mtCounter = `
import os, signal, threading, queue
q = queue.Queue()
n = 0
def worker():
    global n
    while True:
        q.get()
        n += 1
        with open('/workspace/mt.out', 'a') as f:
            f.write('%d %d\n' % (os.getpid(), n))
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
threading.Thread(target=worker, daemon=True).start()
open('/workspace/mt.pid', 'w').write(str(os.getpid()))
while True:
    signal.sigwait([signal.SIGUSR1])
    q.put(1)
`

// startJob starts script in the background in sandbox id, from an exec that returns
// once pidFile is written, and returns what it holds.
func startJob(t *testing.T, d *testutil.Daemon, id, script, pidFile string) string {
	t.Helper()
	dbxSh(t, d, id, fmt.Sprintf(`cd /workspace; nohup %s </dev/null >/dev/null 2>&1 &
for i in $(seq 1000); do [ -s %s ] && exit 0; sleep 0.01; done; exit 1`, script, pidFile))
	return strings.TrimSpace(dbxSh(t, d, id, "cat "+pidFile))
}

// startCounter starts mtCounter in sandbox id and returns its PID.
func startCounter(t *testing.T, d *testutil.Daemon, id string) string {
	t.Helper()
	return startCounterWith(t, d, id, "")
}

// startCounterWith is startCounter with prelude run first (python).
func startCounterWith(t *testing.T, d *testutil.Daemon, id, prelude string) string {
	t.Helper()
	return startPython(t, d, id, "/workspace/mt", prelude+mtCounter)
}

// startPython writes prog to NAME.py in sandbox id and starts it in the background
// (startJob); prog writes its PID to NAME.pid, which startPython returns.
func startPython(t *testing.T, d *testutil.Daemon, id, name, prog string) string {
	t.Helper()
	if r := dbxExec(t, d, id, api.ExecRequest{Argv: []string{"bash", "-c", `printf %s "$1" > "$2"`, "sh", prog, name + ".py"}}); r.ExitCode != 0 {
		t.Fatalf("write %s.py: %+v", name, r)
	}
	return startJob(t, d, id, "python3 "+name+".py", name+".pid")
}

// TestCRIUTreesRoundTrip: background processes the fast path refuses (a program with two
// threads, python -m http.server with its listening socket, a bash waiting on a child)
// are checkpointed through CRIU instead of refusing the checkpoint (state/criutrees.go).
// They keep running after the checkpoint with their PIDs and state; a restore brings
// each node's back, with its PIDs, its memory (the count), its socket (the server
// answers with the node's file) and its children. A node's images go with the node.
func TestCRIUTreesRoundTrip(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "ct"
	dbxCreate(t, d, id)
	start := func(script, pidFile string) string {
		t.Helper()
		return startJob(t, d, id, script, pidFile)
	}
	mt := startCounter(t, d, id)
	srv := start(`bash -c 'echo $$ > /workspace/srv.pid; exec python3 -m http.server 8765 --bind 127.0.0.1'`, "/workspace/srv.pid")
	par := start(`bash -c 'sleep 1000 & echo $! > /workspace/child.pid; echo $$ > /workspace/par.pid; wait'`, "/workspace/par.pid")
	child := strings.TrimSpace(dbxSh(t, d, id, "cat /workspace/child.pid"))
	bump := func(lines int) {
		t.Helper()
		dbxSignal(t, d, id, "USR1", mt)
		dbxSh(t, d, id, fmt.Sprintf(`for i in $(seq 500); do [ "$(wc -l < /workspace/mt.out)" = %d ] && exit 0; sleep 0.01; done; cat /workspace/mt.out; exit 1`, lines))
	}
	out := func(what, want string) {
		t.Helper()
		if got := dbxSh(t, d, id, "cat /workspace/mt.out"); got != want {
			t.Fatalf("%s: mt.out %q, want %q", what, got, want)
		}
	}
	line := func(n int) string { return fmt.Sprintf("%s %d\n", mt, n) }
	get := func(what, want string) {
		t.Helper()
		got := dbxSh(t, d, id, `for i in $(seq 300); do python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8765/x', timeout=5).read().decode(), end='')" 2>/dev/null && exit 0; sleep 0.02; done; exit 1`)
		if got != want {
			t.Fatalf("%s: the server answered %q, want %q", what, got, want)
		}
	}
	alive := func(what string) {
		t.Helper()
		dbxSh(t, d, id, fmt.Sprintf("for p in %s %s %s %s; do [ -e /proc/$p ]; done; [ \"$(cat /proc/%s/status | grep ^PPid | cut -f2)\" = %s ]", mt, srv, par, child, child, par))
		if got := strings.TrimSpace(dbxSh(t, d, id, fmt.Sprintf("ls /proc/%s/task | wc -l", mt))); got != "2" {
			t.Fatalf("%s: the counter has %s threads, want 2", what, got)
		}
	}

	dbxSh(t, d, id, "echo one > /workspace/x")
	bump(1)
	get("before", "one\n")
	a := dbxCheckpoint(t, d, id, "one")
	if a.CRIUProcesses != 4 {
		t.Fatalf("checkpoint A: %d processes through CRIU, want 4 (the counter, the server, bash and its child): %+v", a.CRIUProcesses, a)
	}
	t.Logf("checkpoint A: %.1f ms, phases %v", a.DurationMS, a.PhasesUS)
	alive("after checkpoint A")
	bump(2) // it runs on from its count, moved onto the new state
	get("after checkpoint A", "one\n")
	dbxSh(t, d, id, "echo two > /workspace/x")
	get("after a write", "two\n")
	b := dbxCheckpoint(t, d, id, "two")
	if b.CRIUProcesses != 4 {
		t.Fatalf("checkpoint B (of the processes CRIU restored): %d processes through CRIU, want 4: %+v", b.CRIUProcesses, b)
	}
	t.Logf("checkpoint B: %.1f ms, phases %v", b.DurationMS, b.PhasesUS)
	bump(3)
	dbxSignal(t, d, id, "TERM", srv, par)
	dbxSh(t, d, id, "echo three > /workspace/x")

	r := dbxRestore(t, d, id, a.Node.ID)
	if r.CRIUProcesses != 4 {
		t.Fatalf("restore A: %d processes through CRIU, want 4: %+v", r.CRIUProcesses, r)
	}
	t.Logf("restore A: %.1f ms, phases %v", r.DurationMS, r.PhasesUS)
	alive("restored to A")
	out("restored to A", line(1))
	bump(2)
	out("a signal after restoring A", line(1)+line(2))
	get("restored to A", "one\n")

	dbxRestore(t, d, id, b.Node.ID)
	alive("restored to B")
	get("restored to B", "two\n")
	bump(3)
	out("a signal after restoring B", line(1)+line(2)+line(3))

	in, err := d.C.Get(dbxCtx(t), id)
	if err != nil {
		t.Fatal(err)
	}
	if cp, rp := in.Stats.CheckpointPaths, in.Stats.RestorePaths; cp.CRIU != 2 || rp.CRIU != 2 || rp.Process != 2 {
		t.Errorf("checkpoint_paths %+v, restore_paths %+v: want 2 checkpoints and 2 restores through CRIU", cp, rp)
	}
	// A node's images go with it.
	dir := filepath.Join(d.Root, "durable", "bg", b.Node.ID)
	if _, err := os.Stat(dir); err != nil {
		t.Fatalf("node %s's CRIU images: %v", b.Node.ID, err)
	}
	dbxRestore(t, d, id, a.Node.ID)
	if _, err := d.C.RemoveNode(dbxCtx(t), b.Node.ID); err != nil {
		t.Fatal(err)
	}
	d.C.Sync(dbxCtx(t))
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Fatalf("node %s removed, its CRIU images are still there: %v", b.Node.ID, err)
	}
}

// TestCRIUTreeEndBackground: with end_background, a process the fast path refuses is
// ended as before, not taken through CRIU.
func TestCRIUTreeEndBackground(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "cte"
	dbxCreate(t, d, id)
	dbxSh(t, d, id, `nohup python3 -c "import os, time; r, w = os.pipe(); open('/workspace/p.pid', 'w').write(str(os.getpid())); time.sleep(1000)" </dev/null >/dev/null 2>&1 &
for i in $(seq 500); do [ -s /workspace/p.pid ] && exit 0; sleep 0.01; done; exit 1`)
	c, err := d.C.CheckpointWith(dbxCtx(t), id, api.CheckpointRequest{Label: "ended", EndBackground: true})
	if err != nil || c.CRIUProcesses != 0 || c.Killed != 1 {
		t.Fatalf("checkpoint with end_background: %v %+v, want the pipe holder ended", err, c)
	}
}

// TestCRIUTreesCutCheckpoint: a daemon killed during a checkpoint, after CRIU dumped a
// background tree and left it stopped, lets that tree run at its next start
// (state/criutrees.go:resumeCutCRIUTrees): a cut never leaves a process stopped. Cut
// before the move (step 2), the counter runs on from its count on the sandbox's state;
// cut after it (step 8), the tree stands on a state no record names and is ended with
// it. Nothing of the cut checkpoint's images is left.
func TestCRIUTreesCutCheckpoint(t *testing.T) {
	for _, at := range []string{"checkpoint:2", "checkpoint:8"} {
		t.Run(strings.ReplaceAll(at, ":", "-"), func(t *testing.T) {
			root := testutil.NewStore(t)
			d := testutil.StartDaemonEnv(t, root, "DELTABOX_CRASH_AT="+at)
			const id = "ctc"
			dbxCreate(t, d, id)
			mt := startCounter(t, d, id)
			dbxSignal(t, d, id, "USR1", mt)
			dbxSh(t, d, id, "for i in $(seq 500); do [ -s /workspace/mt.out ] && exit 0; sleep 0.01; done; exit 1")
			if _, err := d.C.Checkpoint(dbxCtx(t), id, "cut"); err == nil {
				t.Fatalf("the checkpoint answered: the daemon did not die at %s", at)
			}
			d.Kill()
			d = testutil.StartDaemonOn(t, root)
			st := strings.TrimSpace(dbxSh(t, d, id, fmt.Sprintf("cut -d' ' -f3 /proc/%s/stat 2>/dev/null || echo gone", mt)))
			t.Logf("cut at %s: the counter is %s", at, st)
			if st == "T" {
				t.Fatalf("cut at %s: the counter is left stopped", at)
			}
			if at == "checkpoint:2" {
				if st == "gone" {
					t.Fatalf("cut at %s, before anything moved: the counter is gone\ndaemon log:\n%s", at, d.Log())
				}
				dbxSignal(t, d, id, "USR1", mt)
				dbxSh(t, d, id, fmt.Sprintf(`for i in $(seq 500); do [ "$(cat /workspace/mt.out)" = "$(printf '%s 1\n%s 2')" ] && exit 0; sleep 0.01; done; cat /workspace/mt.out; exit 1`, mt, mt))
			}
			if left, _ := filepath.Glob(filepath.Join(root, "durable", "bg", ".tmp-*")); len(left) > 0 {
				t.Fatalf("cut at %s: the cut checkpoint's images are left: %v", at, left)
			}
		})
	}
}

// TestCRIUDumpOutlivesItsDaemon: nothing ends a `criu swrk` when the daemon that
// started it dies, so a daemon killed in mid-dump leaves CRIU dumping the tree. The test
// holds that CRIU stopped in mid-dump (a dump that lasts), kills the daemon, starts the
// next one, and lets CRIU go on once that daemon waits for it (its log says so) or
// answers. The next daemon ends the old CRIU before it touches the sandbox's processes
// (durable/runs.go): once it answers no process of that CRIU is left, and the tree runs
// on as before, the same process with its count, with no CRIU code left in it, and
// checkpoints again. Without that, the new daemon resumed the tree while CRIU held it
// in a ptrace-stop, and CRIU, done later, left it stopped.
func TestCRIUDumpOutlivesItsDaemon(t *testing.T) {
	root := testutil.NewStore(t)
	d := testutil.StartDaemonOn(t, root)
	const id = "ctd"
	dbxCreate(t, d, id)
	// 256 MiB of memory: a dump long enough for the test to catch CRIU in it.
	mt := startCounterWith(t, d, id, "ballast = bytearray(b'\\x01') * (256 << 20)\n")
	dbxSignal(t, d, id, "USR1", mt)
	dbxSh(t, d, id, "for i in $(seq 500); do [ -s /workspace/mt.out ] && exit 0; sleep 0.01; done; exit 1")
	host := 0
	_, pids := dbxSandboxPids(t, d, id)
	for _, p := range pids {
		if ns, err := procfs.NSpid(p); err == nil && strconv.Itoa(ns[len(ns)-1]) == mt {
			host = p
		}
	}
	if host == 0 {
		t.Fatalf("the counter (pid %s in the sandbox) has no host PID among %v", mt, pids)
	}
	cpDone := make(chan error, 1)
	go func() {
		_, err := d.C.Checkpoint(context.Background(), id, "cut in its dump")
		cpDone <- err
	}()
	// CRIU is caught once it traces the counter.
	criuPid := 0
	for deadline := time.Now().Add(30 * time.Second); criuPid == 0; time.Sleep(time.Millisecond) {
		if st, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", host)); err == nil {
			if tr, err := procfs.StatusUint(st, "TracerPid"); err == nil && tr != 0 {
				if comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", tr)); string(comm) == "criu\n" {
					criuPid = int(tr)
				}
			}
		}
		select {
		case err := <-cpDone:
			t.Fatalf("the checkpoint ended (%v) before the test saw CRIU dump the counter", err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("no CRIU traced the counter within 30 s of the checkpoint's start")
		}
	}
	criuStart, err := procfs.StartTime(criuPid)
	if err != nil {
		t.Fatal(err)
	}
	// Stopped once its daemon is dead: a process group that a parent's death orphans
	// gets SIGHUP from the kernel if a member is stopped then, and CRIU leads its own.
	d.Kill()
	if err := syscall.Kill(criuPid, syscall.SIGSTOP); err != nil {
		t.Fatalf("stop CRIU (pid %d) in its dump: %v", criuPid, err)
	}
	if err := <-cpDone; err == nil {
		t.Fatal("the checkpoint answered though its daemon was killed")
	}
	logFrom := len(d.Log())
	oldCRIU := func() bool {
		st, err := procfs.StartTime(criuPid)
		return err == nil && st == criuStart && procfs.State(criuPid) != 'Z'
	}
	for deadline := time.Now().Add(5 * time.Second); procfs.State(criuPid) != 'T'; time.Sleep(time.Millisecond) {
		if !oldCRIU() || time.Now().After(deadline) {
			t.Fatalf("CRIU (pid %d) is not stopped in its dump within 5 s of its daemon's death (state %q): its dump was over", criuPid, procfs.State(criuPid))
		}
	}
	// CRIU goes on once the next daemon waits for it, or once it answers (as it did,
	// without waiting, before durable/runs.go), which is when no CRIU of the old
	// daemon's may be left.
	leftAtAnswer := make(chan bool, 1)
	go func() {
		c := client.New(d.Socket)
		defer func() { _ = syscall.Kill(criuPid, syscall.SIGCONT) }() // ESRCH: gone
		for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
			if log := d.Log(); len(log) > logFrom && strings.Contains(log[logFrom:], "waiting for a CRIU run a previous daemon left working") {
				_ = syscall.Kill(criuPid, syscall.SIGCONT)
			}
			if c.Health(context.Background()) == nil {
				leftAtAnswer <- oldCRIU()
				return
			}
		}
		close(leftAtAnswer)
	}()
	d = testutil.StartDaemonOn(t, root)
	if left, ok := <-leftAtAnswer; !ok || left {
		t.Fatalf("the old daemon's CRIU (pid %d, stopped in its dump) still ran when the next daemon answered (answered: %v)\ndaemon log:\n%s", criuPid, ok, d.Log())
	}
	if oldCRIU() {
		t.Fatalf("the old daemon's CRIU (pid %d) runs again after the next daemon answered", criuPid)
	}
	for _, l := range strings.Split(d.Log()[logFrom:], "\n") {
		if strings.Contains(l, "CRIU run a previous daemon left") {
			t.Log(l)
		}
	}
	state := strings.TrimSpace(dbxSh(t, d, id, fmt.Sprintf(`for i in $(seq 500); do s=$(cut -d' ' -f3 /proc/%s/stat); [ "$s" = S ] && break; sleep 0.01; done; echo $s`, mt)))
	if state != "S" {
		t.Fatalf("the counter is %s after the restart, want it running (S)\ndaemon log:\n%s", state, d.Log())
	}
	if maps, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", host)); err != nil || strings.Contains(string(maps), "CRIUMFD") {
		t.Fatalf("the counter's mappings (%v): CRIU's parasite is left in it:\n%s", err, maps)
	}
	dbxSignal(t, d, id, "USR1", mt)
	dbxSh(t, d, id, fmt.Sprintf(`for i in $(seq 500); do [ "$(cat /workspace/mt.out)" = "$(printf '%s 1\n%s 2')" ] && exit 0; sleep 0.01; done; cat /workspace/mt.out; exit 1`, mt, mt))
	if cp := dbxCheckpoint(t, d, id, "after"); cp.CRIUProcesses != 1 {
		t.Fatalf("checkpoint after the restart: %+v, want the counter through CRIU", cp)
	}
	if left, _ := filepath.Glob(filepath.Join(root, "durable", "runs", "*")); len(left) > 0 {
		t.Fatalf("CRIU run records left: %v", left)
	}
}

// TestCRIUTreesSharingAPipeRefuse: a background pipeline whose shell has ended leaves two
// trees, one at each end of a pipe; CRIU dumps and restores each tree apart and would
// restore each end as a pipe of its own. The checkpoint refuses with 409 naming the
// pipe, and both processes run on.
func TestCRIUTreesSharingAPipeRefuse(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "ctp"
	dbxCreate(t, d, id)
	dbxSh(t, d, id, `cd /workspace; sleep 1000 </dev/null 2>/dev/null | sleep 1001 >/dev/null 2>&1 &
for i in $(seq 500); do [ "$(pgrep -c -x sleep)" = 2 ] && exit 0; sleep 0.01; done; exit 1`)
	_, err := d.C.Checkpoint(dbxCtx(t), id, "pipe")
	if err == nil || !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "share pipe:") {
		t.Fatalf("checkpoint with a pipeline split in two trees: %v, want 409 naming the shared pipe", err)
	}
	if got := strings.TrimSpace(dbxSh(t, d, id, "pgrep -c -x sleep; ps -o stat= -C sleep | tr -d ' \n'")); got != "2\nSS" {
		t.Fatalf("the pipeline after the refusal: %q, want both running", got)
	}
}

// TestCRIUTreeKeepsAStoppedProcessStopped: a background process the fast path refuses
// that the sandbox's own code stopped (kill -STOP) stays stopped through a checkpoint
// and a restore that take it through CRIU (which stops every tree for its dump), and
// runs on once continued, with its count.
func TestCRIUTreeKeepsAStoppedProcessStopped(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "cts"
	dbxCreate(t, d, id)
	mt := startCounter(t, d, id)
	// Polled for 5 s: a SIGSTOP or SIGCONT takes effect once the target runs, which on a
	// loaded machine comes after kill(2) returned (the CI run saw R just after a STOP). A
	// stopped process that something continued stays R, so the wait hides no resume.
	state := func(what, want string) {
		t.Helper()
		got := strings.TrimSpace(dbxSh(t, d, id, fmt.Sprintf(`for i in $(seq 500); do s=$(cut -d' ' -f3 /proc/%s/stat); [ "$s" = %s ] && break; sleep 0.01; done; echo $s`, mt, want)))
		if got != want {
			t.Fatalf("%s: the counter is %s, want %s", what, got, want)
		}
	}
	dbxSignal(t, d, id, "STOP", mt)
	state("stopped", "T")
	a := dbxCheckpoint(t, d, id, "stopped")
	if a.CRIUProcesses != 1 {
		t.Fatalf("checkpoint: %d processes through CRIU, want 1: %+v", a.CRIUProcesses, a)
	}
	state("after the checkpoint", "T")
	dbxSh(t, d, id, "echo x > /workspace/x") // the restore then mounts the node's state anew
	if r := dbxRestore(t, d, id, a.Node.ID); r.CRIUProcesses != 1 {
		t.Fatalf("restore: %d processes through CRIU, want 1: %+v", r.CRIUProcesses, r)
	}
	state("after the restore", "T")
	// Continued, then signalled: the SIGUSR1 waits, blocked, until the main thread's
	// sigwait takes it, whichever thread has the SIGCONT still pending.
	dbxSignal(t, d, id, "CONT", mt)
	dbxSignal(t, d, id, "USR1", mt)
	dbxSh(t, d, id, "for i in $(seq 500); do [ -s /workspace/mt.out ] && exit 0; sleep 0.01; done; exit 1")
	state("continued", "S")
}
