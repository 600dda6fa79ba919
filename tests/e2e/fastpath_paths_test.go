package e2e

import (
	"strings"
	"testing"
	"time"

	"deltabox/internal/state"
	"deltabox/internal/testutil"
)

// TestFastPathCountsPerPath: checkpoints and restores are counted per path (process,
// files only and why, failed and why) in the sandbox's API answer and in `deltabox tree`,
// which also shows each node's templates and what they cost.
func TestFastPathCountsPerPath(t *testing.T) {
	// Without durable images: a node with a complete image restores from it when its
	// template is gone (TestDurableImageRestore), and the stopped processes the kill
	// below picks from would include the copies waiting for their dump.
	d := testutil.StartDaemonEnv(t, testutil.NewStore(t), "DELTABOX_DURABLE=0")
	ctx := dbxCtx(t)
	dbxCreate(t, d, "c1")
	dbxCreate(t, d, "c2")
	sessRun(t, d, "c1", "main", "V=one")
	n1 := dbxCheckpoint(t, d, "c1", "one")                         // c1: process
	dbxSh(t, d, "c2", "echo x > /workspace/x")                     // no session in c2
	dbxCheckpoint(t, d, "c2", "")                                  // c2: files only, no sessions
	if r := dbxRestore(t, d, "c2", n1.Node.ID); r.Processes != 0 { // c2: other sandbox
		t.Fatalf("restore into another sandbox carried %d processes", r.Processes)
	}
	if r := dbxRestore(t, d, "c1", n1.Node.ID); r.Processes != 1 { // c1: process
		t.Fatalf("restore: %+v", r)
	}
	sessRun(t, d, "c1", "main", "exec 7< <(echo hi); wait $!")
	if _, err := d.C.Checkpoint(ctx, "c1", ""); err == nil { // c1: ineligible
		t.Fatal("a session holding a pipe was checkpointed")
	}
	sessRun(t, d, "c1", "main", "exec 7<&-")
	n2 := dbxCheckpoint(t, d, "c1", "two") // c1: process
	// Kill n1's template (the oldest stopped bash) from inside: restoring n1 is refused.
	sessRun(t, d, "c1", "main", `for p in /proc/[0-9]*; do s=$(cut -d' ' -f3 $p/stat); [ "$s" = T -o "$s" = t ] && echo ${p#/proc/}; done | sort -n | head -1 | xargs kill -9`)
	time.Sleep(100 * time.Millisecond)
	if _, err := d.C.Restore(ctx, "c1", n1.Node.ID); err == nil { // c1: template gone
		t.Fatal("restore to a node whose template died succeeded")
	}
	want := map[string][2]state.PathCounts{
		"c1": {{Process: 2, Failed: 1, Ineligible: 1}, {Process: 1, Failed: 1, TemplateGone: 1}},
		"c2": {{FilesOnly: 1, NoSessions: 1}, {FilesOnly: 1, OtherSandbox: 1}},
	}
	for id, w := range want {
		info, err := d.C.Get(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		if info.Stats.CheckpointPaths != w[0] || info.Stats.RestorePaths != w[1] {
			t.Errorf("%s: checkpoints %+v restores %+v, want %+v %+v", id, info.Stats.CheckpointPaths, info.Stats.RestorePaths, w[0], w[1])
		}
	}
	// n1's template was killed: c1 keeps n2's alone.
	node, err := d.C.Node(ctx, n2.Node.ID)
	if err != nil || node.Templates == nil || node.Templates.Processes != 1 || node.Templates.Rss <= 0 {
		t.Fatalf("node %s's templates: %v %+v", n2.Node.ID, err, node)
	}
	out, err := testutil.Command(t, time.Minute, testutil.Binary(t), "--socket", d.Socket, "tree").CombinedOutput()
	if err != nil {
		t.Fatalf("deltabox tree: %v\n%s", err, out)
	}
	for _, s := range []string{
		"c1  checkpoints 2 (process 2, files only 0), failed 1 (ineligible 1)  restores 1 (process 1, files only 0), failed 1 (template gone 1)",
		"c2  checkpoints 1 (process 0, files only 1: no process state 1)  restores 1 (process 0, files only 1: other sandbox 1)",
		n2.Node.ID + "  ", "[main: ", " private]", "templates 1: private dirty ", "templates (all sandboxes): 1, private dirty ",
	} {
		if !strings.Contains(string(out), s) {
			t.Errorf("deltabox tree does not show %q:\n%s", s, out)
		}
	}
}
