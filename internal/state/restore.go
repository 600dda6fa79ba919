package state

import (
	"context"
	"fmt"
	"time"

	"deltabox/internal/errdefs"
	"deltabox/internal/sandbox"
	"deltabox/internal/store"

	"golang.org/x/sys/unix"
)

// Restore puts the sandbox on node's files and, when this sandbox made the node while
// sessions ran, brings back their processes from the node's templates (same PIDs, same
// terminals), as atomically as the PID constraint allows.
//
// Steps (FailStep numbers):
//  1. check the node's templates and seize them (a gone one refuses with 409), find or
//     make each one's session and terminal;
//  2. take an upper (a warm state of the node, or a fresh one);
//  3. mount the node's stack, without installing it;
//  4. end the sandbox's processes, templates excepted (each session process first hands
//     its memory to a holder, endLive, so that its exit is quick);
//  5. install the node's state;
//  6. fork each template into its session's PID, on that state (the injected failure
//     comes after the first); the new processes stay stopped;
//  7. publish: the processes resume, the sandbox's record changes.
//
// A failure at steps 1-4 (the injected one comes before the kill) leaves the sandbox
// exactly as it was: nothing irreversible happened, every check and every mount was done
// before the kill. If the kill itself fails once the session processes are ended, the
// restore fails as at steps 5-7.
//
// From step 4 on the live processes are gone, and they cannot be brought back: clone3
// set_tid needs each live PID free before its replacement can be forked, so a live
// process can be neither kept aside (stopped, with its PID) while the replacement is
// tried, nor restarted as it was. A failure at steps 5-7 kills what was forked, reinstalls the old state (files
// exactly as they were: the old upper is untouched until publish) and ends the sessions
// whose processes the kill took: their next call starts them afresh
// (session_restarted), and the error says so. Doing better would take a snapshot fork
// of every live process before the kill, a clone3 per session on every restore, which
// these failures (resource exhaustion, a template killed in the microseconds between its
// seizure and its fork) do not justify.
func (m *Manager) Restore(ctx context.Context, id, nodeID string) (_ *OpResult, err error) {
	t0 := time.Now()
	s, unlock, err := m.beginOp(id, "restore")
	if err != nil {
		return nil, err
	}
	defer unlock()
	m.mu.Lock()
	n, ok := m.nodes[nodeID]
	var image string
	if ok {
		image = n.Image
	}
	m.mu.Unlock()
	if !ok {
		return nil, fmt.Errorf("no node %q (deltabox tree lists them): %w", nodeID, errdefs.ErrNotFound)
	}
	var refused string
	defer func() {
		if err != nil {
			m.countFailed(s, "restore", refused)
		}
	}()
	res := &OpResult{Sandbox: id}
	tp := t0
	if err := m.fail("restore", 1); err != nil {
		return nil, err
	}
	// The node's process templates, if this sandbox made them; a gone one refuses the
	// restore before anything changes. tmplMu keeps background parking off them (taken
	// first: a template parking lets go is briefly not seen stopped).
	s.tmplMu.Lock()
	defer s.tmplMu.Unlock()
	tps, err := m.templatesFor(s, nodeID)
	if err != nil {
		refused = "template_gone"
		return nil, err
	}
	rvs, err := m.prepareRevivals(s, tps)
	if err != nil {
		return nil, err
	}
	res.phase("templates", &tp)
	dropNew := func() {}
	abort := func(err error) (*OpResult, error) {
		dropNew()
		m.abortRevivals(s, rvs)
		return nil, err
	}
	oldSpec, err := m.spec(s.rec.Image, s.rec.Head, s.rec.Upper)
	if err != nil {
		return abort(err)
	}
	oldUpper, newUpper := s.rec.Upper, s.rec.Upper
	newState := sandbox.None
	mount := !(s.rec.Head == nodeID && upperUnchanged(oldSpec.Upper, oldSpec.Lowers[0]))
	if mount {
		if err := m.fail("restore", 2); err != nil {
			return abort(err)
		}
		spec, err := m.spec(image, nodeID, 0)
		if err != nil {
			return abort(err)
		}
		// A warm state of the node (warm.go) replaces the mount.
		w := m.takeWarm(s, nodeID, spec.Lowers)
		if w != nil {
			newUpper, res.Warm = w.upper, true
			dropNew = func() { m.dropWarm(w) }
		} else if newUpper, err = m.freshUpper(spec.Lowers[0]); err != nil {
			return abort(err)
		} else {
			dropNew = func() { store.RemoveAll(m.st.LayerDir(newUpper)) }
		}
		spec.Upper, spec.Work = m.st.LayerDiff(newUpper), m.st.LayerWork(newUpper)
		res.phase("upper", &tp)
		if err := m.fail("restore", 3); err != nil {
			return abort(err)
		}
		if w != nil {
			newState = w.state
		} else {
			if newState, err = s.rt.BuildState(spec); err != nil {
				return abort(fmt.Errorf("restore: mount the node's state: %w", err))
			}
			st := newState
			dropNew = func() {
				st.Close()
				store.RemoveAll(m.st.LayerDir(newUpper))
			}
		}
		res.phase("mount", &tp)
	}
	if err := m.fail("restore", 4); err != nil {
		return abort(err)
	}
	// The upper is about to be discarded, and with it what was prepared on it; a new
	// preparation follows whatever happens.
	m.discardNext(s)
	defer m.prepareNext(s)
	// From endLive on, the live processes are gone: a failure ends their sessions.
	oldNS, installed := sandbox.None, false
	late := func(err error) (*OpResult, error) {
		if installed {
			s.rt.TakeState() // newState, which dropNew releases
			s.rt.PutState(oldNS)
		}
		abort(nil)
		m.endSessions(s, "ended: a restore to "+nodeID+" failed after its process was ended: "+err.Error())
		return nil, fmt.Errorf("restore to %s failed after the sandbox's processes were ended: %w; its files are as they were, and its sessions were ended (they start afresh on their next call)", nodeID, err)
	}
	keep, keepHost := m.keepPids(s, nil)
	holders, holderHosts, ended, endedHosts := m.endLive(s)
	res.phase("kill", &tp) // the session processes: seized, memory handed over, killed
	if len(holders) > 0 {
		keep = append(keep, holders...)
		// Not gated like afterAnswer's work: a holder left until the next operation
		// would be in that operation's way (the sandbox would hold more than its kept
		// processes, and init's kill-all would free the memory on its critical path).
		go func() {
			time.Sleep(holderDelay)
			for _, h := range holderHosts {
				unix.Kill(h, unix.SIGKILL) // init reaps it
			}
		}()
	}
	if len(ended) > 0 {
		// The processes endLive killed must be reaped before their PIDs are reused, and
		// init's exit messages for them must come before the revived processes' watchers
		// (same PIDs) are set: init answers after both. init reaps just them (no scan of
		// /proc: 0.1-0.2 ms); its kill-all runs only if the sandbox holds anything else.
		for _, h := range append(holderHosts, endedHosts...) {
			keepHost[h] = true
		}
		res.Killed = len(ended)
		if _, err := s.rt.Reap(ended...); err != nil {
			return late(fmt.Errorf("reap the sandbox's ended processes: %w", err))
		}
		// What else the sandbox runs (background jobs of execs) is killed after. (Reading
		// the cgroup while init reaps was tried: no difference in MCTS's reap phase.)
		if !onlyKept(s, keepHost) {
			n, err := killAll(s, keep, nil)
			if err != nil {
				return late(err)
			}
			res.Killed += n
		}
	} else if res.Killed, err = killAll(s, keep, keepHost); err != nil {
		return abort(err)
	}
	res.phase("reap", &tp) // init reaps them (and kills anything else)
	if err := m.fail("restore", 5); err != nil {
		return late(err)
	}
	if mount {
		oldNS = s.rt.TakeState()
		s.rt.PutState(newState)
		installed = true
	}
	failRevive := func() error { return m.fail("restore", 6) }
	if len(rvs) > 0 {
		nsPath, release, err := s.rt.StateNSPath()
		if err != nil {
			return late(err)
		}
		defer m.afterAnswer(s, release) // as at a checkpoint
		err = m.reviveAll(s, rvs, nsPath, failRevive)
		if err != nil {
			return late(err)
		}
	} else if err := failRevive(); err != nil {
		return late(err)
	}
	res.phase("processes", &tp)
	if err := m.fail("restore", 7); err != nil {
		return late(err)
	}
	// Publish.
	res.ProcessErrors = m.commitRevivals(s, rvs)
	res.Processes = len(rvs) - len(res.ProcessErrors)
	m.endSessionsExcept(s, tps, "ended by a restore to "+nodeID+", where it had no process state")
	m.mu.Lock()
	s.rec.Head, s.rec.Image, s.rec.Upper = nodeID, image, newUpper
	s.seq = m.st.Index.Apply(store.Op{PutSandbox: &s.rec})
	m.mu.Unlock()
	if newUpper != oldUpper {
		dir := m.st.LayerDir(oldUpper)
		m.afterAnswer(s, func() {
			oldNS.Close()
			// Queued after the record that stops naming the old upper.
			m.st.Index.Apply(store.Op{After: func() { store.RemoveAll(dir) }})
		})
	}
	switch {
	case res.Processes > 0:
		m.countPath(s, "restore", pathProcess)
	case !fastPathOn():
		m.countPath(s, "restore", pathFastPathOff)
	case m.nodeHasTemplatesElsewhere(s, nodeID):
		m.countPath(s, "restore", pathOtherSandbox)
	default:
		m.countPath(s, "restore", pathNoTemplates)
	}
	m.warmNode(s, nodeID) // for the next restore to this node
	m.startProcWarm(s, rvs)
	res.phase("publish", &tp)
	res.Node = m.nodeInfo(nodeID)
	res.DurationMS = float64(time.Since(t0).Microseconds()) / 1000
	return res, nil
}
