package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/apitypes"
	"deltabox/internal/cgroup"
	"deltabox/internal/testutil"
)

// TestForkFastFamilySurvivesRestart: a fast fork's family (the holder, two branches and
// the source moved into a namespace of its own) outlives a daemon restart. The next
// daemon adopts the holder and every member: in each member the python and bash sessions
// and the background process still run at their checkpoint PIDs with their state, exec
// works, and a restore of the node made before the fork places the holder's templates
// again (path fast, not the image). Removing the source leaves the branches running;
// removing the last member ends the holder: its init and its cgroup are gone.
func TestForkFastFamilySurvivesRestart(t *testing.T) {
	root := testutil.NewStore(t)
	d := testutil.StartDaemonEnv(t, root, "DELTABOX_DURABLE=0")
	pyPid, bashPid, bgPid := forkSourceLive(t, d, "frsrc")
	res, err := d.C.ForkSandbox(dbxCtx(t), "frsrc", apitypes.SandboxForkRequest{
		ForkRequest: apitypes.ForkRequest{Count: 2, CreateOptions: apitypes.CreateOptions{ID: "frb"}},
		Checkpoint:  apitypes.CheckpointRequest{Label: "fork-source"},
	})
	if err != nil {
		t.Fatalf("fork: %v\ndaemon log:\n%s", err, dbxTail(d.Log(), 4000))
	}
	for _, b := range res.Branches {
		if b.Path != "fast" {
			t.Fatalf("branch %s: path %s (%s)", b.Sandbox.ID, b.Path, b.Reason)
		}
	}
	node := res.Node
	members := []string{"frsrc", "frb-0", "frb-1"}
	in, err := d.C.Get(dbxCtx(t), "frsrc")
	if err != nil || in.Family == nil || !in.Family.Made {
		t.Fatalf("the source's family after the fork: %+v (%v)", in.Family, err)
	}
	holder, famID := in.Family.Holder.Pid, in.Family.ID
	holderCG := filepath.Join(cgroup.RootFor(root), famID)
	if _, err := os.Stat(holderCG); err != nil {
		t.Fatalf("the holder's cgroup: %v", err)
	}
	if err := d.C.Sync(dbxCtx(t)); err != nil {
		t.Fatal(err)
	}
	d.Stop()
	d = testutil.StartDaemonEnv(t, root, "DELTABOX_DURABLE=0")
	if !strings.Contains(d.Log(), "adopted a fork family's holder") {
		t.Fatalf("the holder was not adopted; daemon log:\n%s", dbxTail(d.Log(), 4000))
	}
	for _, sb := range members {
		forkCheckBranch(t, d, sb, pyPid, bashPid, bgPid, "source")
		if got := dbxSh(t, d, sb, "echo "+sb+" > /workspace/f; cat /workspace/f"); got != sb+"\n" {
			t.Fatalf("%s: exec after the restart: %q", sb, got)
		}
	}
	for _, sb := range members {
		r := dbxRestore(t, d, sb, node)
		if r.Processes != 3 || r.FromImage {
			t.Fatalf("%s's restore to the pre-fork node after the restart: %d processes %v, from image %v", sb, r.Processes, r.ProcessErrors, r.FromImage)
		}
		forkCheckBranch(t, d, sb, pyPid, bashPid, bgPid, "source")
	}
	// Each of those restores makes the member's next spare of the node in the background
	// (docs/design/spares.md): its placement injects into the holder's templates, and a
	// crash in the middle of one leaves a template that ran (the next daemon kills it), as
	// a crash in the middle of a restore's fork would. The crash below is about the
	// family's records, not that window: the spares are let finish first.
	for _, sb := range members {
		spareWait(t, d, node, sb)
	}
	if err := d.C.Remove(dbxCtx(t), "frsrc"); err != nil {
		t.Fatal(err)
	}
	for _, sb := range members[1:] {
		if got := sessRun(t, d, sb, "py", "len(d)"); got != "100000\n" {
			t.Fatalf("%s after the source's removal: %q", sb, got)
		}
	}
	if err := unix.Kill(holder, 0); err != nil {
		t.Fatalf("the holder ended with the source's removal: %v", err)
	}
	// A second restart, by a crash, the source gone: the family is adopted again, and its
	// templates, revived by the restores above, were recorded again (else reattaching
	// them fails and kills them); a branch checkpoints, restores its own node and the
	// pre-fork one, and forks (a member's fork is not the fast path's).
	d.Kill()
	d = testutil.StartDaemonEnv(t, root, "DELTABOX_DURABLE=0")
	if n := strings.Count(d.Log(), "adopted a fork family's holder"); n != 2 {
		t.Fatalf("the holder adopted %d times after two restarts; daemon log:\n%s", n, dbxTail(d.Log(), 4000))
	}
	sessRun(t, d, "frb-1", "py", "d[1] = 'own'")
	own := dbxCheckpoint(t, d, "frb-1", "own").Node.ID
	sessRun(t, d, "frb-1", "py", "d[1] = 'later'")
	if r := dbxRestore(t, d, "frb-1", own); r.Processes != 3 || r.FromImage {
		t.Fatalf("frb-1's restore to its own node after the second restart: %d processes %v", r.Processes, r.ProcessErrors)
	}
	if got := sessRun(t, d, "frb-1", "py", "d[1]"); got != "'own'\n" {
		t.Fatalf("frb-1 after its own restore: %q", got)
	}
	for _, sb := range members[1:] {
		r := dbxRestore(t, d, sb, node)
		if r.Processes != 3 || r.FromImage {
			t.Fatalf("%s's restore to the pre-fork node after the second restart: %d processes %v, from image %v", sb, r.Processes, r.ProcessErrors, r.FromImage)
		}
		forkCheckBranch(t, d, sb, pyPid, bashPid, bgPid, "source")
	}
	again, err := d.C.ForkSandbox(dbxCtx(t), "frb-0", apitypes.SandboxForkRequest{
		ForkRequest: apitypes.ForkRequest{Count: 1, CreateOptions: apitypes.CreateOptions{ID: "frc"}},
	})
	if err != nil {
		t.Fatalf("a member's fork after the restarts: %v", err)
	}
	if err := d.C.Remove(dbxCtx(t), again.Branches[0].Sandbox.ID); err != nil {
		t.Fatal(err)
	}
	for _, sb := range members[1:] {
		if err := d.C.Remove(dbxCtx(t), sb); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for unix.Kill(holder, 0) == nil || pathExists(holderCG) {
		if time.Now().After(deadline) {
			t.Fatalf("after the last member's removal: holder init %d alive %v, its cgroup %s there %v", holder, unix.Kill(holder, 0) == nil, holderCG, pathExists(holderCG))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// removeAllLeavesNoCgroup removes every sandbox of d (store root) and checks that no
// cgroup of the store is left.
func removeAllLeavesNoCgroup(t *testing.T, d *testutil.Daemon, root string) {
	t.Helper()
	list, err := d.C.List(dbxCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	for _, in := range list {
		if err := d.C.Remove(dbxCtx(t), in.ID); err != nil {
			t.Fatal(err)
		}
	}
	ents, _ := os.ReadDir(cgroup.RootFor(root))
	for _, e := range ents {
		if e.IsDir() {
			t.Errorf("cgroup %s left after every sandbox's removal", e.Name())
		}
	}
}

func pathExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// TestForkFastCutByCrash: the daemon dies (SIGKILL, DELTABOX_CRASH_AT=forkfast:K) during
// a fast fork: after its branches were made and their processes placed (1), after the
// family's holder was made, the source's live processes about to end (2), and after the
// family's records were written, before the answer (3). The next daemon repairs it: cut
// before the records (1, 2), the branches are gone, their cgroups too, and the source
// runs (1: adopted, its processes at their PIDs; 2: restarted afresh on its files, its
// processes were being moved); once recorded (3), the source and the branches are
// adopted with their processes and sessions. The source forks again (by the fast path
// where it is no member), and removing every sandbox leaves no cgroup behind.
func TestForkFastCutByCrash(t *testing.T) {
	for k := 1; k <= 3; k++ {
		t.Run(fmt.Sprintf("forkfast-%d", k), func(t *testing.T) {
			root := testutil.NewStore(t)
			d := testutil.StartDaemonEnv(t, root, "DELTABOX_DURABLE=0", fmt.Sprintf("DELTABOX_CRASH_AT=forkfast:%d", k))
			pyPid, bashPid, bgPid := forkSourceLive(t, d, "fcsrc")
			_, err := d.C.ForkSandbox(dbxCtx(t), "fcsrc", apitypes.SandboxForkRequest{
				ForkRequest: apitypes.ForkRequest{Count: 2, CreateOptions: apitypes.CreateOptions{ID: "fcb"}},
			})
			if err == nil {
				t.Fatalf("the fork was answered: the daemon did not die at forkfast:%d", k)
			}
			d.Kill()
			d = testutil.StartDaemonEnv(t, root, "DELTABOX_DURABLE=0")
			famCG := filepath.Join(cgroup.RootFor(root), "fcsrc.family")
			for _, b := range []string{"fcb-0", "fcb-1"} {
				_, err := d.C.Get(dbxCtx(t), b)
				switch {
				case k < 3 && err == nil:
					t.Fatalf("%s is there after a fork cut before its records", b)
				case k < 3 && pathExists(filepath.Join(cgroup.RootFor(root), b)):
					t.Fatalf("%s's cgroup is left after a fork cut before its records", b)
				case k == 3 && err != nil:
					t.Fatalf("%s after a fork cut after its records: %v\ndaemon log:\n%s", b, err, dbxTail(d.Log(), 4000))
				case k == 3:
					forkCheckBranch(t, d, b, pyPid, bashPid, bgPid, "source")
				}
			}
			switch k {
			case 1, 3:
				forkCheckBranch(t, d, "fcsrc", pyPid, bashPid, bgPid, "source")
			case 2:
				if got := dbxSh(t, d, "fcsrc", "cat /workspace/f"); got != "source\n" {
					t.Fatalf("the source's files after its cut move: %q", got)
				}
				if pathExists(famCG) {
					t.Fatalf("the cut family's cgroup %s is left", famCG)
				}
			}
			if k == 2 {
				sessRun(t, d, "fcsrc", "py", "1") // a process for the next fork (the session restarts)
			}
			res, err := d.C.ForkSandbox(dbxCtx(t), "fcsrc", apitypes.SandboxForkRequest{
				ForkRequest: apitypes.ForkRequest{Count: 1, CreateOptions: apitypes.CreateOptions{ID: "fcc"}},
			})
			if err != nil {
				t.Fatalf("the source's fork after the repair: %v\ndaemon log:\n%s", err, dbxTail(d.Log(), 4000))
			}
			if want := map[bool]string{true: "files", false: "fast"}[k == 3]; res.Branches[0].Path != want {
				// A member's fork is a second generation: durable (fork.md), and durable
				// images are off here, so files.
				t.Fatalf("the fork after the repair: path %s (%s), want %s", res.Branches[0].Path, res.Branches[0].Reason, want)
			}
			removeAllLeavesNoCgroup(t, d, root)
		})
	}
}
