package state

import (
	"sync"
	"time"
)

// Work left for after an operation's answer: mounting the next and warm states (about
// a millisecond of CPU each), parking templates (injections, on the tracer's thread),
// killing memory holders (their exit frees the old process's memory: 1-2 ms for a
// 63 MB python), closing old namespaces. It is needed soon but not by the client
// waiting for the answer, and on a two-core machine it competes with the next
// operation: MCTS with no think time asks for a rollback about a millisecond after each
// checkpoint's answer, and that rollback measured 1.5-2 ms slower while the checkpoint's
// work ran beside it (a memory holder made in 0.7-1.3 ms instead of 0.35, a warm state
// waited for).
//
// So background work waits, before it starts, until no checkpoint or restore of its
// sandbox is running: an operation does not wait for work that has not started, and
// work that has started runs to its end (it holds locks an operation may need). It also
// waits the answer delay (Config.AnswerDelay) after it was queued, which lets the answer reach the client and a
// follow-up operation arrive first. Work is never dropped, and it waits at most
// maxGateWait: a sandbox's operations are serialised (opMu), so the work normally runs in
// the gap after the operation it found running. The gate is per sandbox so that other
// sandboxes' operations (RL fan-out, Best-of-N) cannot keep it closed; work of different
// sandboxes competes for the CPUs as before.
type background struct {
	delay time.Duration   // answerDelay (Config.AnswerDelay)
	wg    *sync.WaitGroup // the manager's: Close waits for the work
	mu    sync.Mutex
	// +checklocks:mu
	cond *sync.Cond
	// +checklocks:mu
	ops int // checkpoints and restores of the sandbox running (0 or 1)
}

// newBackground makes a sandbox's gate; work waits delay after it is queued and is
// counted in wg.
func newBackground(delay time.Duration, wg *sync.WaitGroup) *background {
	b := &background{delay: delay, wg: wg}
	b.cond = sync.NewCond(&b.mu)
	return b
}

// begin marks an operation running until the returned function is called.
func (b *background) begin() (end func()) {
	b.mu.Lock()
	b.ops++
	b.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			b.mu.Lock()
			b.ops--
			if b.ops == 0 {
				b.cond.Broadcast()
			}
			b.mu.Unlock()
		})
	}
}

// defaultAnswerDelay lets an operation's answer reach the client, and the client's next
// operation arrive, before the background work it left starts: an MCTS rollback
// follows its checkpoint's answer by 0.5-1.5 ms here (measured), and the answer itself
// takes 0.15-0.8 ms to reach the client (more after the client was idle).
const defaultAnswerDelay = 2 * time.Millisecond

// holderDelay is how long a restore's memory holders (remote.HoldMM) outlive its answer:
// killing one frees the old process's memory (1-2 ms of CPU for a 63 MB python), which
// should not compete with the answer.
const holderDelay = 300 * time.Microsecond

// maxGateWait bounds how long work waits for operations to end: a client that sends the
// next operation before the previous one's end wakes the waiting work could otherwise
// keep it waiting.
var maxGateWait = 50 * time.Millisecond // a var for tests

// after runs f in the background, b.delay from now and once no operation runs (or
// maxGateWait later).
func (b *background) after(f func()) {
	b.wg.Add(1)
	go func() {
		defer b.wg.Done()
		time.Sleep(b.delay)
		deadline := time.Now().Add(maxGateWait)
		b.mu.Lock()
		if b.ops > 0 {
			t := time.AfterFunc(maxGateWait, func() {
				b.mu.Lock()
				b.cond.Broadcast()
				b.mu.Unlock()
			})
			for b.ops > 0 && time.Now().Before(deadline) {
				b.cond.Wait()
			}
			t.Stop()
		}
		b.mu.Unlock()
		f()
	}()
}

// afterAnswer runs f in the background, the answer delay from now and once no checkpoint or
// restore of s is running.
func (m *Manager) afterAnswer(s *sb, f func()) { s.bg.after(f) }
