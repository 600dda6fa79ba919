package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/sbinit"
	"deltabox/internal/testutil"
)

// TestForkFastCarriesProcesses: with the fast path on (the default), POST
// /v1/sandboxes/ID/fork {"count": 8} makes 8 branches in sibling namespaces of the
// sandbox's family, each running the node's processes (a python session with a dict of
// 10^5 objects, a generator mid-iteration and a random.Random; a bash session's
// variable, function and cwd; a background process) at their checkpoint PIDs, forked
// from the node's templates (path "fast"), each with its identity and stats; the source
// moved into a namespace of its own with the same state. Each branch diverges alone;
// kill -9 -1 in one branch leaves every sibling and the source intact; each branch, and
// the source, restores the node made before the fork to exactly its state; removing the
// source leaves the branches running.
func TestForkFastCarriesProcesses(t *testing.T) {
	d := testutil.StartDaemonEnv(t, testutil.NewStore(t), "DELTABOX_DURABLE=0")
	pyPid, bashPid, bgPid := forkSourceLive(t, d, "ffsrc")
	const n = 8
	t0 := time.Now()
	res, err := d.C.ForkSandbox(dbxCtx(t), "ffsrc", apitypes.SandboxForkRequest{
		ForkRequest: apitypes.ForkRequest{Count: n, CreateOptions: apitypes.CreateOptions{ID: "ffb"}},
		Checkpoint:  apitypes.CheckpointRequest{Label: "fork-source"},
	})
	if err != nil {
		t.Fatalf("fork: %v\ndaemon log:\n%s", err, dbxTail(d.Log(), 4000))
	}
	node := res.Node
	t.Logf("fast fork of %d: %v (daemon %.0f ms)", n, time.Since(t0), res.DurationMS)
	if len(res.Branches) != n {
		t.Fatalf("%d branches, want %d", len(res.Branches), n)
	}
	for i, b := range res.Branches {
		if b.Path != "fast" || b.Restore.Processes != 3 || b.Sandbox.ID != fmt.Sprintf("ffb-%d", i) {
			t.Fatalf("branch %d: %s path %s (%s), %+v", i, b.Sandbox.ID, b.Path, b.Reason, b.Restore)
		}
		if o := b.Sandbox.Stats.Fork; o == nil || o.Node != node || o.Branch != i || o.Count != n || o.Path != "fast" {
			t.Fatalf("branch %d's stats.fork: %+v", i, o)
		}
	}
	if in, err := d.C.Get(dbxCtx(t), "ffsrc"); err != nil || in.Stats.ForkPaths["fast"] != n {
		t.Fatalf("the source's stats.fork_paths: %v (%v)", in.Stats.ForkPaths, err)
	}
	for _, b := range res.Branches {
		forkCheckBranch(t, d, b.Sandbox.ID, pyPid, bashPid, bgPid, "source")
		forkCheckIdentity(t, d, b.Sandbox.ID, b.Branch, n, node)
	}
	forkCheckBranch(t, d, "ffsrc", pyPid, bashPid, bgPid, "source")
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
	if got := sessRun(t, d, "ffsrc", "py", "d[1]"); got != "'1'\n" {
		t.Fatalf("the source's python: %q", got)
	}
	// kill -9 -1 in branch 0, from its bash session: its child dies, siblings and the
	// source go on.
	if got := sessRun(t, d, "ffb-0", "main", "sleep 1000 & kill -9 -1; wait $! 2>/dev/null; kill -0 $! 2>/dev/null && echo alive || echo dead"); !strings.HasSuffix(got, "dead\n") {
		t.Fatalf("kill -9 -1 in ffb-0 did not reach its own child: %q", got)
	}
	for _, sb := range []string{"ffb-1", "ffb-7", "ffsrc"} {
		if got := dbxSh(t, d, sb, "cat /proc/"+bgPid+"/comm"); got != "sleep\n" {
			t.Fatalf("%s's background process after kill -9 -1 in ffb-0: %q", sb, got)
		}
		if got := sessRun(t, d, sb, "py", "len(d)"); got != "100000\n" {
			t.Fatalf("%s's python after kill -9 -1 in ffb-0: %q", sb, got)
		}
	}
	// Each branch and the source restore the node made before the fork: exactly the
	// checkpoint's state, from the family's templates placed into their namespaces.
	for _, sb := range []string{"ffb-0", "ffb-3", "ffsrc"} {
		r := dbxRestore(t, d, sb, node)
		if r.Processes != 3 || r.FromImage {
			t.Fatalf("%s's restore to the pre-fork node: %d processes %v, from image %v", sb, r.Processes, r.ProcessErrors, r.FromImage)
		}
		forkCheckBranch(t, d, sb, pyPid, bashPid, bgPid, "source")
		if got := sessRun(t, d, sb, "py", "d[1]"); got != "'1'\n" {
			t.Fatalf("%s after its restore: %q", sb, got)
		}
	}
	forkCheckIdentity(t, d, "ffb-3", 3, n, node) // never rolled back
	if err := d.C.Remove(dbxCtx(t), "ffsrc"); err != nil {
		t.Fatal(err)
	}
	for _, b := range res.Branches[1:] {
		if got := sessRun(t, d, b.Sandbox.ID, "py", "len(d)"); got != "100000\n" {
			t.Fatalf("%s after the source's removal: %q", b.Sandbox.ID, got)
		}
	}
}

// TestInitsRunTheSmallInit: the daemon's binary (built by scripts/build.sh, as
// testutil.Binary does) carries the small init, and every sandbox's init runs it from
// the daemon's sealed memfd, not the daemon's binary: a sandbox's (started by the
// daemon, as its root's host uid, which may not search the test binary's 0700
// directory), and each branch init of a fast fork (exec'd by the family init through
// the memfd's fd); each resident in less than the daemon's binary's Go start alone
// (18 MB as an init, 3.7 MB the small one: docs/design/fork.md); and the branches
// work: a python session answers at its checkpoint PID.
func TestInitsRunTheSmallInit(t *testing.T) {
	d := testutil.StartDaemonEnv(t, testutil.NewStore(t), "DELTABOX_DURABLE=0")
	// The daemon's memfd of the small init: the file its fds point to.
	var small os.FileInfo
	fdDir := fmt.Sprintf("/proc/%d/fd", d.Pid())
	ents, err := os.ReadDir(fdDir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if l, _ := os.Readlink(filepath.Join(fdDir, e.Name())); strings.HasPrefix(l, "/memfd:"+sbinit.InitBinaryName) {
			if small, err = os.Stat(filepath.Join(fdDir, e.Name())); err != nil {
				t.Fatal(err)
			}
		}
	}
	if small == nil {
		t.Fatalf("the daemon holds no memfd of the small init\ndaemon log:\n%s", dbxTail(d.Log(), 4000))
	}
	self, err := os.Stat(testutil.Binary(t))
	if err != nil {
		t.Fatal(err)
	}
	exe := func(id string) os.FileInfo {
		t.Helper()
		in, err := d.C.Get(dbxCtx(t), id)
		if err != nil {
			t.Fatal(err)
		}
		fi, err := os.Stat(fmt.Sprintf("/proc/%d/exe", in.InitPid))
		if err != nil {
			t.Fatalf("%s's init %d: %v", id, in.InitPid, err)
		}
		// Resident in less than a quarter of the daemon's binary's size (40 MB): the
		// binary as an init is 18 MB resident, the small init 3.7 MB.
		st, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", in.InitPid))
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range strings.Split(string(st), "\n") {
			if f := strings.Fields(l); len(f) == 3 && f[0] == "VmRSS:" {
				if kb, _ := strconv.ParseInt(f[1], 10, 64); kb<<10 > self.Size()/4 {
					t.Errorf("%s's init is %d kB resident, want under %d kB (a quarter of the daemon's binary)", id, kb, self.Size()/4>>10)
				}
			}
		}
		return fi
	}
	pyPid, bashPid, bgPid := forkSourceLive(t, d, "fisrc")
	if fi := exe("fisrc"); !os.SameFile(fi, small) {
		t.Errorf("a sandbox's init runs %s (%d bytes), want the memfd of %s (%d bytes)", fi.Name(), fi.Size(), sbinit.InitBinaryName, small.Size())
	}
	res, err := d.C.ForkSandbox(dbxCtx(t), "fisrc", apitypes.SandboxForkRequest{
		ForkRequest: apitypes.ForkRequest{Count: 2, CreateOptions: apitypes.CreateOptions{ID: "fib"}},
	})
	if err != nil {
		t.Fatalf("fork: %v\ndaemon log:\n%s", err, dbxTail(d.Log(), 4000))
	}
	for _, b := range res.Branches {
		if b.Path != "fast" {
			t.Fatalf("branch %d: path %s (%s)", b.Branch, b.Path, b.Reason)
		}
		if fi := exe(b.Sandbox.ID); !os.SameFile(fi, small) {
			t.Errorf("branch %s's init runs %s (%d bytes), want the memfd of %s (%d bytes)", b.Sandbox.ID, fi.Name(), fi.Size(), sbinit.InitBinaryName, small.Size())
		}
		forkCheckBranch(t, d, b.Sandbox.ID, pyPid, bashPid, bgPid, "source")
	}
	// The source moved onto a branch init of its own.
	if fi := exe("fisrc"); !os.SameFile(fi, small) {
		t.Errorf("the moved source's init runs %s, want %s", fi.Name(), sbinit.InitBinaryName)
	}
	forkCheckBranch(t, d, "fisrc", pyPid, bashPid, bgPid, "source")
}

// TestForkSecondGeneration: a branch of a fast fork forks again (a second generation).
// That fork takes the durable path (docs/design/fork.md: the fast path's second
// generation is not built) and still carries every process: each grandchild runs the
// branch's processes at the checkpoint PIDs with the branch's own divergence (python's
// objects, bash's state, the background process, the file). A grandchild then restores
// the node made before the first fork, on its path but held by another family: from
// that node's durable image, to exactly the source's state.
func TestForkSecondGeneration(t *testing.T) {
	d := testutil.StartDaemon(t)
	pyPid, bashPid, bgPid := forkSourceLive(t, d, "sgsrc")
	res, err := d.C.ForkSandbox(dbxCtx(t), "sgsrc", apitypes.SandboxForkRequest{
		ForkRequest: apitypes.ForkRequest{Count: 2, CreateOptions: apitypes.CreateOptions{ID: "sg1"}},
		Checkpoint:  apitypes.CheckpointRequest{Label: "gen0"},
	})
	if err != nil {
		t.Fatalf("first fork: %v\ndaemon log:\n%s", err, dbxTail(d.Log(), 4000))
	}
	gen0 := res.Node
	if b := res.Branches[0]; b.Path != "fast" {
		t.Fatalf("first fork: path %s (%s), want fast", b.Path, b.Reason)
	}
	sessRun(t, d, "sg1-0", "py", "d[1] = 'gen1'")
	dbxSh(t, d, "sg1-0", "echo gen1 > /workspace/f")
	res2, err := d.C.ForkSandbox(dbxCtx(t), "sg1-0", apitypes.SandboxForkRequest{
		ForkRequest: apitypes.ForkRequest{Count: 2, CreateOptions: apitypes.CreateOptions{ID: "sg2"}},
		Checkpoint:  apitypes.CheckpointRequest{Label: "gen1"},
	})
	if err != nil {
		t.Fatalf("second fork: %v\ndaemon log:\n%s", err, dbxTail(d.Log(), 4000))
	}
	for _, b := range res2.Branches {
		if b.Path != "durable" || !strings.Contains(b.Reason, "second generation") || b.Restore.Processes+b.Restore.CRIUProcesses < 3 {
			t.Fatalf("second fork's branch %s: path %s (%s), %+v; want durable, the second generation named, 3 processes", b.Sandbox.ID, b.Path, b.Reason, b.Restore)
		}
		sb := b.Sandbox.ID
		if got := sessRun(t, d, sb, "py", "(d[1], len(d), os.getpid())"); got != fmt.Sprintf("('gen1', 100000, %s)\n", pyPid) {
			t.Fatalf("%s's python: %q, want the first branch's divergence at pid %s", sb, got, pyPid)
		}
		if got := sessRun(t, d, sb, "main", "echo $(pwd) $FOO $(hello x) $$"); got != fmt.Sprintf("/tmp bar hi-x %s\n", bashPid) {
			t.Fatalf("%s's bash: %q", sb, got)
		}
		if got := dbxSh(t, d, sb, "cat /proc/"+bgPid+"/comm; cat /workspace/f"); got != "sleep\ngen1\n" {
			t.Fatalf("%s's background process and file: %q", sb, got)
		}
	}
	// The first branch is unchanged by its fork.
	if got := sessRun(t, d, "sg1-0", "py", "d[1]"); got != "'gen1'\n" {
		t.Fatalf("sg1-0 after its fork: %q", got)
	}
	r := dbxRestore(t, d, "sg2-1", gen0)
	if r.Processes+r.CRIUProcesses < 3 {
		t.Fatalf("sg2-1's restore of the node before the first fork: %+v", r)
	}
	forkCheckBranch(t, d, "sg2-1", pyPid, bashPid, bgPid, "source")
	if got := sessRun(t, d, "sg2-1", "py", "d[1]"); got != "'1'\n" {
		t.Fatalf("sg2-1 after restoring gen0: %q", got)
	}
}
