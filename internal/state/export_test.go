package state

import (
	"fmt"
	"time"
)

// For the external tests: how many steps the fault injection has (SetFailStep numbers
// 1..n), read from the step tables so that a new step is injected too.
var (
	CheckpointStepCount = len(checkpointSteps)
	RestoreStepCount    = len(restoreSteps)
)

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
