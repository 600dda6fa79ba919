package state

import (
	"testing"
	"time"
)

// Work queued by afterAnswer starts only once no operation runs, and then runs.
func TestAfterAnswerWaitsForOperations(t *testing.T) {
	m := &Manager{bg: newBackground()}
	end1 := m.bg.begin()
	end2 := m.bg.begin()
	ran := make(chan struct{})
	m.afterAnswer(func() { close(ran) })
	select {
	case <-ran:
		t.Fatal("background work started while two operations ran")
	case <-time.After(answerDelay + 50*time.Millisecond):
	}
	end1()
	end1() // an end called twice counts once
	select {
	case <-ran:
		t.Fatal("background work started while an operation ran")
	case <-time.After(20 * time.Millisecond):
	}
	end2()
	select {
	case <-ran:
	case <-time.After(5 * time.Second):
		t.Fatal("background work did not start once the operations ended")
	}
}

// With no operation running, the work starts after answerDelay, not before.
func TestAfterAnswerDelay(t *testing.T) {
	m := &Manager{bg: newBackground()}
	t0 := time.Now()
	ran := make(chan time.Duration, 1)
	m.afterAnswer(func() { ran <- time.Since(t0) })
	select {
	case d := <-ran:
		if d < answerDelay {
			t.Fatalf("started after %v, before answerDelay %v", d, answerDelay)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("background work did not start")
	}
}
