package state

import (
	"context"
	"errors"
	"fmt"
	"time"

	"deltabox/internal/fastpath"
	"deltabox/internal/overlay"
	"deltabox/internal/sandbox"
	"deltabox/internal/store"
)

// CheckpointOptions are a checkpoint's options.
type CheckpointOptions struct {
	Label string
	// EndBackground ends the processes outside the sessions that cannot be checkpointed
	// with their state (a pipe, a socket, children...) instead of refusing the
	// checkpoint; the others are still checkpointed.
	EndBackground bool
}

// Checkpoint is CheckpointWith the label and no other option.
func (m *Manager) Checkpoint(ctx context.Context, id, label string) (*OpResult, error) {
	return m.CheckpointWith(ctx, id, CheckpointOptions{Label: label})
}

// CheckpointWith makes a node of the sandbox's files and processes, as one atomic step:
// it either completes or leaves the sandbox exactly as it was, with no node made.
//
// Steps (FailStep numbers; a failure at step k undoes steps 1..k-1 in reverse):
//  1. seize the sessions' processes, then every other process but init (holdOthers),
//     and check them while stopped (an ineligible one refuses the checkpoint with 409);
//     from here to step 8 they run none of their code;
//  2. fork each into its template, on the current state (nothing has moved yet);
//  3. end what was not seized (with EndBackground, the processes outside the sessions
//     that could not be; no node carries them, and every checkpoint that gets this far
//     ends them, whether it completes or not); nothing to do, and no read of the cgroup,
//     when step 1 saw every process seized, a template or a zombie (holdOthers);
//  4. take a fresh upper (the next state prepared ahead of time, if it fits);
//  5. freeze the upper (store.Freeze);
//  6. mount the new stack and install it;
//  7. move the live processes onto it (the injected failure comes after the first one
//     moved, so that a partial move is undone too);
//  8. publish: the node and its templates are recorded and the processes resume.
//
// Undo, in this order: processes moved back onto the old state with their own open file
// descriptions, namespace and cwd (fastpath.Held.MoveBack), templates killed; old
// namespace reinstalled, upper unfrozen; then the processes resume where they were.
func (m *Manager) CheckpointWith(ctx context.Context, id string, o CheckpointOptions) (_ *OpResult, err error) {
	label := o.Label
	t0 := time.Now()
	s, unlock, err := m.beginOp(id, "checkpoint")
	if err != nil {
		return nil, err
	}
	defer unlock()
	var refused string // why a refusal was one (counts)
	defer func() {
		if err != nil {
			m.countFailed(s, "checkpoint", refused)
		}
	}()
	res := &OpResult{Sandbox: id}
	tp := t0
	if err := m.fail("checkpoint", 1); err != nil {
		return nil, err
	}
	held, err := m.holdSessions(s)
	settled := false // nothing for step 3 to end (holdOthers)
	if err == nil {
		var others []*heldSession
		if others, settled, err = m.holdOthers(s, held, o.EndBackground); err != nil {
			m.abortHeld(held)
		}
		held = append(held, others...)
	}
	if err != nil {
		var in *fastpath.Ineligible
		if errors.As(err, &in) {
			refused = "ineligible"
		}
		return nil, err
	}
	res.phase("seize", &tp)
	// undoProcs undoes steps 1, 2 and 7 but leaves the processes seized; letGo resumes
	// them, once the files are back.
	undoProcs := func() {
		for _, e := range m.undoHeld(held) {
			m.log.Error("checkpoint undo: a session's process could not be put back and was killed", "sandbox", id, "err", e)
		}
	}
	letGo := func() {
		for _, e := range m.releaseHeld(held) {
			m.log.Error("checkpoint undo: resume a session's process", "sandbox", id, "err", e)
		}
	}
	undoFiles := func() {}
	abort := func(err error) (*OpResult, error) {
		undoProcs()
		undoFiles()
		letGo()
		// takeNext made earlier builds stale; the position is the old one again.
		m.prepareNext(s)
		return nil, err
	}
	if err := m.fail("checkpoint", 2); err != nil {
		return abort(err)
	}
	if err := m.forkHeld(held, id); err != nil {
		return abort(err)
	}
	res.phase("fork", &tp)
	if err := m.fail("checkpoint", 3); err != nil {
		return abort(err)
	}
	if !settled {
		keep, keepHost := m.keepPids(s, held)
		if res.Killed, err = killAll(s, keep, keepHost); err != nil {
			return abort(err)
		}
	}
	if !fastPathOn() {
		m.endSessions(s, "ended by a checkpoint (DELTABOX_FASTPATH=0: process state is not kept)")
	}
	res.phase("kill", &tp)
	oldSpec, err := m.spec(s.rec.Image, s.rec.Head, s.rec.Upper)
	if err != nil {
		return abort(err)
	}
	n := store.Node{Parent: s.rec.Head, Image: s.rec.Image, Created: time.Now().UTC(), Label: label, Sandbox: id}
	newUpper, oldNS := s.rec.Upper, sandbox.None
	if upperUnchanged(oldSpec.Upper, oldSpec.Lowers[0]) {
		// Nothing changed: the node shares its parent's top layer and the sandbox
		// keeps its mount, which already shows exactly this state.
		m.mu.Lock()
		if st := m.stack(s.rec.Head); len(st) > 0 {
			n.Layer = st[0]
		}
		m.mu.Unlock()
	} else {
		n.Layer, n.Own, n.Bytes = s.rec.Upper, true, -1
		// The next state, mounted ahead of time (prepare.go), if it fits.
		p := m.takeNext(s, oldSpec.Lowers)
		res.Prepared = p != nil
		if err := m.fail("checkpoint", 4); err != nil {
			if p != nil {
				m.putNext(s, p)
			}
			return abort(err)
		}
		if p != nil {
			newUpper = p.newUpper
			undoFiles = func() { m.putNext(s, p) }
		} else {
			if newUpper, err = m.freshUpper(oldSpec.Upper); err != nil {
				return abort(err)
			}
			undoFiles = func() { store.RemoveAll(m.st.LayerDir(newUpper)) }
		}
		res.phase("upper", &tp)
		err = m.fail("checkpoint", 5)
		if err == nil {
			err = m.st.Freeze(n.Layer)
		}
		if err != nil {
			return abort(err)
		}
		undoFiles = func() {
			if err := m.st.Unfreeze(n.Layer); err != nil {
				m.log.Error("undo freeze", "layer", n.Layer, "err", err)
			}
			if p != nil {
				m.discard(p, false) // its lower, frozen/, is gone with the unfreeze
			} else {
				store.RemoveAll(m.st.LayerDir(newUpper))
			}
		}
		res.phase("freeze", &tp)
		// The old namespace keeps the old overlay, whose upper is now the empty diff/
		// (not the frozen layer), until after the answer: see store.Freeze.
		oldNS = s.rt.TakeState()
		err = m.fail("checkpoint", 6)
		if err == nil {
			if p != nil {
				// The root's mode and owner may have changed since the preparation.
				matchRoot(m.st.LayerDiff(newUpper), m.st.LayerFrozen(n.Layer))
				s.rt.PutState(p.state)
			} else {
				err = m.setState(s, res, overlay.Spec{
					Lowers: append([]string{m.st.LayerFrozen(n.Layer)}, oldSpec.Lowers...),
					Upper:  m.st.LayerDiff(newUpper),
					Work:   m.st.LayerWork(newUpper),
				})
			}
		}
		if err != nil {
			s.rt.PutState(oldNS)
			return abort(fmt.Errorf("checkpoint: mount the new state: %w", err))
		}
		res.Mounted = true
		unfreeze := undoFiles
		undoFiles = func() {
			cur := s.rt.TakeState()
			if !res.Prepared {
				cur.Close() // the new stack goes before its lower is unfrozen
			} // else cur is p.state, which unfreeze releases
			s.rt.PutState(oldNS)
			unfreeze()
		}
		res.phase("mount", &tp)
	}
	// The live processes move onto the sandbox's current state (the new one, or the same
	// one when nothing changed: they still reopen their files, to share no open file
	// description with their templates).
	failMove := func() error { return m.fail("checkpoint", 7) }
	if len(held) > 0 {
		nsPath, release, err := s.rt.StateNSPath()
		if err != nil {
			return abort(err)
		}
		// init lets go of the namespace fd after the answer: a round trip to init
		// (0.2-0.3 ms) that nothing here waits for.
		defer m.afterAnswer(s, release)
		err = m.moveHeld(held, nsPath, failMove)
		if err != nil {
			return abort(err)
		}
	} else if err := failMove(); err != nil {
		return abort(err)
	}
	res.phase("move", &tp)
	if err := m.fail("checkpoint", 8); err != nil {
		return abort(err)
	}
	// Publish.
	var tps []*procTemplate
	for _, l := range held {
		tps = append(tps, l.pt)
	}
	for _, e := range m.releaseHeld(held) {
		res.ProcessErrors = append(res.ProcessErrors, e.Error())
	}
	res.Processes = len(tps)
	m.mu.Lock()
	n.ID = m.newNodeID()
	nd := &node{Node: n}
	m.nodes[n.ID] = nd
	if len(tps) > 0 {
		m.templates[n.ID] = tps
	}
	s.rec.Head, s.rec.Upper = n.ID, newUpper
	seq := m.st.Index.Apply(store.Op{PutNode: &n}, store.Op{PutSandbox: &s.rec})
	nd.seq, s.seq = seq, seq
	m.mu.Unlock()
	if n.Own {
		layer := n.Layer
		m.afterAnswer(s, func() {
			oldNS.Close()
			m.st.Index.Apply(store.Op{After: func() { m.st.DropUpperDirs(layer) }})
		})
		m.afterAnswer(s, func() { m.measure(n.ID, m.st.LayerFrozen(layer)) })
	}
	switch {
	case len(tps) > 0:
		m.countPath(s, "checkpoint", pathProcess)
	case !fastPathOn():
		m.countPath(s, "checkpoint", pathFastPathOff)
	default:
		m.countPath(s, "checkpoint", pathNoSessions)
	}
	m.prepareNext(s)
	m.warmNode(s, n.ID)
	m.parkTemplates(s, n.ID, tps)
	res.phase("publish", &tp)
	res.Node = m.nodeInfo(n.ID)
	res.DurationMS = float64(time.Since(t0).Microseconds()) / 1000
	return res, nil
}
