package state

import (
	"fmt"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/errdefs"
)

// OpResult reports one checkpoint or restore. The wire form is defined once, in
// apitypes.
type OpResult = apitypes.OpResult

// phase records the time since *t in r.PhasesUS under name and resets *t.
func phase(r *OpResult, name string, t *time.Time) {
	now := time.Now()
	if r.PhasesUS == nil {
		r.PhasesUS = map[string]int64{}
	}
	r.PhasesUS[name] += now.Sub(*t).Microseconds()
	*t = now
}

// beginOp locks s for a checkpoint or restore and refuses while an exec runs.
// On success the caller holds s.opMu and treeMu (shared) and must call the returned func.
func (m *Manager) beginOp(id, what string) (*sb, func(), error) {
	s, err := m.get(id)
	if err != nil {
		return nil, nil, err
	}
	if err := m.lockLive(s); err != nil {
		return nil, nil, err
	}
	s.mu.Lock()
	busy := s.execs
	s.mu.Unlock()
	if busy > 0 {
		s.opMu.Unlock()
		return nil, nil, fmt.Errorf("sandbox %s is running %d command(s); %s after they finish (or time out): %w", id, busy, what, errdefs.ErrConflict)
	}
	// A warm-up of restored processes (procwarm.go) lets go of its process first.
	if err := m.stopProcWarm(s); err != nil {
		s.opMu.Unlock()
		return nil, nil, err
	}
	end := s.bg.begin()
	m.treeMu.RLock()
	return s, func() { m.treeMu.RUnlock(); s.opMu.Unlock(); end() }, nil
}

// fail is the fault-injection point of step k of op (Manager.FailStep; tests only).
func (m *Manager) fail(op string, k int) error {
	if m.FailStep != nil {
		return m.FailStep(op, k)
	}
	return nil
}

// killAll ends every process but init and keep (sandbox PIDs: live sessions being
// checkpointed, templates); it skips the round trip to init (and init's walk of /proc)
// when the cgroup holds only keepHost (host PIDs of the same processes, and init's; nil:
// always ask init). (Counting is not enough: keep may name templates that died.)
func killAll(s *sb, keep []int, keepHost map[int]bool) (int, error) {
	if keepHost != nil && onlyKept(s, keepHost) {
		return 0, nil
	}
	n, err := s.rt.KillAll(keep...)
	if err != nil {
		return 0, fmt.Errorf("end the sandbox's processes: %w", err)
	}
	return n, nil
}

// onlyKept reports whether every process in s's cgroup is in keep (host PIDs).
func onlyKept(s *sb, keep map[int]bool) bool {
	pids, err := s.rt.Pids()
	if err != nil {
		return false
	}
	for _, p := range pids {
		if !keep[p] {
			return false
		}
	}
	return true
}

// step is one numbered step of an operation (checkpointSteps, restoreSteps).
type step[T any] struct {
	phase string // its name in OpResult.PhasesUS (a step may record parts of itself too)
	run   func(T) error
	// injectInside: the step calls the operation's fault-injection point itself (after
	// its first process, so that a partial step is undone too), instead of before it.
	injectInside bool
}

// runSteps runs steps in order on op, each after its fault-injection point (FailStep's
// number k is steps[k-1]; for a step that injects inside, *inject is set to its point),
// and records each one's time in res from t0 on. It stops at the first error; the
// caller runs op's undo list.
func runSteps[T any](m *Manager, name string, steps []step[T], op T, inject *func() error, res *OpResult, t0 time.Time) error {
	tp := t0
	for i, st := range steps {
		k := i + 1
		point := func() error { return m.fail(name, k) }
		if st.injectInside {
			*inject = point
		} else if err := point(); err != nil {
			return err
		}
		if err := st.run(op); err != nil {
			return err
		}
		phase(res, st.phase, &tp)
	}
	return nil
}
