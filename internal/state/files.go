package state

import (
	"fmt"

	"golang.org/x/sys/unix"

	"deltabox/internal/errdefs"
)

// FileOp runs fn on sandbox id's current filesystem: root is an fd on the root of its
// overlay (for internal/files, which confines paths to it), valid until fn returns;
// workdir is the sandbox's working directory (relative paths start there).
//
// A file operation counts as a running command: the sandbox cannot switch state while
// fn runs (checkpoint and restore answer 409), so fn works on the state it started on.
// File operations may run in parallel with each other and with execs.
func (m *Manager) FileOp(id string, fn func(root int, workdir string) error) error {
	s, err := m.get(id)
	if err != nil {
		return err
	}
	if err := m.lockLive(s); err != nil {
		return err
	}
	workdir := s.rec.Workdir
	root, err := s.rt.RootFD()
	if err != nil {
		s.opMu.Unlock()
		return fmt.Errorf("%v: %w", err, errdefs.ErrConflict)
	}
	s.mu.Lock()
	s.execs++
	s.mu.Unlock()
	s.opMu.Unlock()
	defer func() {
		unix.Close(root)
		s.mu.Lock()
		s.execs--
		s.mu.Unlock()
	}()
	return fn(root, workdir)
}
