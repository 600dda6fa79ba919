package state

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"deltabox/internal/sandbox"
	"deltabox/internal/session"
	"deltabox/internal/store"
)

// For the external tests: how many steps the fault injection has (SetFailStep numbers
// 1..n), read from the step tables so that a new step is injected too.
var (
	CheckpointStepCount = len(checkpointSteps)
	RestoreStepCount    = len(restoreSteps)
	SpareStepCount      = len(swapSteps)
)

// SpareCopies are the host PIDs of sandbox id's spare of node (nil: none).
func SpareCopies(m *Manager, id, node string) []int {
	s, err := m.get(id)
	if err != nil {
		return nil
	}
	s.spareMu.Lock()
	defer s.spareMu.Unlock()
	for _, sp := range s.spares {
		if sp.node == node {
			var out []int
			for _, c := range sp.b.copies {
				out = append(out, c.r.HostPid)
			}
			return out
		}
	}
	return nil
}

// WaitPidFree is waitPidFree on sandbox id's runtime.
func WaitPidFree(m *Manager, id string, pid int, d time.Duration) error {
	s, err := m.get(id)
	if err != nil {
		return err
	}
	return waitPidFree(s.rt, pid, d) // +checklocksignore: tests: rt is set while the sandbox runs
}

// SetFailStep sets the fault injection of m's checkpoints, restores and removes
// (Manager.failStep): step k of op fails with f's error; nil turns it off.
func SetFailStep(m *Manager, f func(op string, step int) error) { m.failStep = f }

// ReclaimDisk runs the disk watcher's reclaim of sandbox id (diskPass does when the
// store is short and id holds most) and waits until it is done, d at most.
func ReclaimDisk(m *Manager, id string, d time.Duration) error {
	s, err := m.get(id)
	if err != nil {
		return err
	}
	m.reclaimDisk(s)
	for t0 := time.Now(); ; time.Sleep(10 * time.Millisecond) {
		s.mu.Lock()
		busy := s.reclaiming
		s.mu.Unlock()
		if !busy {
			return nil
		}
		if time.Since(t0) > d {
			return fmt.Errorf("the reclaim of %s still runs after %v", id, d)
		}
	}
}

// HoldOp takes sandbox id's opMu, as a checkpoint does for its whole length, until the
// returned func is called.
// +checklocksignore: hands opMu to the test through release
func HoldOp(m *Manager, id string) (release func(), err error) {
	s, err := m.get(id)
	if err != nil {
		return nil, err
	}
	s.opMu.Lock()
	return s.opMu.Unlock, nil
}

// DiskPass runs one pass of the disk watcher.
func DiskPass(m *Manager) error { return m.diskPass(false, 0) }

// DiskOver is why sandbox id is stopped for its disk ("" when it is not).
func DiskOver(m *Manager, id string) string {
	s, err := m.get(id)
	if err != nil {
		return ""
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.disk.over
}

// PassAt is when the last complete disk pass started.
func PassAt(m *Manager) time.Time {
	m.diskMu.Lock()
	defer m.diskMu.Unlock()
	return m.passAt
}

// FastBranch is a branch ForkFastBranches made: its runtime and its sessions.
type FastBranch struct {
	RT       *sandbox.Sandbox
	Sessions map[string]*session.Session
}

// ForkFastBranches makes n branches of sandbox id's family on node with the fast path's
// mechanism (startFastBranch, all at once; then place, node's templates in id placed at
// their PIDs, one branch after the other) and lets the copies run. phases sums, over
// the branches, the time their inits, states and copies took. remove removes them all.
// +checklocksignore: takes opMu for the branches' making
func ForkFastBranches(m *Manager, id, node string, n int) (out []FastBranch, phases [3]time.Duration, remove func() error, err error) {
	s, err := m.get(id)
	if err != nil {
		return nil, phases, nil, err
	}
	s.opMu.Lock()
	defer s.opMu.Unlock()
	s.tmplMu.Lock()
	defer s.tmplMu.Unlock()
	tps, err := m.templatesFor(s, node)
	if err != nil {
		return nil, phases, nil, err
	}
	iso, floor, err := m.fastFamily(s, tps)
	if err != nil {
		return nil, phases, nil, err
	}
	made := make([]*fastBranch, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range made {
		wg.Add(1)
		go func() {
			defer wg.Done()
			made[i], errs[i] = m.startFastBranch(s.rt, store.Sandbox{Limits: s.rec.Limits, DiskMB: s.rec.DiskMB, Image: s.rec.Image}, iso, node, fmt.Sprintf("%s-fast%d", id, i), fmt.Sprintf("%s-fast%d", id, i), floor, "", 0)
		}()
	}
	wg.Wait()
	remove = func() error {
		var errs []error
		for _, b := range made {
			if b != nil {
				errs = append(errs, b.remove(m))
			}
		}
		return errors.Join(errs...)
	}
	if err := errors.Join(errs...); err != nil {
		return nil, phases, nil, withUndo(err, remove())
	}
	for _, b := range made {
		if err := m.place(m.tracer(s), s.rt, b, tps); err != nil {
			return nil, phases, nil, withUndo(err, remove())
		}
		phases[0] += b.init
		phases[1] += b.state
		phases[2] += b.place
	}
	for _, b := range made {
		out = append(out, FastBranch{RT: b.rt, Sessions: b.sessions})
		if err := b.commit(); err != nil {
			return nil, phases, nil, withUndo(err, remove())
		}
	}
	return out, phases, remove, nil
}

// Runtime is sandbox id's runtime.
// +checklocksignore: tests: rt is set while the sandbox runs
func Runtime(m *Manager, id string) (*sandbox.Sandbox, error) {
	s, err := m.get(id)
	if err != nil {
		return nil, err
	}
	return s.rt, nil
}

// SpareInit is the host PID of the init of sandbox id's spare of node, 0 if none.
func SpareInit(m *Manager, id, node string) int {
	s, err := m.get(id)
	if err != nil {
		return 0
	}
	s.spareMu.Lock()
	defer s.spareMu.Unlock()
	for _, sp := range s.spares {
		if sp.node == node {
			return sp.b.rt.InitPid()
		}
	}
	return 0
}
