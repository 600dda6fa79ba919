package durable

import (
	"sync"
	"syscall"
	"time"
)

// A background dump gives way to the operations of its sandbox (DumpOptions.Yield):
// while one runs, CRIU's process group is stopped (SIGSTOP), and continued when it
// ends. CRIU drives the dump, the parasite in the dumped process only answers it, so a
// stopped CRIU leaves the dumped process waiting too: neither competes with the
// operation for the CPUs (the parasite runs in the sandbox's own cpu group, at the
// process's priority; a restore beside a dump measured 1.5-2x slower in its forks and
// its reap on a 2-core machine). A syscall CRIU is in finishes first: a stop takes
// effect on the way back to user space.
//
// Bounds: CRIU is never held stopped longer than maxYield at a time, and then runs at
// least minRun before it gives way again, so that a stream of operations (their gaps
// shorter than CRIU's start) still lets the dump end, at a third of its speed at worst,
// well within its deadline. CRIU's own timers (its 10 s freeze timeout) are far above
// maxYield. A daemon that dies while CRIU is stopped continues it: CRIU's parent-death
// signal is SIGCONT (run.start), and it then ends its dump as the socket closes.
const (
	maxYield = 50 * time.Millisecond
	minRun   = 25 * time.Millisecond
)

// pacer stops and continues one CRIU's process group as its caller's gate says.
type pacer struct {
	mu sync.Mutex
	// +checklocks:mu
	pgid int // CRIU's process group (its PID), given at creation
	// +checklocks:mu
	stopped bool
	// +checklocks:mu
	busy bool // the caller's last word: an operation runs
	// +checklocks:mu
	runUntil time.Time // no stop before (after a stop of maxYield)
	// +checklocks:mu
	timer *time.Timer
	// +checklocks:mu
	done bool
}

// set is the caller's gate: busy while an operation of the sandbox runs.
func (p *pacer) set(busy bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.busy = busy
	p.applyLocked()
}

// applyLocked stops or continues CRIU for the current state. Precondition: mu held.
// +checklocks:p.mu
func (p *pacer) applyLocked() {
	if p.done {
		return
	}
	now := time.Now()
	want := p.busy && !now.Before(p.runUntil)
	if want == p.stopped {
		if !want && p.busy && p.timer == nil {
			// Not stopped because of minRun: look again once it has passed.
			p.timer = time.AfterFunc(p.runUntil.Sub(now), p.tick)
		}
		return
	}
	if p.timer != nil {
		p.timer.Stop()
		p.timer = nil
	}
	if want {
		_ = syscall.Kill(-p.pgid, syscall.SIGSTOP) // ESRCH: CRIU has exited
		p.stopped = true
		p.timer = time.AfterFunc(maxYield, func() {
			p.mu.Lock()
			defer p.mu.Unlock()
			p.timer = nil
			if p.stopped && !p.done {
				p.runUntil = time.Now().Add(minRun)
				p.continueLocked()
				p.applyLocked()
			}
		})
		return
	}
	p.continueLocked()
}

// tick re-applies the gate once minRun has passed.
func (p *pacer) tick() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.timer = nil
	p.applyLocked()
}

// +checklocks:p.mu
func (p *pacer) continueLocked() {
	_ = syscall.Kill(-p.pgid, syscall.SIGCONT) // ESRCH: CRIU has exited
	p.stopped = false
}

// end continues CRIU for good (it is about to be waited for, or has exited).
func (p *pacer) end() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.timer != nil {
		p.timer.Stop()
		p.timer = nil
	}
	if p.stopped {
		p.continueLocked()
	}
	p.done = true
}
