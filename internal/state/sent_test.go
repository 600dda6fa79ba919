package state_test

import (
	"context"
	"testing"
	"time"

	"deltabox/internal/state"
	"deltabox/internal/testutil"
)

// TestEarlyAnswerForkWaitsForSent: the steps after an early answer (the fork of the
// templates) start once the caller says the answer is sent (CheckpointOptions.Sent,
// closed by the API after writing it), not beside its writing; and without that word
// they start at the bound (sentWait) anyway, so a node never stays pending for a
// caller that forgets.
func TestEarlyAnswerForkWaitsForSent(t *testing.T) {
	root := testutil.NewStore(t)
	m := open(t, root)
	defer m.Close()
	ctx := context.Background()
	const id = "sent"
	if _, err := m.Create(ctx, state.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	if _, err := m.StartSession(ctx, id, state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	call(t, m, id, "py", "x = 1")

	defer state.SetSentWait(time.Minute)()
	sent := make(chan struct{})
	r, err := m.CheckpointWith(ctx, id, state.CheckpointOptions{Sent: sent})
	if err != nil || r.Node == nil || !r.Node.Pending {
		t.Fatalf("checkpoint: %v %+v, want an early answer", err, r)
	}
	time.Sleep(500 * time.Millisecond) // a fork of this python takes milliseconds
	if !state.Pending(m, r.Node.ID) {
		t.Fatalf("node %s completed before its answer was sent", r.Node.ID)
	}
	close(sent)
	if n, err := m.Node(r.Node.ID); err != nil || n.Pending {
		t.Fatalf("node %s once its answer was sent: %v %+v, want it complete", r.Node.ID, err, n)
	}

	state.SetSentWait(100 * time.Millisecond)
	t0 := time.Now()
	r, err = m.CheckpointWith(ctx, id, state.CheckpointOptions{Sent: make(chan struct{})})
	if err != nil || r.Node == nil || !r.Node.Pending {
		t.Fatalf("checkpoint: %v %+v, want an early answer", err, r)
	}
	if n, err := m.Node(r.Node.ID); err != nil || n.Pending {
		t.Fatalf("node %s whose answer was never said sent: %v %+v, want it complete", r.Node.ID, err, n)
	}
	if d := time.Since(t0); d > 10*time.Second {
		t.Fatalf("node %s completed %v after its answer, with a 100 ms bound on the wait for Sent", r.Node.ID, d)
	}
	if got := call(t, m, id, "py", "print(x)"); got != "1\n" {
		t.Fatalf("the session after both checkpoints: %q", got)
	}
}
