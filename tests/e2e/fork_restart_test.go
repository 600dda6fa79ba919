package e2e

import (
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

func pathExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}
