package state

import (
	"sync"
	"testing"
	"time"
)

// Work queued by afterAnswer starts only once no operation runs, and then runs.
// answerDelay is the tests' delay: the daemon's default.
const answerDelay = defaultAnswerDelay

func TestBackgroundWaitsForOperations(t *testing.T) {
	defer func(d time.Duration) { maxGateWait = d }(maxGateWait)
	maxGateWait = time.Minute
	b := newBackground(answerDelay, new(sync.WaitGroup))
	end1 := b.begin()
	end2 := b.begin()
	ran := make(chan struct{})
	b.after(func() { close(ran) })
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
func TestBackgroundDelay(t *testing.T) {
	b := newBackground(answerDelay, new(sync.WaitGroup))
	t0 := time.Now()
	ran := make(chan time.Duration, 1)
	b.after(func() { ran <- time.Since(t0) })
	select {
	case d := <-ran:
		if d < answerDelay {
			t.Fatalf("started after %v, before answerDelay %v", d, answerDelay)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("background work did not start")
	}
}

// Operations back to back, with no gap for the work to slip into, keep it waiting at most
// maxGateWait.
func TestBackgroundWaitIsBounded(t *testing.T) {
	b := newBackground(answerDelay, new(sync.WaitGroup))
	stop := make(chan struct{})
	defer close(stop)
	end := b.begin()
	go func() {
		for {
			select {
			case <-stop:
				end()
				return
			default:
			}
			next := b.begin() // the next operation begins before this one ends
			end()
			end = next
		}
	}()
	t0 := time.Now()
	ran := make(chan time.Duration, 1)
	b.after(func() { ran <- time.Since(t0) })
	select {
	case d := <-ran:
		if d > answerDelay+maxGateWait+time.Second {
			t.Fatalf("ran after %v", d)
		}
	case <-time.After(answerDelay + maxGateWait + 5*time.Second):
		t.Fatal("operations back to back starved the background work")
	}
}
