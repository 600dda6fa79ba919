package e2e

import (
	"fmt"
	"strings"
	"testing"

	"deltabox/internal/apitypes"
	"deltabox/internal/testutil"
)

// TestCheckpointAnswersBeforeItsFork: a checkpoint of a sandbox with a python session
// (a 64 MiB heap, whose fork takes milliseconds) answers before its node is complete:
// the answer's node is pending, and the node's complete_ms, once complete, is later than
// the answer's duration_ms. The very next call sees exactly the checkpointed state; a
// restore sent right after the answer waits for the node and gives back exactly its
// state (the session's variable and heap, the file); answer "complete" answers a
// complete node, with complete_ms. internal/state's TestFailureAtEveryStepKeepsProcesses
// fails each step after the answer.
func TestCheckpointAnswersBeforeItsFork(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "early"
	dbxCreate(t, d, id)
	if _, err := d.C.StartSession(dbxCtx(t), id, apitypes.SessionOptions{Name: "py", Kind: apitypes.SessionPython}); err != nil {
		t.Fatal(err)
	}
	sessRun(t, d, id, "py", "heap = [bytearray(b'%c' % (65 + i % 26)) * (1 << 20) for i in range(64)]")
	set := func(v int) {
		t.Helper()
		sessRun(t, d, id, "py", fmt.Sprintf("x = %d; heap[%d][:] = b'%d' * (1 << 20); open('/workspace/x', 'w').write('%d')", v, v%64, v%10, v))
	}
	state := func() string {
		t.Helper()
		return strings.TrimSpace(sessRun(t, d, id, "py", "print(x, sum(h[0] for h in heap), open('/workspace/x').read())"))
	}
	set(1)
	want1 := state()

	a, err := d.C.Checkpoint(dbxCtx(t), id, "one")
	if err != nil {
		t.Fatal(err)
	}
	if a.Node == nil || !a.Node.Pending || a.CompleteMS != 0 || a.Processes < 1 || !strings.Contains(strings.Join(a.Sessions, ","), "py") {
		t.Fatalf("checkpoint: %+v, node %+v; want an early answer (node pending, no complete_ms) carrying the python session", a, a.Node)
	}
	// The very next call waits for the node, and sees the sandbox exactly as checkpointed.
	if got := state(); got != want1 {
		t.Fatalf("the call right after the early answer: %q, want %q", got, want1)
	}
	n1, err := d.C.Node(dbxCtx(t), a.Node.ID)
	if err != nil || n1.Pending || n1.CompleteMS <= a.DurationMS {
		t.Fatalf("node %s after the next call: %+v, %v; want it complete, complete_ms (time until complete) above the answer's duration_ms %.3f", a.Node.ID, n1, err, a.DurationMS)
	}
	if n1.Layer != a.Node.Layer || n1.Own != a.Node.Own || n1.Depth != a.Node.Depth || n1.Parent != a.Node.Parent {
		t.Fatalf("the early answer's node %+v is not the complete node %+v", a.Node, n1)
	}
	t.Logf("checkpoint: answer %.3f ms, complete %.3f ms (phases at the answer %v)", a.DurationMS, n1.CompleteMS, a.PhasesUS)

	// A restore sent right after an early answer, with no call between.
	set(2)
	want2 := state()
	b, err := d.C.Checkpoint(dbxCtx(t), id, "two")
	if err != nil || !b.Node.Pending {
		t.Fatalf("checkpoint two: %+v, %v; want it pending", b, err)
	}
	r, err := d.C.Restore(dbxCtx(t), id, b.Node.ID)
	if err != nil || r.Processes != b.Processes {
		t.Fatalf("restore to node %s right after its early answer: %+v, %v", b.Node.ID, r, err)
	}
	if got := state(); got != want2 {
		t.Fatalf("after the restore to node %s right after its answer: %q, want %q", b.Node.ID, got, want2)
	}
	set(3)
	dbxRestore(t, d, id, a.Node.ID)
	if got := state(); got != want1 {
		t.Fatalf("after the restore to node %s: %q, want %q", a.Node.ID, got, want1)
	}

	// answer "complete": the node is complete in the answer.
	c, err := d.C.CheckpointWith(dbxCtx(t), id, apitypes.CheckpointRequest{Label: "three", Answer: "complete"})
	if err != nil || c.Node.Pending || c.CompleteMS <= 0 || c.CompleteMS != c.DurationMS || c.Node.CompleteMS <= 0 {
		t.Fatalf("checkpoint answer complete: %+v node %+v, %v; want the node complete, complete_ms = duration_ms", c, c.Node, err)
	}
	if _, err := d.C.CheckpointWith(dbxCtx(t), id, apitypes.CheckpointRequest{Answer: "soon"}); err == nil || !strings.Contains(err.Error(), "early") {
		t.Fatalf("checkpoint answer soon: %v, want a refusal naming the choices", err)
	}
}
