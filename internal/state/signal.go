package state

import (
	"fmt"

	"golang.org/x/sys/unix"

	"deltabox/internal/errdefs"
)

// Signal sends sig to process pid of sandbox id (a PID in the sandbox) through its
// init, which no command's Landlock domain confines: the one way to signal a process
// that a command other than the caller's started (package landlock says why a command
// cannot). sig 0 means SIGTERM. Init itself (pid 1) is refused; a PID that is gone is
// not an error (init ignores ESRCH), as the process may have exited meanwhile.
// It waits for any checkpoint or restore in progress, which may be moving the process.
func (m *Manager) Signal(id string, pid, sig int) (int, error) {
	if sig == 0 {
		sig = int(unix.SIGTERM)
	}
	if pid <= 1 {
		return 0, fmt.Errorf("signal: pid %d is not a process of the sandbox's commands (ps in the sandbox lists them; 1 is its init): %w", pid, errdefs.ErrInvalid)
	}
	if sig < 1 || sig > 64 {
		return 0, fmt.Errorf("signal: %d is not a signal number (1-64; kill -l lists them): %w", sig, errdefs.ErrInvalid)
	}
	s, err := m.get(id)
	if err != nil {
		return 0, err
	}
	s.opMu.Lock()
	defer s.opMu.Unlock()
	if err := m.checkLive(s); err != nil {
		return 0, err
	}
	if err := s.rt.Signal(pid, unix.Signal(sig), false); err != nil {
		return 0, fmt.Errorf("signal %d to pid %d in %s: %w", sig, pid, id, err)
	}
	return sig, nil
}
