package e2e

import (
	"bytes"
	"deltabox/internal/api"
	"errors"
	"fmt"
	"math/rand"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"deltabox/internal/errdefs"
	"deltabox/internal/state"
	"deltabox/internal/testutil"
)

// dbxWaitImages waits until no node's durable image is pending: until then a stopped
// copy of each of its templates waits for its dump (state/durable.go), which counts of
// stopped processes would take for a template.
func dbxWaitImages(t *testing.T, d *testutil.Daemon) {
	t.Helper()
	start := time.Now()
	deadline := start.Add(2 * time.Minute)
	for {
		tr, err := d.C.Tree(dbxCtx(t))
		if err != nil {
			t.Fatal(err)
		}
		pending := 0
		for _, n := range tr.Nodes {
			switch {
			case n.ProcessImage != nil && n.ProcessImage.State == "pending":
				pending++
			case n.ProcessImage == nil && n.Templates != nil && n.Templates.Processes > 0 && time.Since(start) < 5*time.Second:
				// Not asked for yet (its templates are parked and copied in the background
				// after the answer), or images are off: given a few seconds to appear.
				pending++
			}
		}
		if pending == 0 {
			time.Sleep(50 * time.Millisecond) // the last copy, killed, is reaped
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d nodes' durable images still pending after 2 minutes", pending)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// fpStoppedPids lists the sandbox's processes that are in a stop (templates), as host
// PIDs, with their user CPU time (ticks).
func fpStoppedPids(t *testing.T, d *testutil.Daemon, id string) map[int]string {
	t.Helper()
	dbxWaitImages(t, d)
	info, err := d.C.Get(dbxCtx(t), id)
	if err != nil {
		t.Fatal(err)
	}
	dir := dbxCgroupDir(t, info.InitPid)
	read := func() map[int]string {
		out := map[int]string{}
		for _, p := range dbxReadPids(filepath.Join(dir, "cgroup.procs")) {
			b, err := os.ReadFile("/proc/" + strconv.Itoa(p) + "/stat")
			if err != nil {
				continue
			}
			i := bytes.LastIndexByte(b, ')')
			f := strings.Fields(string(b[i+2:]))
			if f[0] == "T" || f[0] == "t" {
				// utime only: the injected clone3 and setsid run in the template's kernel
				// context (stime), but not one instruction of its own code (utime).
				out[p] = f[11]
			}
		}
		return out
	}
	// A template the daemon parks after the answer (views.go) is let go and seized
	// again: for a few milliseconds it is in the kernel on its way to its SIGSTOP, not
	// seen stopped (fastpath.Template.WaitStopped). The set is read until three readings
	// 10 ms apart agree (2 s at most).
	last, same := read(), 0
	for deadline := time.Now().Add(2 * time.Second); same < 2 && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
		cur := read()
		if len(cur) == len(last) {
			same++
		} else {
			same = 0
		}
		last = cur
	}
	return last
}

// TestFastPathRestoresProcessState: a bash session (variables, functions, aliases, cwd,
// exported environment, history) and a python session (a dict of 10^5 objects, a
// generator mid-iteration, a file mid-read, a random.Random state) are checkpointed at
// several states and restored to nodes in random order, 100 times; every restore gives
// back exactly what was recorded at that checkpoint, with the same PIDs, and templates
// never run.
func TestFastPathRestoresProcessState(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "fp")
	if _, err := d.C.StartSession(dbxCtx(t), "fp", state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	bashPid := strings.TrimSpace(sessRun(t, d, "fp", "main", "echo $$"))
	pyPid := strings.TrimSpace(sessRun(t, d, "fp", "py", "import os; os.getpid()"))
	sessRun(t, d, "fp", "py", `import random
d = {i: str(i) for i in range(10**5)}
def gen():
    i = 0
    while True:
        yield i
        i += 1
g = gen()
open('/workspace/lines.txt', 'w').write(''.join('line%d\n' % i for i in range(1000)))
fin = open('/workspace/lines.txt')
rng = random.Random(7)
step = 0`)
	bashProbe := `echo "$V|$(f)|$(pwd)|$EXP|$(alias a)|$(history | tail -1 | cut -c8-)|$$"`
	pyProbe := `(step, len(d), d[step], next(g), fin.readline().strip(), rng.random(), os.getpid())`
	type rec struct{ node, bash, py string }
	var recs []rec
	for i := 0; i < 6; i++ {
		sessRun(t, d, "fp", "main", fmt.Sprintf(`mkdir -p /tmp/d%d && cd /tmp/d%d; V=v%d; f() { echo f%d; }; alias a='echo a%d'; export EXP=e%d; echo marker%d`, i, i, i, i, i, i, i))
		sessRun(t, d, "fp", "py", fmt.Sprintf("step = %d\nd[step] = 'changed%d'\nfor _ in range(%d): next(g); fin.readline(); rng.random()", i, i, i+1))
		op := dbxCheckpoint(t, d, "fp", fmt.Sprintf("s%d", i))
		if op.Processes != 2 {
			t.Fatalf("checkpoint %d took %d processes: %v", i, op.Processes, op.ProcessErrors)
		}
		// What the sessions show now, without changing them (probes advance g, fin and
		// rng, so they are taken right after a restore only).
		recs = append(recs, rec{node: op.Node.ID})
	}
	// Record each node's state by restoring to it once.
	for i := range recs {
		dbxRestore(t, d, "fp", recs[i].node)
		recs[i].bash = sessRun(t, d, "fp", "main", bashProbe)
		recs[i].py = sessRun(t, d, "fp", "py", pyProbe)
		if !strings.Contains(recs[i].bash, fmt.Sprintf("v%d|f%d|/tmp/d%d|e%d|alias a='echo a%d'|", i, i, i, i, i)) || !strings.HasSuffix(recs[i].bash, "|"+bashPid+"\n") {
			t.Fatalf("node %d bash state: %q", i, recs[i].bash)
		}
		if !strings.HasPrefix(recs[i].py, fmt.Sprintf("(%d, 100000, 'changed%d', %d, 'line%d'", i, i, (i+1)*(i+2)/2, (i+1)*(i+2)/2)) || !strings.HasSuffix(recs[i].py, ", "+pyPid+")\n") {
			t.Fatalf("node %d python state: %q", i, recs[i].py)
		}
	}
	templates := fpStoppedPids(t, d, "fp")
	if len(templates) != 12 {
		t.Fatalf("%d stopped templates, want 12 (2 sessions x 6 nodes)", len(templates))
	}
	rng := rand.New(rand.NewSource(1))
	for k := 0; k < 100; k++ {
		i := rng.Intn(len(recs))
		// Change everything first, as an agent would.
		sessRun(t, d, "fp", "main", "V=dirty; cd /; unset -f f; export EXP=dirty")
		sessRun(t, d, "fp", "py", "d.clear(); step = -1")
		res := dbxRestore(t, d, "fp", recs[i].node)
		if res.Processes != 2 {
			t.Fatalf("restore %d to node %d: %d processes %v", k, i, res.Processes, res.ProcessErrors)
		}
		if b := sessRun(t, d, "fp", "main", bashProbe); b != recs[i].bash {
			t.Fatalf("restore %d to node %d: bash %q, recorded %q", k, i, b, recs[i].bash)
		}
		if p := sessRun(t, d, "fp", "py", pyProbe); p != recs[i].py {
			t.Fatalf("restore %d to node %d: python %q, recorded %q", k, i, p, recs[i].py)
		}
	}
	// Templates never ran: same set, still stopped, no user CPU time added. Tick-based
	// accounting can charge one tick of the injected syscalls' kernel time as user time
	// (the tick samples the mode at the interrupt), so one tick is tolerated; a template
	// that ran its own code for the ~8 forks it served would show far more.
	after := fpStoppedPids(t, d, "fp")
	if len(after) != len(templates) {
		t.Fatalf("templates changed: before %v after %v", templates, after)
	}
	for pid, u0 := range templates {
		u1, ok := after[pid]
		a, _ := strconv.Atoi(u0)
		b, _ := strconv.Atoi(u1)
		if !ok || b-a > 1 {
			t.Fatalf("template %d: utime %s ticks before, %q after (ran its own code?): before %v after %v", pid, u0, u1, templates, after)
		}
	}
	info, _ := d.C.Get(dbxCtx(t), "fp")
	if info.Stats.ProcessRestores < 106 || info.Stats.ProcessCheckpoints != 6 {
		t.Fatalf("path counts: %+v", info.Stats)
	}
}

// TestFastPathIneligibleProcessChangesNothing: a session holding a pipe cannot be
// checkpointed with its state: the checkpoint fails naming the process and the reason,
// and nothing changes.
// fpRefused checkpoints sandbox id and requires a 409 whose message holds every one of
// want, and no node made.
func fpRefused(t *testing.T, d *testutil.Daemon, id string, want ...string) {
	t.Helper()
	before, _ := d.C.Tree(dbxCtx(t))
	res, err := d.C.Checkpoint(dbxCtx(t), id, "refused")
	if err == nil && res.Node.Pending {
		// What only the fork shows (memory it did not copy: fastpath/forkcopy.go) refuses
		// after an early answer: the sandbox's next call answers the refusal instead.
		_, err = d.C.Exec(dbxCtx(t), id, api.ExecRequest{Argv: []string{"true"}})
		if err == nil || !strings.Contains(err.Error(), "failed after its answer") {
			t.Fatalf("the call after checkpoint %s of %s (answered early): %v, want the refusal", res.Node.ID, id, err)
		}
	}
	if !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("checkpoint of %s: %v, want a conflict", id, err)
	}
	for _, w := range want {
		if !strings.Contains(err.Error(), w) {
			t.Fatalf("checkpoint of %s: %v, want a message with %q", id, err, w)
		}
	}
	if after, _ := d.C.Tree(dbxCtx(t)); len(after.Nodes) != len(before.Nodes) {
		t.Fatalf("a refused checkpoint of %s made a node", id)
	}
}

func TestFastPathIneligibleProcessChangesNothing(t *testing.T) {
	// Durable images off: with them, CRIU takes the session instead (state/criutrees.go,
	// TestCRIUSessionTreesRoundTrip), and the refusal is what is left without it.
	d := testutil.StartDaemonEnv(t, testutil.NewStore(t), "DELTABOX_DURABLE=0")
	dbxCreate(t, d, "in")
	// The process substitution's child is waited for, so that the pipe is the only reason.
	sessRun(t, d, "in", "main", "echo a > f; V=kept; exec 7< <(echo hi); wait $!")
	fpRefused(t, d, "in", "fd 7 is pipe:", "session main")
	if out := sessRun(t, d, "in", "main", "echo $V; cat f"); out != "kept\na\n" {
		t.Fatalf("session after a refused checkpoint: %q", out)
	}
	sessRun(t, d, "in", "main", "exec 7<&-")
	dbxCheckpoint(t, d, "in", "ok")
}

// TestFastPathKilledTemplateRefusesRestore: killing a template from inside the sandbox
// makes a later restore of its node fail with a clear error, never a wrong state; other
// nodes still restore.
func TestFastPathKilledTemplateRefusesRestore(t *testing.T) {
	// Without durable images: with one, the node's processes come back from it
	// (TestDurableImageRestore), and the stopped processes the kill below picks from
	// would include the copies waiting for their dump.
	d := testutil.StartDaemonEnv(t, testutil.NewStore(t), "DELTABOX_DURABLE=0")
	dbxCreate(t, d, "kt")
	sessRun(t, d, "kt", "main", "V=one")
	n1 := dbxCheckpoint(t, d, "kt", "one")
	sessRun(t, d, "kt", "main", "V=two")
	n2 := dbxCheckpoint(t, d, "kt", "two")
	// The oldest stopped bash in the sandbox is n1's template; kill it from inside.
	sessRun(t, d, "kt", "main", `for p in /proc/[0-9]*; do s=$(cut -d' ' -f3 $p/stat); [ "$s" = T -o "$s" = t ] && echo ${p#/proc/}; done | sort -n | head -1 | xargs kill -9`)
	time.Sleep(100 * time.Millisecond)
	_, err := d.C.Restore(dbxCtx(t), "kt", n1.Node.ID)
	if !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "template") || !strings.Contains(err.Error(), "gone") {
		t.Fatalf("restore to a node whose template died: %v", err)
	}
	if out := sessRun(t, d, "kt", "main", "echo $V"); out != "two\n" {
		t.Fatalf("a refused restore changed the session: %q", out)
	}
	if res := dbxRestore(t, d, "kt", n2.Node.ID); res.Processes != 1 {
		t.Fatalf("restore to n2: %d processes: %v", res.Processes, res.ProcessErrors)
	}
	if out := sessRun(t, d, "kt", "main", "echo $V"); out != "two\n" {
		t.Fatalf("restore to n2: %q", out)
	}
}

// TestFastPathRestoreEndsBackgroundJobs: a process an exec left running (not a session's)
// is ended by a restore that brings the session back from its template, and counted.
func TestFastPathRestoreEndsBackgroundJobs(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "bg")
	sessRun(t, d, "bg", "main", "V=one")
	n1 := dbxCheckpoint(t, d, "bg", "one")
	sessRun(t, d, "bg", "main", "V=two")
	r := dbxExec(t, d, "bg", api.ExecRequest{Argv: []string{"bash", "-c", "setsid sleep 1000 </dev/null >/dev/null 2>&1 & echo $!"}})
	pid := strings.TrimSpace(r.Stdout)
	if r.ExitCode != 0 || pid == "" {
		t.Fatalf("start a background job: %+v", r)
	}
	if out := sessRun(t, d, "bg", "main", "[ -e /proc/"+pid+" ] && echo alive"); out != "alive\n" {
		t.Fatalf("the background job is not running: %q", out)
	}
	res := dbxRestore(t, d, "bg", n1.Node.ID)
	if res.Processes != 1 || res.Killed < 2 {
		t.Fatalf("restore: %d processes, %d killed (want the session back, the session and the job killed): %v", res.Processes, res.Killed, res.ProcessErrors)
	}
	if out := sessRun(t, d, "bg", "main", "echo $V; [ -e /proc/"+pid+" ] && echo alive || echo gone"); out != "one\ngone\n" {
		t.Fatalf("after the restore: %q", out)
	}
}

// TestFastPathTemplateIgnoresSIGCONT: a SIGCONT sent from inside the sandbox to every
// process (kill -CONT -1) right after a checkpoint does not resume its template (held in
// a ptrace-stop from its fork on, where SIGCONT does not reach): it runs no instruction
// of its own (user CPU time unchanged, still stopped), and its node restores exactly.
func TestFastPathTemplateIgnoresSIGCONT(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "sc")
	sessRun(t, d, "sc", "main", "V=one")
	n1 := dbxCheckpoint(t, d, "sc", "one")
	sessRun(t, d, "sc", "main", "V=two")
	before := fpStoppedPids(t, d, "sc")
	if len(before) != 1 {
		t.Fatalf("%d stopped processes after one checkpoint, want 1 template", len(before))
	}
	var tmpl int
	for p := range before {
		tmpl = p
	}
	// Held by the daemon's tracer from the checkpoint's answer on (no window).
	b, _ := os.ReadFile("/proc/" + strconv.Itoa(tmpl) + "/status")
	var tracer []string
	if i := bytes.Index(b, []byte("TracerPid:")); i >= 0 {
		tracer = strings.Fields(string(b[i+len("TracerPid:"):]))
	}
	if len(tracer) == 0 || tracer[0] == "0" {
		t.Fatalf("the template (pid %d) is not held by the daemon when the checkpoint answers", tmpl)
	}
	sessRun(t, d, "sc", "main", "kill -CONT -1")
	time.Sleep(200 * time.Millisecond)
	after := fpStoppedPids(t, d, "sc")
	if after[tmpl] != before[tmpl] {
		t.Fatalf("after kill -CONT -1 the template is %v (user ticks %q before), want still stopped, no user time", after, before[tmpl])
	}
	if res := dbxRestore(t, d, "sc", n1.Node.ID); res.Processes != 1 {
		t.Fatalf("restore to n1: %d processes: %v", res.Processes, res.ProcessErrors)
	}
	if out := sessRun(t, d, "sc", "main", "echo $V"); out != "one\n" {
		t.Fatalf("restore to n1 after kill -CONT -1: %q", out)
	}
}
