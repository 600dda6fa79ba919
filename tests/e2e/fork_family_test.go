package e2e

import (
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"deltabox/internal/apitypes"
	"deltabox/internal/cgroup"
	"deltabox/internal/testutil"
)

// TestForkFamilyNodeFast: after a fast fork of a sandbox (its family made, the source
// moved into a namespace of its own), POST /v1/nodes/ID/fork of that fork's node, and of
// a node the source made before it, takes the fast path: new members of the family
// placed from the holder's templates, each process at its checkpoint PID with the node's
// state, each its own identity. A node the source made after the fork (its templates in
// its own namespace, where its code runs) does not, and says why. kill -9 -1 in a new
// member leaves the others and the first branches running; a new member restores the
// node made before its fork's node by the fast path; and with the source and the first
// branches removed the family still forks.
func TestForkFamilyNodeFast(t *testing.T) {
	d := testutil.StartDaemonEnv(t, testutil.NewStore(t), "DELTABOX_DURABLE=0")
	pyPid, bashPid, bgPid := forkSourceLive(t, d, "fmsrc")
	early := dbxCheckpoint(t, d, "fmsrc", "early").Node.ID
	sessRun(t, d, "fmsrc", "py", "d[1] = 'at-fork'")
	res, err := d.C.ForkSandbox(dbxCtx(t), "fmsrc", apitypes.SandboxForkRequest{
		ForkRequest: apitypes.ForkRequest{Count: 2, CreateOptions: apitypes.CreateOptions{ID: "fm1"}},
		Checkpoint:  apitypes.CheckpointRequest{Label: "fork"},
	})
	if err != nil {
		t.Fatalf("first fork: %v\ndaemon log:\n%s", err, dbxTail(d.Log(), 4000))
	}
	node := res.Node
	if b := res.Branches[0]; b.Path != "fast" {
		t.Fatalf("first fork: path %s (%s), want fast", b.Path, b.Reason)
	}
	// The source and the first branches move on.
	sessRun(t, d, "fmsrc", "py", "d[1] = 'source-after'")
	sessRun(t, d, "fm1-0", "py", "d[1] = 'branch-after'")
	after := dbxCheckpoint(t, d, "fmsrc", "after").Node.ID

	fork := func(node, prefix string, n int) *apitypes.ForkResult {
		t.Helper()
		r, err := d.C.Fork(dbxCtx(t), node, apitypes.ForkRequest{Count: n, CreateOptions: apitypes.CreateOptions{ID: prefix}})
		if err != nil {
			t.Fatalf("fork of %s: %v\ndaemon log:\n%s", node, err, dbxTail(d.Log(), 4000))
		}
		return r
	}
	check := func(r *apitypes.ForkResult, node, want string) {
		t.Helper()
		for _, b := range r.Branches {
			if b.Path != "fast" || b.Restore.Processes != 3 {
				t.Fatalf("fork of %s, branch %s: path %s (%s), %+v; want fast, 3 processes", node, b.Sandbox.ID, b.Path, b.Reason, b.Restore)
			}
			forkCheckBranch(t, d, b.Sandbox.ID, pyPid, bashPid, bgPid, "source")
			if got := sessRun(t, d, b.Sandbox.ID, "py", "d[1]"); got != "'"+want+"'\n" {
				t.Fatalf("%s's python: d[1] = %q, want %q", b.Sandbox.ID, got, want)
			}
			forkCheckIdentity(t, d, b.Sandbox.ID, b.Branch, len(r.Branches), node)
		}
	}
	r2 := fork(node, "fm2", 3)
	check(r2, node, "at-fork")
	r3 := fork(early, "fm3", 2)
	check(r3, early, "1")

	// A node made after the fork: its templates are in the source's own namespace.
	r4 := fork(after, "fm4", 1)
	if b := r4.Branches[0]; b.Path == "fast" || !strings.Contains(b.Reason, "not in a fork family's holder") {
		t.Fatalf("fork of a node made after the fork: path %s (%s), want another path naming why", b.Path, b.Reason)
	}
	if err := d.C.Remove(dbxCtx(t), r4.Branches[0].Sandbox.ID); err != nil {
		t.Fatal(err)
	}

	// Each member diverges alone.
	for _, sb := range []string{"fm2-0", "fm2-1", "fm2-2", "fm3-0"} {
		sessRun(t, d, sb, "py", fmt.Sprintf("d[1] = %q", sb))
		dbxSh(t, d, sb, "echo "+sb+" > /workspace/f")
	}
	if got := sessRun(t, d, "fm1-0", "py", "d[1]"); got != "'branch-after'\n" {
		t.Fatalf("fm1-0 after the later forks: %q", got)
	}
	if got := sessRun(t, d, "fmsrc", "py", "d[1]"); got != "'source-after'\n" {
		t.Fatalf("the source after the later forks: %q", got)
	}
	// kill -9 -1 in a new member reaches its own child only.
	if got := sessRun(t, d, "fm2-0", "main", "sleep 1000 & kill -9 -1; wait $! 2>/dev/null; kill -0 $! 2>/dev/null && echo alive || echo dead"); !strings.HasSuffix(got, "dead\n") {
		t.Fatalf("kill -9 -1 in fm2-0 did not reach its own child: %q", got)
	}
	for _, sb := range []string{"fm2-1", "fm2-2", "fm3-0", "fm1-0", "fm1-1", "fmsrc"} {
		if got := dbxSh(t, d, sb, "cat /proc/"+bgPid+"/comm"); got != "sleep\n" {
			t.Fatalf("%s's background process after kill -9 -1 in fm2-0: %q", sb, got)
		}
	}
	// A new member restores the node made before its fork's node, by the fast path.
	if r := dbxRestore(t, d, "fm2-1", early); r.Processes != 3 {
		t.Fatalf("fm2-1's restore of %s: %+v", early, r)
	}
	forkCheckBranch(t, d, "fm2-1", pyPid, bashPid, bgPid, "source")
	if got := sessRun(t, d, "fm2-1", "py", "d[1]"); got != "'1'\n" {
		t.Fatalf("fm2-1 after restoring %s: %q", early, got)
	}
	// The source and the first branches gone, the family still forks its node.
	for _, sb := range []string{"fmsrc", "fm1-0", "fm1-1"} {
		if err := d.C.Remove(dbxCtx(t), sb); err != nil {
			t.Fatal(err)
		}
	}
	check(fork(node, "fm5", 2), node, "at-fork")
}

// TestForkFamilyCutByCrash: the daemon dies (SIGKILL, DELTABOX_CRASH_AT=forkfamily:K)
// during a fork of a family's node: after its new members were made and placed, their
// records not yet saying the fork is made (1), and after they do, before the answer
// (2). The next daemon repairs it: cut before (1), the new members are gone with their
// cgroups and the family (its holder, the moved source, the first branch) is adopted as
// it was; cut after (2), the new members are adopted with their processes. Either way
// the family forks its node again by the fast path, and removing every sandbox leaves
// no cgroup behind.
func TestForkFamilyCutByCrash(t *testing.T) {
	for k := 1; k <= 2; k++ {
		t.Run(fmt.Sprintf("forkfamily-%d", k), func(t *testing.T) {
			root := testutil.NewStore(t)
			d := testutil.StartDaemonEnv(t, root, "DELTABOX_DURABLE=0", fmt.Sprintf("DELTABOX_CRASH_AT=forkfamily:%d", k))
			pyPid, bashPid, bgPid := forkSourceLive(t, d, "fksrc")
			res, err := d.C.ForkSandbox(dbxCtx(t), "fksrc", apitypes.SandboxForkRequest{
				ForkRequest: apitypes.ForkRequest{Count: 1, CreateOptions: apitypes.CreateOptions{ID: "fk1"}},
			})
			if err != nil || res.Branches[0].Path != "fast" {
				t.Fatalf("first fork: %v %+v", err, res)
			}
			node := res.Node
			if _, err := d.C.Fork(dbxCtx(t), node, apitypes.ForkRequest{Count: 2, CreateOptions: apitypes.CreateOptions{ID: "fk2"}}); err == nil {
				t.Fatalf("the fork was answered: the daemon did not die at forkfamily:%d", k)
			}
			d.Kill()
			d = testutil.StartDaemonEnv(t, root, "DELTABOX_DURABLE=0")
			for _, b := range []string{"fk2-0", "fk2-1"} {
				_, err := d.C.Get(dbxCtx(t), b)
				switch {
				case k == 1 && err == nil:
					t.Fatalf("%s is there after a fork cut before its records said it was made", b)
				case k == 1 && pathExists(filepath.Join(cgroup.RootFor(root), b)):
					t.Fatalf("%s's cgroup is left after a fork cut before its records said it was made", b)
				case k == 2 && err != nil:
					t.Fatalf("%s after a fork cut after its records: %v\ndaemon log:\n%s", b, err, dbxTail(d.Log(), 4000))
				case k == 2:
					forkCheckBranch(t, d, b, pyPid, bashPid, bgPid, "source")
				}
			}
			for _, sb := range []string{"fksrc", "fk1"} {
				forkCheckBranch(t, d, sb, pyPid, bashPid, bgPid, "source")
			}
			r, err := d.C.Fork(dbxCtx(t), node, apitypes.ForkRequest{Count: 1, CreateOptions: apitypes.CreateOptions{ID: "fk3"}})
			if err != nil || r.Branches[0].Path != "fast" {
				t.Fatalf("the family's fork after the repair: %v %+v\ndaemon log:\n%s", err, r, dbxTail(d.Log(), 4000))
			}
			forkCheckBranch(t, d, "fk3", pyPid, bashPid, bgPid, "source")
			removeAllLeavesNoCgroup(t, d, root)
		})
	}
}

// TestForkFamilyFailureChangesNothing: a fork of a family's node whose last branch cannot
// be made (its name is taken) fails, names that branch, and removes the ones it made and
// placed; the family's members run on with their processes; and after a daemon restart
// the holder still has the node's templates (the failed fork's placements moved their
// counters, recorded all the same): the node forks again by the fast path.
func TestForkFamilyFailureChangesNothing(t *testing.T) {
	root := testutil.NewStore(t)
	d := testutil.StartDaemonEnv(t, root, "DELTABOX_DURABLE=0")
	pyPid, bashPid, bgPid := forkSourceLive(t, d, "fxsrc")
	res, err := d.C.ForkSandbox(dbxCtx(t), "fxsrc", apitypes.SandboxForkRequest{
		ForkRequest: apitypes.ForkRequest{Count: 1, CreateOptions: apitypes.CreateOptions{ID: "fx1"}},
	})
	if err != nil || res.Branches[0].Path != "fast" {
		t.Fatalf("first fork: %v %+v", err, res)
	}
	node := res.Node
	dbxCreate(t, d, "fx2-2")
	_, err = d.C.Fork(dbxCtx(t), node, apitypes.ForkRequest{Count: 3, CreateOptions: apitypes.CreateOptions{ID: "fx2"}})
	if err == nil || !strings.Contains(err.Error(), "branch 2 of 3") {
		t.Fatalf("a fork whose branch 2's name is taken: %v, want it to fail naming branch 2", err)
	}
	for _, b := range []string{"fx2-0", "fx2-1"} {
		if _, err := d.C.Get(dbxCtx(t), b); err == nil {
			t.Fatalf("%s is left after the failed fork", b)
		}
	}
	for _, sb := range []string{"fxsrc", "fx1"} {
		forkCheckBranch(t, d, sb, pyPid, bashPid, bgPid, "source")
	}
	d.Stop()
	d = testutil.StartDaemonEnv(t, root, "DELTABOX_DURABLE=0")
	r, err := d.C.Fork(dbxCtx(t), node, apitypes.ForkRequest{Count: 1, CreateOptions: apitypes.CreateOptions{ID: "fx3"}})
	if err != nil || r.Branches[0].Path != "fast" {
		t.Fatalf("the family's fork after the failed one and a restart: %v %+v\ndaemon log:\n%s", err, r, dbxTail(d.Log(), 4000))
	}
	forkCheckBranch(t, d, "fx3", pyPid, bashPid, bgPid, "source")
}
