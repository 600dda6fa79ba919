package store

import (
	"errors"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"
)

// A commit that fails loses nothing and reports nothing durable before it is: its
// changes stay queued before later ones, WaitDurable returns the error instead of
// blocking, and once the cause is gone every change is committed, in order, and its
// After actions run.
func TestIndexCommitFailureKeepsChanges(t *testing.T) {
	defer func(a, b time.Duration) { retryFirst, retryMax = a, b }(retryFirst, retryMax)
	retryFirst, retryMax = 5*time.Millisecond, 20*time.Millisecond
	x, err := openIndex(filepath.Join(t.TempDir(), "index.db"))
	if err != nil {
		t.Fatal(err)
	}
	var failing atomic.Bool
	failing.Store(true)
	full := errors.New("no space left on device")
	x.SyncFS = func() error {
		if failing.Load() {
			return full
		}
		return nil
	}
	var afterRan atomic.Int32
	s1 := x.Apply(Op{PutNode: &Node{ID: "n1", Own: true, Layer: 1}}, Op{After: func() { afterRan.Add(1) }})
	s2 := x.Apply(Op{PutSandbox: &Sandbox{ID: "sb", Head: "n1"}})
	if err := x.WaitDurable(s1); !errors.Is(err, full) {
		t.Fatalf("WaitDurable while the commit fails: %v, want the commit's error", err)
	}
	time.Sleep(50 * time.Millisecond) // several failed tries, and the later change queued
	if x.Durable(s1) || x.Durable(s2) {
		t.Fatal("a change was reported durable while the commit before it failed")
	}
	if afterRan.Load() != 0 {
		t.Fatal("an After ran before the records before it were committed")
	}
	if x.Err() == nil {
		t.Fatal("Err is nil while the commit fails")
	}
	failing.Store(false)
	done := make(chan error, 1)
	go func() { done <- x.WaitDurable(s2) }()
	deadline := time.Now().Add(5 * time.Second)
	for !x.Durable(s2) {
		if time.Now().After(deadline) {
			t.Fatalf("not durable 5 s after the cause was gone: %v", x.Err())
		}
		time.Sleep(5 * time.Millisecond)
	}
	if x.Err() != nil || afterRan.Load() != 1 {
		t.Fatalf("after the retry: err %v, After ran %d times", x.Err(), afterRan.Load())
	}
	nodes, sbs, err := x.Load()
	if err != nil || len(nodes) != 1 || nodes[0].ID != "n1" || len(sbs) != 1 || sbs[0].Head != "n1" {
		t.Fatalf("index after the retry: %v %v %v", nodes, sbs, err)
	}
	if err := x.Close(); err != nil {
		t.Fatal(err)
	}
}

// Close with a commit still failing returns its error instead of waiting for ever.
func TestIndexCloseWhileFailing(t *testing.T) {
	x, err := openIndex(filepath.Join(t.TempDir(), "index.db"))
	if err != nil {
		t.Fatal(err)
	}
	x.SyncFS = func() error { return errors.New("I/O error") }
	x.Apply(Op{PutNode: &Node{ID: "n1", Own: true, Layer: 1}})
	done := make(chan error, 1)
	go func() { done <- x.Close() }()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("Close reported success with a change it could not write")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not return while the commit failed")
	}
}
