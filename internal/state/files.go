package state

import (
	"context"
	"fmt"
	"strings"

	"golang.org/x/sys/unix"

	"deltabox/internal/errdefs"
)

// FileOp runs fn on sandbox id's current filesystem: root is an fd on the root of its
// overlay (for internal/files, which confines paths to it), valid until fn returns;
// workdir is the sandbox's working directory (relative paths start there). what names
// the operation ("files write /workspace/x") for a checkpoint's or restore's 409.
//
// A file operation counts as a running call: the sandbox cannot switch state while fn
// runs (a checkpoint or restore answers 409, or waits for it: op.go, admission), so fn
// works on the state it started on. File operations may run in parallel with each other
// and with execs.
func (m *Manager) FileOp(ctx context.Context, id, what string, fn func(root int, workdir string) error) error {
	s, err := m.get(id)
	if err != nil {
		return err
	}
	// Over its disk quota, a sandbox's files may be read and deleted, not written.
	if strings.HasPrefix(what, "files write ") || strings.HasPrefix(what, "files mkdir ") {
		if err := m.diskRefusal(s); err != nil {
			return err
		}
	}
	c, err := m.enterCall(ctx, s, what)
	if err != nil {
		return err
	}
	defer c.end()
	workdir, rt := s.rec.Workdir, s.rt // +checklocksignore: opMu held since enterCall; rt read under opMu: a remove may clear s.rt once it is let go
	root, err := rt.RootFD()
	if err != nil {
		s.opMu.Unlock() // +checklocksignore: opMu held since enterCall
		return fmt.Errorf("%v: %w", err, errdefs.ErrConflict)
	}
	c.start()
	s.opMu.Unlock() // +checklocksignore: opMu held since enterCall
	defer unix.Close(root)
	// As the sandbox's root: files made through its idmapped layers must belong to an
	// id of its user namespace.
	err = rt.AsRoot(func() error { return fn(root, workdir) })
	s.mu.Lock()
	over := s.disk.over != ""
	s.mu.Unlock()
	if over {
		m.diskFreed.Add(1) // it may have deleted files: the next refusal measures again
	}
	return err
}
