package e2e

import (
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/state"
	"deltabox/internal/testutil"
)

// forkSource makes a sandbox with a python session (a dict of 10^5 objects, a
// generator mid-iteration, a random.Random), a bash session (a variable, a function, a
// cwd) and a background process, checkpoints it and returns the node and the PIDs.
func forkSource(t *testing.T, d *testutil.Daemon, id string) (node, pyPid, bashPid, bgPid string) {
	t.Helper()
	pyPid, bashPid, bgPid = forkSourceLive(t, d, id)
	node = dbxCheckpoint(t, d, id, "fork-source").Node.ID
	return node, pyPid, bashPid, bgPid
}

// forkSourceLive makes forkSource's sandbox, without its checkpoint.
func forkSourceLive(t *testing.T, d *testutil.Daemon, id string) (pyPid, bashPid, bgPid string) {
	t.Helper()
	dbxCreate(t, d, id)
	if _, err := d.C.StartSession(dbxCtx(t), id, state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	pyPid = strings.TrimSpace(sessRun(t, d, id, "py", "import os, random\n"+
		"d = {i: str(i) for i in range(10**5)}\n"+
		"def gen():\n    i = 0\n    while True:\n        yield i\n        i += 1\n"+
		"g = gen(); [next(g) for _ in range(5)]\n"+
		"r = random.Random(7); r.random()\n"+
		"os.getpid()"))
	bashPid = strings.TrimSpace(sessRun(t, d, id, "main", "cd /tmp; export FOO=bar; hello() { echo hi-$1; }; echo $$"))
	bgPid = strings.TrimSpace(dbxSh(t, d, id, `nohup sleep 100000 </dev/null >/dev/null 2>&1 & echo $!`))
	dbxSh(t, d, id, "echo source > /workspace/f")
	return pyPid, bashPid, bgPid
}

// forkCheckBranch checks that branch sb has the source's state at the checkpoint:
// python's objects, generator and random state at their PIDs, bash's variable, function
// and cwd, the background process at its PID, the file.
func forkCheckBranch(t *testing.T, d *testutil.Daemon, sb, pyPid, bashPid, bgPid, want string) {
	t.Helper()
	got := sessRun(t, d, sb, "py", "q = random.Random(7); q.random(); (len(d), d[99999], next(g), r.random() == q.random(), os.getpid())")
	if exp := fmt.Sprintf("(100000, '99999', 5, True, %s)\n", pyPid); got != exp {
		t.Fatalf("branch %s: python %q, want %q", sb, got, exp)
	}
	if got := sessRun(t, d, sb, "main", "echo $(pwd) $FOO $(hello x) $$"); got != fmt.Sprintf("/tmp bar hi-x %s\n", bashPid) {
		t.Fatalf("branch %s: bash %q", sb, got)
	}
	if got := dbxSh(t, d, sb, "cat /proc/"+bgPid+"/comm; cat /workspace/f"); got != "sleep\n"+want+"\n" {
		t.Fatalf("branch %s: background process and file: %q", sb, got)
	}
}

// TestForkDurableCarriesProcesses: POST /v1/nodes/ID/fork {"count": 8} makes 8
// sandboxes each running the node's processes (a python session with a dict of 10^5
// objects, a generator mid-iteration and a random.Random; a bash session's variable,
// function and cwd; a background process) at their checkpoint PIDs, restored from the
// node's durable image (path "durable"), each with its identity and stats; each branch
// diverges (files and python) and sees only its own writes, the source none of them;
// kill -9 -1 in one branch leaves its siblings and the source running; each branch then
// restores the node and sees exactly the checkpoint's state (its own templates, or the
// image for the branch whose templates the kill took).
func TestForkDurableCarriesProcesses(t *testing.T) {
	d := testutil.StartDaemon(t)
	node, pyPid, bashPid, bgPid := forkSource(t, d, "fsrc")
	sessRun(t, d, "fsrc", "py", "d[0] = 'source-after'")
	const n = 8
	t0 := time.Now()
	res, err := d.C.Fork(dbxCtx(t), node, apitypes.ForkRequest{Count: n, CreateOptions: apitypes.CreateOptions{ID: "fb"}})
	if err != nil {
		t.Fatalf("fork: %v\ndaemon log:\n%s", err, dbxTail(d.Log(), 4000))
	}
	t.Logf("fork of %d: %v (daemon %.0f ms, image wait %.0f ms)", n, time.Since(t0), res.DurationMS, res.ImageWaitMS)
	if len(res.Branches) != n {
		t.Fatalf("%d branches, want %d", len(res.Branches), n)
	}
	for i, b := range res.Branches {
		if b.Path != "durable" || b.Restore.Processes != 3 || b.Sandbox.ID != fmt.Sprintf("fb-%d", i) {
			t.Fatalf("branch %d: %s path %s (%s), %d processes %v", i, b.Sandbox.ID, b.Path, b.Reason, b.Restore.Processes, b.Restore.ProcessErrors)
		}
		if o := b.Sandbox.Stats.Fork; o == nil || o.Node != node || o.Branch != i || o.Count != n || o.Path != "durable" {
			t.Fatalf("branch %d's stats.fork: %+v", i, o)
		}
	}
	if in, err := d.C.Get(dbxCtx(t), "fsrc"); err != nil || in.Stats.ForkPaths["durable"] != n {
		t.Fatalf("the source's stats.fork_paths: %v (%v)", in.Stats.ForkPaths, err)
	}
	for _, b := range res.Branches {
		forkCheckBranch(t, d, b.Sandbox.ID, pyPid, bashPid, bgPid, "source")
		forkCheckIdentity(t, d, b.Sandbox.ID, b.Branch, n, node)
	}
	// Divergence: each branch writes its own file and python state; each sees its own
	// only.
	for _, b := range res.Branches {
		sessRun(t, d, b.Sandbox.ID, "py", fmt.Sprintf("d[1] = 'b%d'", b.Branch))
		dbxSh(t, d, b.Sandbox.ID, fmt.Sprintf("echo b%d > /workspace/f", b.Branch))
	}
	for _, b := range res.Branches {
		want := fmt.Sprintf("b%d", b.Branch)
		if got := sessRun(t, d, b.Sandbox.ID, "py", "d[1]"); got != "'"+want+"'\n" {
			t.Fatalf("branch %d's python: %q, want its own %s", b.Branch, got, want)
		}
		if got := dbxSh(t, d, b.Sandbox.ID, "cat /workspace/f"); got != want+"\n" {
			t.Fatalf("branch %d's file: %q, want its own %s", b.Branch, got, want)
		}
	}
	if got := sessRun(t, d, "fsrc", "py", "(d[0], d[1])"); got != "('source-after', '1')\n" {
		t.Fatalf("the source's python: %q", got)
	}
	// kill -9 -1 in branch 0, from its bash session (kill(2) spares the caller; a
	// signal reaches no process outside the sender's Landlock domain, each session's
	// own): its child dies, siblings and source go on.
	if got := sessRun(t, d, "fb-0", "main", "sleep 1000 & kill -9 -1; wait $! 2>/dev/null; kill -0 $! 2>/dev/null && echo alive || echo dead"); !strings.HasSuffix(got, "dead\n") {
		t.Fatalf("kill -9 -1 in fb-0 did not reach its own child: %q", got)
	}
	for _, b := range res.Branches[1:] {
		sb := b.Sandbox.ID
		if got := dbxSh(t, d, sb, "cat /proc/"+bgPid+"/comm"); got != "sleep\n" {
			t.Fatalf("%s's background process after kill -9 -1 in fb-0: %q", sb, got)
		}
		if got := sessRun(t, d, sb, "py", "len(d)"); got != "100000\n" {
			t.Fatalf("%s's python after kill -9 -1 in fb-0: %q", sb, got)
		}
	}
	if got := sessRun(t, d, "fsrc", "py", "d[0]"); got != "'source-after'\n" {
		t.Fatalf("the source's python after kill -9 -1 in fb-0: %q", got)
	}
	// Each branch restores the node again: exactly the checkpoint's state. Branch 0's
	// bash template was killed with the rest: the node's image brings it back; the
	// others fork from their own templates.
	for _, b := range res.Branches {
		r := dbxRestore(t, d, b.Sandbox.ID, node)
		if r.Processes != 3 || r.FromImage != (b.Branch == 0) {
			t.Fatalf("branch %d's restore to the node: %d processes %v, from image %v", b.Branch, r.Processes, r.ProcessErrors, r.FromImage)
		}
		forkCheckBranch(t, d, b.Sandbox.ID, pyPid, bashPid, bgPid, "source")
		if got := sessRun(t, d, b.Sandbox.ID, "py", "d[1]"); got != "'1'\n" {
			t.Fatalf("branch %d after its restore: %q", b.Branch, got)
		}
		forkCheckIdentity(t, d, b.Sandbox.ID, b.Branch, n, node) // never rolled back
	}
	// The source has none.
	if got := dbxSh(t, d, "fsrc", "cat /run/deltabox/identity 2>&1 || true"); !strings.Contains(got, "No such file") {
		t.Fatalf("the source's identity: %q", got)
	}
}

// forkCheckIdentity checks branch sb's /run/deltabox/identity, from a command and from
// the restored python.
func forkCheckIdentity(t *testing.T, d *testutil.Daemon, sb string, branch, count int, node string) {
	t.Helper()
	want := fmt.Sprintf(`{"sandbox":%q,"branch":%d,"count":%d,"parent_node":%q}`, sb, branch, count, node)
	if got := dbxSh(t, d, sb, "cat /run/deltabox/identity; stat -c '%a %U' /run/deltabox/identity"); got != want+"\n444 root\n" {
		t.Fatalf("%s's identity: %q, want %q", sb, got, want)
	}
	if got := sessRun(t, d, sb, "py", "open('/run/deltabox/identity').read()"); got != fmt.Sprintf("'%s\\n'\n", want) {
		t.Fatalf("%s's identity read by its python: %q", sb, got)
	}
}

// TestForkFromNodeWhoseSandboxIsGone: a node whose sandbox was removed forks with its
// processes, from its durable image.
func TestForkFromNodeWhoseSandboxIsGone(t *testing.T) {
	d := testutil.StartDaemon(t)
	node, pyPid, bashPid, bgPid := forkSource(t, d, "gone")
	sessRun(t, d, "gone", "py", "d[0] = 'second'")
	dbxSh(t, d, "gone", "echo second > /workspace/f")
	node2 := dbxCheckpoint(t, d, "gone", "second").Node.ID
	durWaitImage(t, d, node)
	durWaitImage(t, d, node2)
	if err := d.C.Remove(dbxCtx(t), "gone"); err != nil {
		t.Fatal(err)
	}
	res, err := d.C.Fork(dbxCtx(t), node2, apitypes.ForkRequest{Count: 2, CreateOptions: apitypes.CreateOptions{Workdir: "/workspace"}})
	if err != nil {
		t.Fatalf("fork: %v\ndaemon log:\n%s", err, dbxTail(d.Log(), 4000))
	}
	for _, b := range res.Branches {
		if b.Path != "durable" || b.Restore.Processes != 3 {
			t.Fatalf("branch %d: %s path %s (%s), %d processes %v", b.Branch, b.Sandbox.ID, b.Path, b.Reason, b.Restore.Processes, b.Restore.ProcessErrors)
		}
		forkCheckBranch(t, d, b.Sandbox.ID, pyPid, bashPid, bgPid, "second")
		if got := sessRun(t, d, b.Sandbox.ID, "py", "d[0]"); got != "'second'\n" {
			t.Fatalf("branch %d's python: %q", b.Branch, got)
		}
		forkCheckIdentity(t, d, b.Sandbox.ID, b.Branch, 2, node2)
	}
	// A fork whose branch 2 cannot be made (its name is taken) removes branches 0 and
	// 1, restored with their processes, and says which branch failed and why.
	dbxCreate(t, d, "taken-2")
	before, err := d.C.List(dbxCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.C.Fork(dbxCtx(t), node2, apitypes.ForkRequest{Count: 3, CreateOptions: apitypes.CreateOptions{ID: "taken"}}); err == nil ||
		!strings.Contains(err.Error(), "branch 2 of 3") || !strings.Contains(err.Error(), "already exists") || !strings.Contains(err.Error(), "2 branches made were removed") {
		t.Fatalf("fork with branch 2's name taken: %v", err)
	}
	if after, err := d.C.List(dbxCtx(t)); err != nil || len(after) != len(before) {
		t.Fatalf("a failed fork left %d sandboxes, %d before (%v)", len(after), len(before), err)
	}
	// A branch restores the node made before the fork node, with its processes.
	sb := res.Branches[1].Sandbox.ID
	if r := dbxRestore(t, d, sb, node); r.Processes != 3 || !r.FromImage {
		t.Fatalf("restore of the earlier node in a branch: %d processes %v, from image %v", r.Processes, r.ProcessErrors, r.FromImage)
	}
	forkCheckBranch(t, d, sb, pyPid, bashPid, bgPid, "source")
	if got := sessRun(t, d, sb, "py", "d[0]"); got != "'0'\n" {
		t.Fatalf("branch's python after the restore of the earlier node: %q", got)
	}
	forkCheckIdentity(t, d, sb, 1, 2, node2)
}

// TestForkFilesOnlySaysWhy: a node without processes forks its files, each branch's
// path "files" with the reason; processes "require" refuses it (409) and makes nothing.
func TestForkFilesOnlySaysWhy(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "plain")
	dbxSh(t, d, "plain", "echo x > /workspace/f")
	node := dbxCheckpoint(t, d, "plain", "files").Node.ID
	if _, err := d.C.Fork(dbxCtx(t), node, apitypes.ForkRequest{Count: 2, Processes: "require"}); err == nil || !strings.Contains(err.Error(), "holds no process") {
		t.Fatalf("fork with processes required of a node without any: %v", err)
	}
	if l, err := d.C.List(dbxCtx(t)); err != nil || len(l) != 1 {
		t.Fatalf("a refused fork left %d sandboxes (%v)", len(l), err)
	}
	res, err := d.C.Fork(dbxCtx(t), node, apitypes.ForkRequest{Count: 2})
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range res.Branches {
		if b.Path != "files" || !strings.Contains(b.Reason, "holds no process") {
			t.Fatalf("branch %d: path %s (%s)", b.Branch, b.Path, b.Reason)
		}
		if got := dbxSh(t, d, b.Sandbox.ID, "cat /workspace/f"); got != "x\n" {
			t.Fatalf("branch %d's file: %q", b.Branch, got)
		}
	}
	// The CLI: one line per branch, its id, path, processes and why.
	out, err := testutil.Command(t, time.Minute, testutil.Binary(t), "--socket", d.Socket, "fork", node, "--count", "2", "--name", "cli").Output()
	if err != nil {
		t.Fatalf("deltabox fork: %v", err)
	}
	if lines := strings.Split(strings.TrimSpace(string(out)), "\n"); len(lines) != 2 || !strings.HasPrefix(lines[0], "cli-0\tfiles\t0 processes\tthe node holds no process") || !strings.HasPrefix(lines[1], "cli-1\tfiles\t") {
		t.Fatalf("deltabox fork printed %q", out)
	}
	if _, err := d.C.Fork(dbxCtx(t), node, apitypes.ForkRequest{Count: 0}); err == nil || !strings.Contains(err.Error(), "want 1 to") {
		t.Fatalf("fork of 0: %v", err)
	}
	if _, err := d.C.Fork(dbxCtx(t), "nope", apitypes.ForkRequest{Count: 1}); err == nil || !strings.Contains(err.Error(), "no node") {
		t.Fatalf("fork of no node: %v", err)
	}
	// A daemon without durable images: a node with a python session forks its files,
	// at once, saying why.
	d2 := testutil.StartDaemonNoImages(t)
	dbxCreate(t, d2, "noimg")
	if _, err := d2.C.StartSession(dbxCtx(t), "noimg", state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	sessRun(t, d2, "noimg", "py", "x = 1")
	node2 := dbxCheckpoint(t, d2, "noimg", "py").Node.ID
	t0 := time.Now()
	res, err = d2.C.Fork(dbxCtx(t), node2, apitypes.ForkRequest{Count: 1})
	if err != nil {
		t.Fatal(err)
	}
	if b := res.Branches[0]; b.Path != "files" || !strings.Contains(b.Reason, "writes no durable images") || time.Since(t0) > 30*time.Second {
		t.Fatalf("fork without durable images: path %s (%s) after %v", b.Path, b.Reason, time.Since(t0))
	}
}

// TestForkPythonClient runs the Python client's fork tests against a daemon that writes
// durable images (TestPythonClient's does not): ckpt.fork(count=2) in one request, each
// branch's python session at its PID with its objects, its fork_branch and identity;
// the aio client's fork.
func TestForkPythonClient(t *testing.T) {
	py, err := exec.LookPath("python3")
	testutil.Require(t, err == nil, "needs python3 for the Python client's tests: %v", err)
	repo := pycRepo(t)
	d := testutil.StartDaemon(t)
	env := map[string]string{
		"DELTABOX_SOCKET":            d.Socket,
		"DELTABOX_TEST_FORK_DURABLE": "1",
		"PYTHONDONTWRITEBYTECODE":    "1",
		"PYTHONPATH":                 filepath.Join(repo, "clients", "python"),
	}
	out, err := pycCmd(t, py, filepath.Join(repo, "clients", "python", "tests"), env, "-m", "unittest", "-v",
		"test_client.DaemonTest.test_fork_processes", "test_client.DaemonTest.test_aio_sandbox",
		"test_client.DaemonTest.test_fork", "test_client.DaemonTest.test_fork_names").CombinedOutput()
	t.Logf("%s", out)
	if err != nil || !strings.Contains(string(out), "\nOK") {
		t.Fatalf("the Python client's fork tests failed (%v); the daemon's log:\n%s", err, dbxTail(d.Log(), 4000))
	}
}

// TestForkConcurrentForksOfOneNode: forks of one node at once, while the source
// restores the node from its image too: every branch runs the node's python. Each
// restore in a sandbox other than the node's maker reads a copy of the image of its own
// (state/durable.go: privateImage): restores of one image at once each materialize its
// pages in its directory, change its mode and drop the pages after.
func TestForkConcurrentForksOfOneNode(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "cc")
	if _, err := d.C.StartSession(dbxCtx(t), "cc", state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	pid := sessRun(t, d, "cc", "py", "import os, random; random.seed(3); heap = [random.randbytes(1<<20) for _ in range(16)]; os.getpid()")
	node := dbxCheckpoint(t, d, "cc", "cc").Node.ID
	durWaitImage(t, d, node)
	const forks, count = 3, 2
	errs := make(chan error, forks+1)
	results := make(chan *apitypes.ForkResult, forks)
	for f := 0; f < forks; f++ {
		go func() {
			res, err := d.C.Fork(dbxCtx(t), node, apitypes.ForkRequest{Count: count})
			results <- res
			errs <- err
		}()
	}
	go func() {
		if _, err := d.C.EvictNode(dbxCtx(t), node); err != nil {
			errs <- err
			return
		}
		_, err := d.C.Restore(dbxCtx(t), "cc", node)
		errs <- err
	}()
	for i := 0; i < forks+1; i++ {
		if err := <-errs; err != nil {
			t.Fatalf("a fork or the source's restore: %v\ndaemon log:\n%s", err, dbxTail(d.Log(), 4000))
		}
	}
	want := fmt.Sprintf("(16, %s)\n", strings.TrimSpace(pid))
	for f := 0; f < forks; f++ {
		res := <-results
		for _, b := range res.Branches {
			if b.Path != "durable" {
				t.Fatalf("branch %s: path %s (%s)", b.Sandbox.ID, b.Path, b.Reason)
			}
			if got := sessRun(t, d, b.Sandbox.ID, "py", "len(heap), os.getpid()"); got != want {
				t.Fatalf("branch %s's python: %q, want %q", b.Sandbox.ID, got, want)
			}
		}
	}
	if got := sessRun(t, d, "cc", "py", "len(heap), os.getpid()"); got != want {
		t.Fatalf("the source's python after its restore: %q", got)
	}
}

// TestForkBranchAfterDaemonRestart: a branch outlives its daemon like any sandbox; the
// next daemon knows it is a branch of its node (the record's fork_of): with the node's
// templates evicted it restores the node from the node's image, processes included,
// and its identity is still there.
func TestForkBranchAfterDaemonRestart(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "rs")
	if _, err := d.C.StartSession(dbxCtx(t), "rs", state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	pid := sessRun(t, d, "rs", "py", "import os; x = 41; os.getpid()")
	node := dbxCheckpoint(t, d, "rs", "rs").Node.ID
	res, err := d.C.Fork(dbxCtx(t), node, apitypes.ForkRequest{Count: 1, CreateOptions: apitypes.CreateOptions{ID: "rs-b"}})
	if err != nil || res.Branches[0].Path != "durable" {
		t.Fatalf("fork: %v %+v", err, res)
	}
	sessRun(t, d, "rs-b", "py", "x = 0")
	if err := d.C.Sync(dbxCtx(t)); err != nil {
		t.Fatal(err)
	}
	d.Kill()
	d = testutil.StartDaemonOn(t, d.Root)
	if _, err := d.C.EvictNode(dbxCtx(t), node); err != nil {
		t.Fatal(err)
	}
	r := dbxRestore(t, d, "rs-b", node)
	if r.Processes != 1 || !r.FromImage {
		t.Fatalf("the branch's restore after a daemon restart: %d processes %v, from image %v", r.Processes, r.ProcessErrors, r.FromImage)
	}
	if got := sessRun(t, d, "rs-b", "py", "x, os.getpid()"); got != fmt.Sprintf("(41, %s)\n", strings.TrimSpace(pid)) {
		t.Fatalf("the branch's python: %q", got)
	}
	forkCheckIdentity(t, d, "rs-b", 0, 1, node)
}

// TestForkOfImportedNode: a node exported from one daemon and imported into another
// forks there with its processes, from the image the import brought (a node whose
// sandbox never ran on this host); a plain restore of it in another sandbox still
// carries its files only (its PIDs are not kept there).
func TestForkOfImportedNode(t *testing.T) {
	d1 := testutil.StartDaemon(t)
	dbxCreate(t, d1, "exp")
	if _, err := d1.C.StartSession(dbxCtx(t), "exp", state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	pid := strings.TrimSpace(sessRun(t, d1, "exp", "py", "import os; x = {i: i * i for i in range(1000)}; os.getpid()"))
	dbxSh(t, d1, "exp", "echo exported > /workspace/f")
	node := dbxCheckpoint(t, d1, "exp", "exp").Node.ID
	durWaitImage(t, d1, node)
	file := filepath.Join(t.TempDir(), "n.dbx")
	bin := testutil.Binary(t)
	if out, err := testutil.Command(t, 2*time.Minute, bin, "--socket", d1.Socket, "export", node, file).CombinedOutput(); err != nil {
		t.Fatalf("deltabox export: %v\n%s", err, out)
	}
	d2 := testutil.StartDaemon(t)
	out, err := testutil.Command(t, 2*time.Minute, bin, "--socket", d2.Socket, "import", file).Output()
	if err != nil {
		t.Fatalf("deltabox import: %v\n%s", err, out)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	imported := lines[len(lines)-1] // "FROM -> ID" lines, then the node's id
	res, err := d2.C.Fork(dbxCtx(t), imported, apitypes.ForkRequest{Count: 2})
	if err != nil {
		t.Fatalf("fork of the imported node %s: %v\ndaemon log:\n%s", imported, err, dbxTail(d2.Log(), 4000))
	}
	for _, b := range res.Branches {
		if b.Path != "durable" || b.Restore.Processes != 1 || !strings.Contains(b.Reason, "import") {
			t.Fatalf("branch %d: path %s (%s), %d processes %v", b.Branch, b.Path, b.Reason, b.Restore.Processes, b.Restore.ProcessErrors)
		}
		if got := sessRun(t, d2, b.Sandbox.ID, "py", "x[999], os.getpid()"); got != fmt.Sprintf("(998001, %s)\n", pid) {
			t.Fatalf("branch %d's python: %q", b.Branch, got)
		}
		if got := dbxSh(t, d2, b.Sandbox.ID, "cat /workspace/f"); got != "exported\n" {
			t.Fatalf("branch %d's file: %q", b.Branch, got)
		}
	}
	dbxCreate(t, d2, "plain")
	if r := dbxRestore(t, d2, "plain", imported); r.Processes != 0 {
		t.Fatalf("a plain restore of the imported node brought %d processes", r.Processes)
	}
}
