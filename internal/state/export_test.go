package state

import "time"

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
	return waitPidFree(s.rt, pid, d)
}

// SetFailStep sets the fault injection of m's checkpoints, restores and removes
// (Manager.failStep): step k of op fails with f's error; nil turns it off.
func SetFailStep(m *Manager, f func(op string, step int) error) { m.failStep = f }
