package state_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

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

// TestDiskPassDoesNotWaitForOperations: a sandbox over its quota while an operation holds
// it (a checkpoint's CRIU dump holds opMu for seconds) is marked at once by a pass that
// does not wait for the operation: the pass returns, every other sandbox's refusals go
// on, and its writer is killed as soon as the operation ends. A client retrying a
// refused exec in a loop costs a pass a second at most, not one per exec; a delete
// through the files API takes effect at the next call.
func TestDiskPassDoesNotWaitForOperations(t *testing.T) {
	m := open(t, testutil.NewSmallStore(t, 512))
	defer m.Close()
	ctx := context.Background()
	const id = "dq"
	if _, err := m.Create(ctx, state.CreateOptions{ID: id, DiskMB: 8}); err != nil {
		t.Fatal(err)
	}
	// Once told to, while an operation holds the sandbox: 12 MiB in files of 3
	// (RLIMIT_FSIZE bounds one file at the quota), then it waits.
	ready, wrote := make(chan struct{}), make(chan struct{})
	out := notifyOn(map[string]chan struct{}{"ready": ready, "written": wrote})
	stdin, tell := io.Pipe()
	defer tell.Close()
	writer := make(chan *sandbox.ExecResult, 1)
	go func() {
		r, err := m.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"bash", "-c",
			"echo ready; read go; for i in 1 2 3 4; do head -c 3M /dev/zero > /workspace/f$i; done; echo written; exec sleep 60"},
			Timeout: 90 * time.Second, StdinReader: stdin, OnOutput: out})
		if err != nil {
			t.Errorf("the writer: %v", err)
		}
		writer <- r
	}()
	wait := func(ch chan struct{}, what string) {
		t.Helper()
		select {
		case <-ch:
		case <-time.After(30 * time.Second):
			t.Fatalf("the writer: not %s in 30 s", what)
		}
	}
	wait(ready, "started")
	release, err := state.HoldOp(m, id) // as a checkpoint would
	if err != nil {
		t.Fatal(err)
	}
	tell.Write([]byte("go\n"))
	wait(wrote, "written")
	// The watcher's own passes run meanwhile too: one of them may mark it first.
	passed := make(chan error, 1)
	t0 := time.Now()
	go func() { passed <- state.DiskPass(m) }()
	select {
	case err := <-passed:
		if err != nil {
			t.Errorf("pass: %v", err)
		}
		t.Logf("a pass while an operation holds the sandbox: %v", time.Since(t0).Round(time.Millisecond))
	case <-time.After(5 * time.Second):
		t.Errorf("the disk pass waits for the sandbox's operation (5 s and more)")
		release()
		<-passed
		release = func() {}
	}
	if why := state.DiskOver(m, id); why == "" {
		t.Errorf("the sandbox, 12 MiB at disk_mb 8, is not marked over its quota")
	}
	release()
	select {
	case r := <-writer:
		if r == nil || r.Signal != int(unix.SIGKILL) {
			t.Fatalf("the writer: %+v, want killed (SIGKILL)", r)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the writer still runs 10 s after the operation ended")
	}
	// Refused execs in a loop reuse the last pass.
	seen := map[time.Time]bool{}
	for range 20 {
		if _, err := m.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"true"}}); !errors.Is(err, errdefs.ErrQuota) {
			t.Fatalf("exec over quota: %v, want 507", err)
		}
		seen[state.PassAt(m)] = true
	}
	t.Logf("20 refused execs: %d passes", len(seen))
	if len(seen) > 3 { // one, and the watcher's own at most twice
		t.Errorf("20 refused execs made %d passes, want the last one reused", len(seen))
	}
	// A delete through the files API takes effect at the next exec.
	if err := m.FileOp(ctx, id, "files remove /workspace", func(root int, _ string) error {
		for _, f := range []string{"f1", "f2", "f3", "f4"} {
			if err := unix.Unlinkat(root, "workspace/"+f, 0); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if got := sh(t, m, id, "echo back"); got != "back\n" {
		t.Fatalf("after the delete: %q", got)
	}
}

// notifyOn is an OnOutput that closes each channel once the output holds its line.
func notifyOn(lines map[string]chan struct{}) func(string, []byte) {
	var mu sync.Mutex
	var seen strings.Builder
	return func(_ string, b []byte) {
		mu.Lock()
		defer mu.Unlock()
		seen.Write(b)
		for line, ch := range lines {
			if strings.Contains(seen.String(), line) {
				close(ch)
				delete(lines, line)
			}
		}
	}
}
