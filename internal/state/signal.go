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
// A template's PID is refused, and so is a template's copy waiting for its durable
// image: both sit in the sandbox's PID namespace (`ps` lists them, stopped), and a
// SIGKILL or SIGCONT sent through init, which Landlock does not confine, would end one
// or let it run, changing what its node restores.
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
	if what := m.heldPid(s, pid); what != "" {
		return 0, fmt.Errorf("signal: pid %d is not a command's process but %s, kept stopped by DeltaBox; a signal would change or end what the node restores (remove the node to end it): %w", pid, what, errdefs.ErrConflict)
	}
	if err := s.rt.Signal(pid, unix.Signal(sig), false); err != nil {
		return 0, fmt.Errorf("signal %d to pid %d in %s: %w", sig, pid, id, err)
	}
	return sig, nil
}

// heldPid says what process pid (a PID in s's namespace) is if DeltaBox holds it: a
// template of s at a node, or a template's copy made for the node's image; else "".
// Under s.opMu: a checkpoint registers its templates before it lets go of opMu, so
// none is being made meanwhile; one evicted or a copy dumped meanwhile is ended, and a
// signal to its PID finds nothing.
func (m *Manager) heldPid(s *sb, pid int) string {
	_, copies := m.sandboxCopies(s)
	for _, c := range copies {
		if c == pid {
			return "a template's copy being written to its node's durable image"
		}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for node, ts := range m.templates {
		for _, t := range ts {
			if t.sandbox == s.rec.ID && t.tmpl.SelfPid == pid {
				return "the template of " + t.what + " at node " + node
			}
		}
	}
	return ""
}
