package state

// undoList is the undo of a checkpoint or restore in progress. Each step pushes what
// reverses it once it has succeeded (a step that does several things, one process after
// another, pushes after each), and a failure runs the list last-in-first-out: the steps
// are undone in the reverse of the order they were done, by construction, whichever step
// failed (gVisor's pkg/cleanup, e2b's Cleanup). A published operation releases the list.
//
// An undo function must not fail the undo: it logs what it could not reverse and goes on
// (the operation's error is already on its way to the client).
type undoList struct{ fns []func() }

// push adds f, to run before everything pushed so far.
func (u *undoList) push(f func()) { u.fns = append(u.fns, f) }

// run runs the list, last pushed first, and empties it.
func (u *undoList) run() {
	for i := len(u.fns) - 1; i >= 0; i-- {
		u.fns[i]()
	}
	u.fns = nil
}

// release empties the list without running it: the operation is published.
func (u *undoList) release() { u.fns = nil }
