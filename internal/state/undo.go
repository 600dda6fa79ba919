package state

import (
	"errors"
	"strings"
)

// undoList is the undo of a checkpoint or restore in progress. Each step pushes what
// reverses it once it has succeeded (a step that does several things, one process after
// another, pushes after each), and a failure runs the list last-in-first-out: the steps
// are undone in the reverse of the order they were done, by construction, whichever step
// failed (gVisor's pkg/cleanup, e2b's Cleanup). A published operation releases the list.
//
// An undo function never stops the undo: it does what it can and returns what it could
// not put back, which run joins and the operation returns beside its own error and logs
// once (containerd's snapshotter: the undo's failure is the one a user most needs to see).
type undoList struct{ fns []func() error }

// push adds f, to run before everything pushed so far.
func (u *undoList) push(f func() error) { u.fns = append(u.fns, f) }

// run runs the list, last pushed first, empties it, and returns what failed, joined.
func (u *undoList) run() error {
	var errs []error
	for i := len(u.fns) - 1; i >= 0; i-- {
		if err := u.fns[i](); err != nil {
			errs = append(errs, err)
		}
	}
	u.fns = nil
	return errors.Join(errs...)
}

// release empties the list without running it: the operation is published.
func (u *undoList) release() { u.fns = nil }

// withUndo is a failed operation's error with what its undo could not put back: the
// operation's error stays the one errors.Is/As see (its class decides the status).
func withUndo(err, undoErr error) error {
	if undoErr == nil {
		return err
	}
	return &undoFailed{err: err, undo: undoErr}
}

type undoFailed struct{ err, undo error }

// Error is one line: errors.Join's newlines become "; " (an API answer's message).
func (e *undoFailed) Error() string {
	return e.err.Error() + "; undoing it: " + strings.ReplaceAll(e.undo.Error(), "\n", "; ")
}
func (e *undoFailed) Unwrap() error { return e.err }
