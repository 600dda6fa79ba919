package state_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"deltabox/internal/errdefs"
	"deltabox/internal/sandbox"
	"deltabox/internal/state"
	"deltabox/internal/testutil"
)

// TestReclaimKeepsSandboxOnTransientFailure: the disk watcher gives back a stopped
// sandbox's upper by restoring it to its head. A call running at that moment makes the
// restore wait for it, not fail (409) and have the sandbox removed; a restore that
// fails with 503 (or 409 after the wait) leaves the sandbox for the next pass; only one
// that fails for good removes it.
func TestReclaimKeepsSandboxOnTransientFailure(t *testing.T) {
	m := open(t, testutil.NewStore(t))
	defer m.Close()
	ctx := context.Background()
	const id = "rc"
	if _, err := m.Create(ctx, state.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	sh(t, m, id, "echo a > /workspace/a")
	if _, err := m.Checkpoint(ctx, id, "c1"); err != nil {
		t.Fatal(err)
	}
	written := func() string {
		t.Helper()
		if _, err := m.Get(id); err != nil {
			t.Fatalf("the sandbox is gone: %v", err)
		}
		return sh(t, m, id, "cat /workspace/a; cat /workspace/b 2>/dev/null || echo no-b")
	}

	// A call holds the sandbox when the reclaim comes: its restore waits for it.
	sh(t, m, id, "echo b > /workspace/b")
	done := make(chan error, 1)
	go func() {
		_, err := m.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"sleep", "2"}, Timeout: 30 * time.Second})
		done <- err
	}()
	time.Sleep(500 * time.Millisecond) // the exec is running
	if err := state.ReclaimDisk(m, id, time.Minute); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("the running exec: %v", err)
	}
	if got := written(); got != "a\nno-b\n" {
		t.Fatalf("after a reclaim that waited for a running call: %q, want the sandbox restored to c1 (a, no b)", got)
	}

	// A restore that fails for the moment (503) keeps the sandbox, unrestored.
	sh(t, m, id, "echo b > /workspace/b")
	state.SetFailStep(m, func(op string, k int) error {
		if op == "restore" && k == 1 {
			return fmt.Errorf("injected: %w", errdefs.ErrUnavailable)
		}
		return nil
	})
	err := state.ReclaimDisk(m, id, time.Minute)
	state.SetFailStep(m, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := written(); got != "a\nb\n" {
		t.Fatalf("after a reclaim whose restore failed with 503: %q, want the sandbox as it was", got)
	}

	// One that fails for good removes it: its upper is given back that way.
	state.SetFailStep(m, func(op string, k int) error {
		if op == "restore" && k == 1 {
			return errors.New("injected failure")
		}
		return nil
	})
	err = state.ReclaimDisk(m, id, time.Minute)
	state.SetFailStep(m, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Get(id); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("after a reclaim whose restore failed for good: %v, want the sandbox removed", err)
	}
}
