package e2e

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"deltabox/internal/api"
	"deltabox/internal/errdefs"
	"deltabox/internal/testutil"
)

// mtCounter is a background process with two threads: on each SIGUSR1 the main thread
// hands the count to a worker thread, which counts in memory and appends "PID COUNT"
// to /workspace/mt.out. A fork copies one thread: the fast path refuses it.
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
threading.Thread(target=worker, daemon=True).start()
signal.signal(signal.SIGUSR1, lambda s, f: q.put(1))
open('/workspace/mt.pid', 'w').write(str(os.getpid()))
while True:
    signal.pause()
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
	if r := dbxExec(t, d, id, api.ExecRequest{Argv: []string{"bash", "-c", `printf %s "$1" > /workspace/mt.py`, "sh", mtCounter}}); r.ExitCode != 0 {
		t.Fatalf("write mt.py: %+v", r)
	}
	return startJob(t, d, id, "python3 /workspace/mt.py", "/workspace/mt.pid")
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
	// Continued, then signalled once it runs: a SIGUSR1 sent with the SIGCONT still
	// pending on python's main thread goes to its other thread, whose handler cannot
	// wake the main thread's pause() (as it would on any machine).
	dbxSignal(t, d, id, "CONT", mt)
	dbxSh(t, d, id, fmt.Sprintf(`for i in $(seq 500); do [ "$(cut -d' ' -f3 /proc/%s/stat)" = S ] && exit 0; sleep 0.01; done; exit 1`, mt))
	dbxSignal(t, d, id, "USR1", mt)
	dbxSh(t, d, id, "for i in $(seq 500); do [ -s /workspace/mt.out ] && exit 0; sleep 0.01; done; exit 1")
	state("continued", "S")
}
