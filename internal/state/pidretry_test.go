package state

import (
	"errors"
	"log/slog"
	"strings"
	"testing"

	"deltabox/internal/durable"
	"deltabox/internal/proctree"
)

// TestRestoreFreeingPidRetries: a CRIU restore that fails on a PID nothing holds once
// it has failed (a reaped task whose PID the kernel frees a moment after its /proc
// entry goes) is run again until it succeeds; one whose PID a process holds is not,
// and its error names the holder; other errors are returned at once.
func TestRestoreFreeingPidRetries(t *testing.T) {
	m := &Manager{log: slog.New(slog.DiscardHandler)}
	taken := &durable.PidTakenError{Pid: 17, Err: errors.New("criu restore failed (errno 17)")}
	t.Run("freed meanwhile", func(t *testing.T) {
		calls := 0
		rs, err := m.restoreFreeingPid(1, func(int, int) string { return proctree.NoHolder }, func() (*durable.RestoreStats, error) {
			if calls++; calls < 3 {
				return nil, taken
			}
			return &durable.RestoreStats{HostPid: 42}, nil
		})
		if err != nil || rs == nil || rs.HostPid != 42 || calls != 3 {
			t.Fatalf("rs %+v, err %v after %d calls: want the third call's success", rs, err, calls)
		}
	})
	t.Run("held", func(t *testing.T) {
		calls := 0
		_, err := m.restoreFreeingPid(1, func(_, pid int) string { return "task 17 of process 17 (sleep)" }, func() (*durable.RestoreStats, error) {
			calls++
			return nil, taken
		})
		if calls != 1 || err == nil || !strings.Contains(err.Error(), "held by task 17 of process 17 (sleep)") || !errors.As(err, new(*durable.PidTakenError)) {
			t.Fatalf("%d calls, err %v: want one call and the holder named", calls, err)
		}
	})
	t.Run("never freed", func(t *testing.T) {
		calls := 0
		_, err := m.restoreFreeingPid(1, func(int, int) string { return proctree.NoHolder }, func() (*durable.RestoreStats, error) {
			calls++
			return nil, taken
		})
		if calls != pidRetries+1 || err == nil {
			t.Fatalf("%d calls, err %v: want %d calls and the error", calls, err, pidRetries+1)
		}
	})
	t.Run("other error", func(t *testing.T) {
		calls := 0
		other := errors.New("criu restore failed (errno 2)")
		_, err := m.restoreFreeingPid(1, func(int, int) string { return proctree.NoHolder }, func() (*durable.RestoreStats, error) {
			calls++
			return nil, other
		})
		if calls != 1 || !errors.Is(err, other) {
			t.Fatalf("%d calls, err %v: want the error at once", calls, err)
		}
	})
}
