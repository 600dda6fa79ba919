package state

import (
	"os"
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
// So background work waits, before it starts, until no checkpoint or restore is running
// in the daemon: an operation does not wait for work that has not started, and work
// that has started runs to its end (it holds locks an operation may need). It also
// waits answerDelay after it was queued, which lets the answer reach the client and a
// follow-up operation arrive first. Work is never dropped: it runs in the next gap, and
// the gaps exist because a client sends one operation per sandbox at a time.
type background struct {
	mu   sync.Mutex
	cond *sync.Cond
	ops  int // checkpoints and restores running
}

func newBackground() *background {
	b := &background{}
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

// answerDelay lets an operation's answer reach the client, and the client's next
// operation arrive, before the background work it left starts. Measured: with 0.3 ms,
// 0.8-1 ms between the daemon's and the client's view of a checkpoint without the wait
// below; an MCTS rollback follows its checkpoint's answer by 0.5-1.5 ms.
var answerDelay = func() time.Duration {
	if d, err := time.ParseDuration(os.Getenv("DELTABOX_ANSWER_DELAY")); err == nil && d >= 0 {
		return d
	}
	return 2 * time.Millisecond
}()

// holderDelay is how long a restore's memory holders (remote.HoldMM) outlive its answer:
// killing one frees the old process's memory (1-2 ms of CPU for a 63 MB python), which
// should not compete with the answer.
const holderDelay = 300 * time.Microsecond

// afterAnswer runs f in the background, answerDelay from now and once no checkpoint or
// restore is running.
func (m *Manager) afterAnswer(f func()) {
	go func() {
		time.Sleep(answerDelay)
		b := m.bg
		b.mu.Lock()
		for b.ops > 0 {
			b.cond.Wait()
		}
		b.mu.Unlock()
		f()
	}()
}
