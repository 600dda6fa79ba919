package state

import (
	"errors"
	"fmt"
	"time"

	"deltabox/internal/errdefs"
	"deltabox/internal/fastpath"
	"deltabox/internal/session"
)

// Async warm-up of restored processes. A process revived from a template shares every
// private page with it, copy-on-write: the first write to each page after a restore
// faults and copies it (a python touching 50 MB of its heap takes 12800 such faults).
// When the restore has answered and while the session waits for its next call, the
// manager pre-faults, by injected MADV_POPULATE_WRITE in chunks of warmChunk bytes, the
// pages the template has present in its private writable mappings (the pages the
// process had written before the checkpoint: the likeliest to be written again).
//
// Only bash and python sessions are warmed (they wait for input between calls; a command
// session's process never idles). It never runs while a command runs: it starts only
// when no exec or file operation is registered, checks that again before every chunk,
// and every exec, checkpoint and restore stops it first (stopProcWarm), which returns
// once the process has been let go (at most one chunk later). It also stops when the
// sandbox's memory use passes 3/4 of its limit: the copies are charged to the sandbox,
// and pre-faulting must not be what OOM-kills it.
//
// It is off by default: on for a sandbox created with WarmProcesses, or for all with
// Config.WarmProcesses. `deltabox bench warm` measures it (docs/BENCHMARKS.md, warm):
// after a pause, the first command that rewrites a 50 MB heap takes 2.7 ms instead of
// 50 ms; but the copies are made whether or not the next command writes, and the next
// restore pays for them: 11.1 ms instead of 9.6 ms, the latency that matters most.

const warmChunk = 1 << 20

// procWarm is one running warm-up.
type procWarm struct {
	stop chan struct{} // closed to stop it
	done chan struct{} // closed once its process is let go
}

// startProcWarm warms the processes a restore revived, after the answer. Precondition:
// s.opMu held, the revived processes committed.
// +checklocks:s.opMu
func (m *Manager) startProcWarm(s *sb, rvs []*revival) {
	if !(s.rec.WarmProcesses || m.cfg.WarmProcesses) || len(rvs) == 0 || s.rt == nil {
		return
	}
	type target struct{ tmpl, live int }
	var ts []target
	for _, rv := range rvs {
		// A command session's process is never idle, nor is one outside the sessions
		// known to be: they are not warmed.
		if rv.r != nil && rv.r.HostPid != 0 && rv.sess != nil && rv.pt.kind != session.Command {
			ts = append(ts, target{rv.pt.tmpl.HostPid, rv.r.HostPid})
		}
	}
	tr, rt, limit, id := m.tracer(s), s.rt, s.rec.Limits.MemoryBytes, s.rec.ID
	w := &procWarm{stop: make(chan struct{}), done: make(chan struct{})}
	s.mu.Lock()
	s.warming = w
	s.mu.Unlock()
	idle := func() bool {
		s.mu.Lock()
		busy := s.execs > 0
		s.mu.Unlock()
		if busy {
			return false
		}
		return limit <= 0 || rt.Usage().MemoryBytes < limit/4*3
	}
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		defer close(w.done)
		select {
		case <-time.After(m.cfg.AnswerDelay):
		case <-w.stop:
			return
		}
		t0 := time.Now()
		var total uintptr
		for _, t := range ts {
			if !idle() {
				break
			}
			runs, err := fastpath.TouchedWritable(t.tmpl)
			if err != nil {
				continue
			}
			n, err := fastpath.Warm(tr, t.live, runs, warmChunk, w.stop, idle)
			total += n
			if errors.Is(err, fastpath.ErrWarmStopped) {
				break
			}
		}
		s.mu.Lock()
		s.stats.WarmedBytes += int64(total)
		s.mu.Unlock()
		m.log.Debug("warmed restored processes", "sandbox", id, "bytes", total, "took", time.Since(t0))
	}()
}

// warmStopWait bounds how long stopProcWarm waits for the warm-up to let go of its
// process: at most one chunk (1 MiB of MADV_POPULATE_WRITE, well under a millisecond)
// is in flight when it is asked to stop.
const warmStopWait = 5 * time.Second

// stopProcWarm stops s's warm-up, if any, and returns once its process is let go, or an
// error after warmStopWait (the process is then still seized by the warm-up: nothing
// may inject into it).
func (m *Manager) stopProcWarm(s *sb) error {
	s.mu.Lock()
	w := s.warming
	s.warming = nil
	s.mu.Unlock()
	if w == nil {
		return nil
	}
	close(w.stop)
	t := time.NewTimer(warmStopWait)
	defer t.Stop()
	select {
	case <-w.done:
		return nil
	case <-t.C:
		return fmt.Errorf("the warm-up of %s's restored processes did not let go of them within %v; try again: %w", s.rec.ID, warmStopWait, errdefs.ErrUnavailable)
	}
}
