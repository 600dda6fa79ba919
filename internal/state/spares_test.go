package state_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/errdefs"
	"deltabox/internal/state"
	"deltabox/internal/testutil"
)

// spareFamily makes sandbox id with a python and a bash session and a background
// process, forks it once (its branch id+"b"), and returns the fork's node and a
// check of the node's state (the checkpoint's PIDs) in a sandbox.
func spareFamily(t *testing.T, m *state.Manager, id string) (node string, check func(sb string)) {
	t.Helper()
	ctx := context.Background()
	if _, err := m.Create(ctx, state.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	if _, err := m.StartSession(ctx, id, state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	pyPid := strings.TrimSpace(call(t, m, id, "py", "import os\nd = {i: str(i) for i in range(100000)}\nos.getpid()"))
	baPid := strings.TrimSpace(call(t, m, id, "main", "cd /tmp; V=v1; echo $$"))
	bgPid := strings.TrimSpace(sh(t, m, id, "echo f > /tmp/atF; nohup sleep 100000 </dev/null >/dev/null 2>&1 & echo $!"))
	for deadline := time.Now().Add(10 * time.Second); sh(t, m, id, "cat /proc/"+bgPid+"/comm") != "sleep\n"; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the background sleep did not exec") // nohup's, until it does: the node must hold the sleep
		}
	}
	res, err := m.ForkSandbox(ctx, id, state.CheckpointOptions{}, state.ForkOptions{Count: 1, CreateOptions: state.CreateOptions{ID: id + "b"}})
	if err != nil {
		t.Fatal(err)
	}
	if b := res.Branches[0]; b.Path != "fast" || b.Restore.Processes != 3 {
		t.Fatalf("fork: path %s (%s), %+v", b.Path, b.Reason, b.Restore)
	}
	return res.Node, func(sb string) {
		t.Helper()
		if got, want := call(t, m, sb, "py", "(len(d), d[0], os.getpid())"), fmt.Sprintf("(100000, '0', %s)\n", pyPid); got != want {
			t.Fatalf("%s: python %q, want %q", sb, got, want)
		}
		if got, want := call(t, m, sb, "main", `echo $PWD $V $$`), fmt.Sprintf("/tmp v1 %s\n", baPid); got != want {
			t.Fatalf("%s: bash %q, want %q", sb, got, want)
		}
		if got := sh(t, m, sb, "cat /proc/"+bgPid+"/comm /tmp/atF; ls /tmp; cat /proc/[0-9]*/comm | grep -cx sleep"); got != "sleep\nf\natF\n1\n" {
			t.Fatalf("%s: background process, files, sleeps (the divergent one must be gone): %q", sb, got)
		}
	}
}

// diverge changes sb's python, bash, files and processes from the node's.
func diverge(t *testing.T, m *state.Manager, sb string) {
	t.Helper()
	call(t, m, sb, "py", "d[0] = 'diverged'; d2 = bytearray(10 << 20)")
	call(t, m, sb, "main", "V=v2; cd /")
	sh(t, m, sb, "echo x > /tmp/div; rm /tmp/atF; nohup sleep 7777 </dev/null >/dev/null 2>&1 &")
}

// waitSpare waits until sb holds a spare of node (the background one after a restore).
func waitSpare(t *testing.T, m *state.Manager, node, sb string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		n, err := m.Node(node)
		if err != nil {
			t.Fatal(err)
		}
		if slices.Contains(n.Spares, sb) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("no spare of %s in %s after 30 s: %v", node, sb, n.Spares)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestSpareRestore(t *testing.T) {
	testutil.Require(t, os.Geteuid() == 0, "needs root")
	root := testutil.NewStore(t)
	m := openWith(t, root, state.DefaultConfig())
	defer m.Close()
	ctx := context.Background()
	node, check := spareFamily(t, m, "sp")
	const b = "spb"
	n, err := m.PrepareSpare(ctx, node, b)
	if err != nil || !slices.Contains(n.Spares, b) {
		t.Fatalf("prepare %s for %s: %v %+v", node, b, err, n)
	}
	for i := range 2 {
		diverge(t, m, b)
		r, err := m.Restore(ctx, b, node)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("restore %d: from_spare %v, %.2f ms, phases %v", i, r.FromSpare, r.DurationMS, r.PhasesUS)
		if !r.FromSpare || r.Processes != 3 || len(r.ProcessErrors) > 0 {
			t.Fatalf("restore %d of %s in %s: %+v", i, node, b, r)
		}
		check(b)
		waitSpare(t, m, node, b) // the next one, made in the background
	}
	// A spare whose copy was killed from the host: the restore forks instead, correctly.
	pids := state.SpareCopies(m, b, node)
	if len(pids) != 3 {
		t.Fatalf("spare copies: %v", pids)
	}
	if err := unix.Kill(pids[0], unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	diverge(t, m, b)
	r, err := m.Restore(ctx, b, node)
	if err != nil || r.FromSpare || r.Processes != 3 {
		t.Fatalf("restore with a dead spare: %v %+v", err, r)
	}
	t.Logf("with a dead spare: %v", r.Warnings)
	check(b)
	info, err := m.Get(b)
	if err != nil {
		t.Fatal(err)
	}
	st := info.Stats
	if st.RestorePaths.Spare != 2 || st.SparesMade < 3 || st.SparesDropped < 1 {
		t.Fatalf("stats: restore_paths.spare %d, spares made %d, dropped %d", st.RestorePaths.Spare, st.SparesMade, st.SparesDropped)
	}
	// The source (a member too) takes its own; a node of a plain sandbox is refused.
	if _, err := m.PrepareSpare(ctx, node, ""); err != nil {
		t.Fatalf("prepare for the source: %v", err)
	}
	if _, err := m.Create(ctx, state.CreateOptions{ID: "plain"}); err != nil {
		t.Fatal(err)
	}
	sh(t, m, "plain", "true")
	cp, err := m.Checkpoint(ctx, "plain", "")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.PrepareSpare(ctx, cp.Node.ID, ""); !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "fork") {
		t.Fatalf("prepare of a plain sandbox's node: %v", err)
	}
	// A member holding templates of its own (a node made after the fork, in its
	// namespace, which a swap would end) is refused a spare, with why.
	if _, err := m.Checkpoint(ctx, b, ""); err != nil {
		t.Fatal(err)
	}
	if _, err := m.PrepareSpare(ctx, node, b); !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "templates of its own") {
		t.Fatalf("prepare for a member with templates of its own: %v", err)
	}
	// Removing the branch drops its spare (its copies end).
	if err := m.Remove(b); err != nil {
		t.Fatal(err)
	}
	if n, err := m.Node(node); err != nil || slices.Contains(n.Spares, b) {
		t.Fatalf("after the branch's removal: %v %v", err, n.Spares)
	}
}

// criuForkSource makes sandbox id with a sleep (a template) and a two-threaded python
// (CRIU takes it: the fast path refuses it) whose second thread's TID is 64 above its
// PID (TestForkFloorCoversCRIUThreads: not PID+1, which a floor of the PIDs alone
// would cover by chance), checkpoints it (the returned node), ends the python and forks the sandbox by the
// fast path (branch id+"b"; the fork's own node may hold no CRIU tree). It returns the
// python's PID and its thread's TID.
// startThreadAbove starts in sandbox id a background python whose second thread's TID
// is 64 above its PID (it forks 64 children first), and returns its PID and that TID.
func startThreadAbove(t *testing.T, m *state.Manager, id string) (thr string, tid int) {
	t.Helper()
	thr = strings.TrimSpace(sh(t, m, id, `nohup python3 -c 'import os, threading, time
for _ in range(64):
    p = os.fork()
    if p == 0: os._exit(0)
    os.waitpid(p, 0)
threading.Thread(target=time.sleep, args=(100000,), daemon=True).start()
time.sleep(100000)' </dev/null >/dev/null 2>&1 & echo $!`))
	var tids []string
	for deadline := time.Now().Add(10 * time.Second); len(tids) != 2; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the two-threaded python did not start its second thread")
		}
		tids = strings.Fields(sh(t, m, id, "ls /proc/"+thr+"/task"))
	}
	tid = max(atoi(tids[0]), atoi(tids[1]))
	if tid < atoi(thr)+64 {
		t.Fatalf("the python's thread has TID %d, its PID is %s: want 64 above", tid, thr)
	}
	return thr, tid
}

func criuForkSource(t *testing.T, m *state.Manager, id string) (node, thr string, tid int) {
	t.Helper()
	ctx := context.Background()
	if _, err := m.Create(ctx, state.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	sh(t, m, id, "nohup sleep 100000 </dev/null >/dev/null 2>&1 &")
	thr, tid = startThreadAbove(t, m, id)
	cp, err := m.Checkpoint(ctx, id, "")
	if err != nil || cp.CRIUProcesses != 1 {
		t.Fatalf("checkpoint with a two-threaded process: %v %+v", err, cp)
	}
	if _, err := m.Signal(id, atoi(thr), int(unix.SIGKILL)); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); sh(t, m, id, "test -e /proc/"+thr+" && echo there; true") != ""; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the two-threaded python did not end")
		}
	}
	res, err := m.ForkSandbox(ctx, id, state.CheckpointOptions{}, state.ForkOptions{Count: 1, CreateOptions: state.CreateOptions{ID: id + "b"}})
	if err != nil || res.Branches[0].Path != "fast" {
		t.Fatalf("fork: %v %+v", err, res)
	}
	return cp.Node.ID, thr, tid
}

// TestSpareRefusedForCRIUNode: a node holding a process that CRIU took (two threads:
// the fast path refuses it) has no spare: a spare holds copies of the node's templates
// alone, and its swap restored no CRIU tree, so the node came back without that process
// (TestModelForkSpares found it). In the member that made the node, its restores fork
// and bring the process back through CRIU, every time; prepare answers 409 saying why.
func TestSpareRefusedForCRIUNode(t *testing.T) {
	testutil.Require(t, os.Geteuid() == 0, "needs root")
	m := openDurable(t, testutil.NewStore(t)) // CRIU on
	defer m.Close()
	ctx := context.Background()
	const id = "spcriu"
	node, thr, _ := criuForkSource(t, m, id)
	for i := range 2 {
		r, err := m.Restore(ctx, id, node)
		if err != nil || r.FromSpare || r.CRIUProcesses != 1 {
			t.Fatalf("restore %d of a node with a CRIU tree: %v %+v", i, err, r)
		}
		if got := sh(t, m, id, "ls /proc/"+thr+"/task | wc -l"); got != "2\n" {
			t.Fatalf("restore %d: the node's two-threaded process has %q threads", i, got)
		}
		if _, err := m.PrepareSpare(ctx, node, id); !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "processes that CRIU took") {
			t.Fatalf("prepare of a node with a CRIU tree: %v", err)
		}
	}
	if n, err := m.Node(node); err != nil || len(n.Spares) != 0 {
		t.Fatalf("spares of a node with a CRIU tree: %v %v", n.Spares, err)
	}
}

// TestForkFloorCoversCRIUThreads: a fast fork's namespaces number their processes above
// the PIDs of every node of the source (pidFloor), not only above the fork's node's
// templates: a member's restore of an earlier node gives back its CRIU tree's processes
// and threads at their PIDs and TIDs (clone3 set_tid), and a process or a thread of the
// source's new init that took one failed it ("Unable to create a thread: -17", the
// process not brought back; 1 run in 4 of TestSpareRefusedForCRIUNode when its thread's
// TID was its PID+1). Here the floor is the node's durable image's copy of the sleep,
// made after the thread.
func TestForkFloorCoversCRIUThreads(t *testing.T) {
	testutil.Require(t, os.Geteuid() == 0, "needs root")
	m := openDurable(t, testutil.NewStore(t)) // CRIU on
	defer m.Close()
	const id = "spfloor"
	_, _, tid := criuForkSource(t, m, id)
	for _, sb := range []string{id, id + "b"} { // the source in its new namespace, the branch
		if pid := atoi(strings.TrimSpace(sh(t, m, sb, "echo $$"))); pid <= tid {
			t.Fatalf("%s: a command after the fork has PID %d, not above the CRIU tree's thread TID %d", sb, pid, tid)
		}
	}
}

// TestSpareFailureAtEveryStepKeepsSandbox: a restore from a spare that fails at any of
// its steps (fault injection before each) leaves the member exactly as it was: its
// python and bash state, its files, its processes (the one started since the node
// included); the next restore, from a new spare, is the node's.
func TestSpareFailureAtEveryStepKeepsSandbox(t *testing.T) {
	testutil.Require(t, os.Geteuid() == 0, "needs root")
	root := testutil.NewStore(t)
	m := openWith(t, root, state.DefaultConfig())
	defer m.Close()
	defer state.SetFailStep(m, nil)
	ctx := context.Background()
	node, check := spareFamily(t, m, "spf")
	const b = "spfb"
	diverge(t, m, b)
	injected := errors.New("injected")
	for k := 1; k <= state.SpareStepCount; k++ {
		if _, err := m.PrepareSpare(ctx, node, b); err != nil {
			t.Fatal(err)
		}
		state.SetFailStep(m, func(op string, step int) error {
			if op == "restore-spare" && step == k {
				return injected
			}
			return nil
		})
		_, err := m.Restore(ctx, b, node)
		state.SetFailStep(m, nil)
		if !errors.Is(err, injected) {
			t.Fatalf("step %d: restore %v, want the injected failure", k, err)
		}
		if got := call(t, m, b, "py", "(d[0], len(d2))"); got != "('diverged', 10485760)\n" {
			t.Fatalf("step %d: python after the failed restore: %q", k, got)
		}
		if got := call(t, m, b, "main", "echo $V $PWD"); got != "v2 /\n" {
			t.Fatalf("step %d: bash after the failed restore: %q", k, got)
		}
		if got := sh(t, m, b, "cat /tmp/div; ls /tmp; cat /proc/[0-9]*/comm | grep -cx sleep"); got != "x\ndiv\n2\n" {
			t.Fatalf("step %d: files and processes after the failed restore: %q", k, got)
		}
	}
	if _, err := m.PrepareSpare(ctx, node, b); err != nil {
		t.Fatal(err)
	}
	r, err := m.Restore(ctx, b, node)
	if err != nil || !r.FromSpare {
		t.Fatalf("restore after the failures: %v %+v", err, r)
	}
	check(b)
}

// TestSparesDroppedFirstOverBudget: a member's spare counts in its template budget, and
// a checkpoint that finds the budget full drops the spare first (it is only work done
// ahead) instead of waiting and failing with 507: no template of the member could be
// evicted to make room.
func TestSparesDroppedFirstOverBudget(t *testing.T) {
	testutil.Require(t, os.Geteuid() == 0, "needs root")
	root := testutil.NewStore(t)
	m := openWith(t, root, state.DefaultConfig())
	defer m.Close()
	ctx := context.Background()
	if _, err := m.Create(ctx, state.CreateOptions{ID: "spbud", TemplateBudgetMB: 8}); err != nil {
		t.Fatal(err)
	}
	if _, err := m.StartSession(ctx, "spbud", state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	call(t, m, "spbud", "py", "import os\nbig = os.urandom(32 << 20)\nlen(big)")
	res, err := m.ForkSandbox(ctx, "spbud", state.CheckpointOptions{}, state.ForkOptions{Count: 1, CreateOptions: state.CreateOptions{ID: "spbudb"}})
	if err != nil || res.Branches[0].Path != "fast" {
		t.Fatalf("fork: %v %+v", err, res)
	}
	const b = "spbudb"
	if _, err := m.PrepareSpare(ctx, res.Node, b); err != nil {
		t.Fatal(err)
	}
	info, err := m.Get(b)
	if err != nil || info.Stats.SpareBytes <= 8<<20 {
		t.Fatalf("the spare holds %d bytes (%v): the test needs it over the 8 MB budget", info.Stats.SpareBytes, err)
	}
	t.Logf("the spare holds %.1f MB pss_anon, %.1f MB alone", float64(info.Stats.SpareBytes)/(1<<20), float64(info.Stats.SparePrivateBytes)/(1<<20))
	if _, err := m.CheckpointWith(ctx, b, state.CheckpointOptions{Wait: 2 * time.Second, Answer: state.AnswerComplete}); err != nil {
		t.Fatalf("checkpoint over the budget with a spare to drop: %v", err)
	}
	info, err = m.Get(b)
	if err != nil || info.Stats.SparesDropped != 1 || info.Stats.SpareBytes != 0 {
		t.Fatalf("after the checkpoint: spares dropped %d, holding %d (%v)", info.Stats.SparesDropped, info.Stats.SpareBytes, err)
	}
	if n, err := m.Node(res.Node); err != nil || len(n.Spares) != 0 {
		t.Fatalf("the node's spares after the checkpoint: %v (%v)", n.Spares, err)
	}
}

// TestSpareWaitsForIdleCPUs: a spare made in the background after a restore starts only
// once the CPUs are idle (no task waited for one over a window, by /proc/pressure/cpu):
// while more CPU-bound processes than CPUs run, none is made (the spare's making would
// take the CPUs the agents' calls use); once they stop, it is, its init's threads at
// nice 10, reset to 0 when it becomes the sandbox's (as are the commands it starts
// then). A spare the client asks for (PrepareSpare) is made at once, busy CPUs or not,
// at nice 0.
func TestSpareWaitsForIdleCPUs(t *testing.T) {
	testutil.Require(t, os.Geteuid() == 0, "needs root")
	_, err := os.Stat("/proc/pressure/cpu")
	testutil.Require(t, err == nil, "needs the kernel's pressure accounting (/proc/pressure/cpu)")
	root := testutil.NewStore(t)
	m := openWith(t, root, state.DefaultConfig())
	defer m.Close()
	ctx := context.Background()
	node, check := spareFamily(t, m, "si")
	const b = "sib"
	// More busy loops than CPUs: some task always waits for a CPU.
	var hogs []*exec.Cmd
	stopHogs := func() {
		for _, h := range hogs {
			h.Process.Kill()
			h.Wait()
		}
		hogs = nil
	}
	defer stopHogs()
	for range runtime.NumCPU() + 1 {
		h := exec.Command("sh", "-c", "while :; do :; done")
		if err := h.Start(); err != nil {
			t.Fatal(err)
		}
		hogs = append(hogs, h)
	}
	if n, err := m.PrepareSpare(ctx, node, b); err != nil || !slices.Contains(n.Spares, b) {
		t.Fatalf("prepare %s for %s while the CPUs are busy: %v %+v", node, b, err, n)
	}
	wantNice(t, state.SpareInit(m, b, node), 0)
	diverge(t, m, b)
	r, err := m.Restore(ctx, b, node)
	if err != nil || !r.FromSpare {
		t.Fatalf("restore: %v %+v", err, r)
	}
	check(b)
	// The next spare waits: none within a second (less than the wait's bound).
	for deadline := time.Now().Add(time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if n, err := m.Node(node); err != nil || slices.Contains(n.Spares, b) {
			t.Fatalf("a spare of %s was made in %s while the CPUs were busy (%v)", node, b, err)
		}
	}
	stopHogs()
	waitSpare(t, m, node, b)
	init := state.SpareInit(m, b, node)
	wantNice(t, init, 10)
	diverge(t, m, b)
	if r, err := m.Restore(ctx, b, node); err != nil || !r.FromSpare {
		t.Fatalf("restore from the spare made once idle: %v %+v", err, r)
	}
	check(b)
	wantNice(t, init, 0) // now b's init
	if got := sh(t, m, b, "nice"); got != "0\n" {
		t.Fatalf("a command's nice after the swap: %q", got)
	}
}

// wantNice fails t unless every thread of host process pid is at nice.
func wantNice(t *testing.T, pid, nice int) {
	t.Helper()
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil || len(tasks) == 0 {
		t.Fatalf("threads of %d: %v", pid, err)
	}
	for _, task := range tasks {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/stat", pid, task.Name()))
		if err != nil {
			t.Fatal(err)
		}
		f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:])) // f[0] is field 3 (state); nice is 19
		if f[16] != strconv.Itoa(nice) {
			t.Fatalf("thread %s of %d: nice %s, want %d", task.Name(), pid, f[16], nice)
		}
	}
}

// TestNodeForkFloorCoversCRIUThreads: a fork of a node whose CRIU tree's largest ID is a
// thread's (a python whose second thread came 64 PIDs after it, nothing started after
// it) boots each branch with its next PID above that thread's TID, not only above the
// tree's PIDs: a thread of the branch's init that took it failed the tree's restore
// ("Unable to create a thread: -17"; 1 run in 8 of TestForkCarriesTCPConnection).
func TestNodeForkFloorCoversCRIUThreads(t *testing.T) {
	testutil.Require(t, os.Geteuid() == 0, "needs root")
	m := openDurable(t, testutil.NewStore(t)) // CRIU on
	defer m.Close()
	ctx := context.Background()
	const id = "nfloor"
	if _, err := m.Create(ctx, state.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	_, tid := startThreadAbove(t, m, id)
	cp, err := m.Checkpoint(ctx, id, "")
	if err != nil || cp.CRIUProcesses != 1 {
		t.Fatalf("checkpoint with a two-threaded process: %v %+v", err, cp)
	}
	res, err := m.Fork(ctx, cp.Node.ID, state.ForkOptions{Count: 1, CreateOptions: state.CreateOptions{ID: id + "b"}})
	if err != nil || len(res.Branches) != 1 {
		t.Fatalf("fork: %v %+v", err, res)
	}
	b := res.Branches[0]
	if b.Restore == nil || b.Restore.CRIUProcesses != 1 {
		t.Fatalf("the branch's restore: %+v (%s)", b.Restore, b.Reason)
	}
	if pid := atoi(strings.TrimSpace(sh(t, m, id+"b", "echo $$"))); pid <= tid {
		t.Fatalf("a command in the branch has PID %d, not above the CRIU tree's thread TID %d", pid, tid)
	}
}
