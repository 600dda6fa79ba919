package state

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/errdefs"
	"deltabox/internal/fastpath"
	"deltabox/internal/overlay"
	"deltabox/internal/sandbox"
	"deltabox/internal/store"
)

// restoreSteps are the steps of a restore, in order; step k (failStep's number) is
// restoreSteps[k-1]. Each pushes onto the operation's undo list what reverses it, once it
// has succeeded.
//
//  1. templates: check the node's templates and seize them (a gone one refuses with
//     409), find or make each one's session and terminal. Undo: park the templates as
//     they were, drop the sessions made (and kill what step 6 forked from them).
//  2. upper: take an upper (a warm state of the node, or a fresh one). Undo: drop it.
//  3. mount: mount the node's stack, without installing it. Undo: unmount it.
//  4. kill: end the sandbox's processes, templates excepted (each session process first
//     hands its memory to a holder, endLive, so that its exit is quick), and have init
//     reap them. Undo: end the sessions whose processes it killed (see below).
//  5. install: the node's state becomes the sandbox's. Undo: reinstall the old one.
//  6. revive: fork each template into its session's PID, on that state (the injected
//     failure comes after the first); the new processes stay stopped. Then the
//     sessions the node lacks end, and its CRIU trees are restored. Undone by step 1's
//     undo.
//  7. publish: the sandbox's kernel state becomes the node's (kernelstate.go: no IPC
//     object, the node's host and domain names), the processes resume, the sandbox's
//     record changes, the undo list is released.
//
// Steps 2 and 3 do nothing when the sandbox already stands, unchanged, on the node.
//
// A failure at steps 1-4 (the injected one comes before the kill) leaves the sandbox
// exactly as it was: nothing irreversible happened, every check and every mount was done
// before the kill. If the kill itself fails once the session processes are ended, the
// restore fails as at steps 5-7.
//
// From step 4 on the live processes are gone, and they cannot be brought back: clone3
// set_tid needs each live PID free before its replacement can be forked, so a live
// process can be neither kept aside (stopped, with its PID) while the replacement is
// tried, nor restarted as it was. A failure at steps 5-7 kills what was forked,
// reinstalls the old state (files exactly as they were: the old upper is untouched until
// publish) and ends the sessions whose processes the kill took: their next call starts
// them afresh (session_restarted), and the error says so. Doing better would take a
// snapshot fork of every live process before the kill, a clone3 per session on every
// restore, which these failures (resource exhaustion, a template killed in the
// microseconds between its seizure and its fork) do not justify.
var restoreSteps = []step[*restore]{
	{"templates", (*restore).templates, false},
	{"upper", (*restore).upper, false},
	{"mount", (*restore).mount, false},
	{"reap", (*restore).kill, false},
	{"install", (*restore).install, false},
	{"processes", (*restore).revive, true},
	{"publish", (*restore).publish, false},
}

// restore is one restore in progress: what its steps share. Only the goroutine running
// Restore touches it, with s.opMu and m.treeMu (shared) held.
type restore struct {
	m      *Manager
	s      *sb
	nodeID string
	image  string
	lazy   string // RestoreOptions.LazyImage
	res    *OpResult
	undo   undoList
	inject func() error // step 6's fault-injection point
	after  []func()     // work for after the answer, queued when the restore ends

	refused    string  // why a refusal was one (counted)
	tmplLocked bool    // step 1 holds s.tmplMu
	fam        *family // step 1: the node's templates are this family's holder's; its mu held
	tps        []*procTemplate
	rvs        []*revival
	criu       *criuTrees // step 1: the node's CRIU trees, restored at step 6

	oldUpper, newUpper uint64
	remount            bool          // steps 2-3 mount a new state
	spec               overlay.Spec  // step 2: the node's stack on the new upper
	w                  *warmState    // step 2: the warm state used, if any
	newState           sandbox.State // step 3
	oldNS              sandbox.State // step 5: the namespace the sandbox leaves
	discarded          bool          // step 4 dropped the prepared next state
	late               bool          // step 4 ended live processes: a failure ends sessions
	failure            error         // the step's error, for the undo's messages
	ended              []string      // step 6: the sessions the node lacks, ended before its CRIU trees
}

// RestoreOptions are a restore's options.
type RestoreOptions struct {
	Node string
	// Wait: queue behind the calls running or queued when the restore arrives, for this
	// long at most (CheckpointOptions.Wait).
	Wait time.Duration
	// LazyImage: "always" or "never" overrides Config.LazyRestoreMinBytes for a restore
	// from the node's image (lazy.go); "" leaves it.
	LazyImage string
}

// Restore is RestoreWith the node and no other option.
func (m *Manager) Restore(ctx context.Context, id, nodeID string) (*OpResult, error) {
	return m.RestoreWith(ctx, id, RestoreOptions{Node: nodeID})
}

// RestoreWith puts the sandbox on node's files and, when this sandbox made the node
// while processes ran, brings them back from the node's templates (same PIDs, same
// terminals), as atomically as the PID constraint allows. The steps are restoreSteps.
// The answer reports the sandbox's memory after it (reportMemory).
func (m *Manager) RestoreWith(ctx context.Context, id string, o RestoreOptions) (*OpResult, error) {
	if err := m.awaitNode(ctx, o.Node); err != nil { // a node answered early (answer.go)
		return nil, err
	}
	res, err := m.restoreLocked(ctx, id, o)
	if err != nil {
		return nil, err
	}
	m.reportMemory(res, id, "")
	if s, err := m.get(id); err == nil {
		s.mu.Lock()
		s.disk = diskState{} // a new upper: under any quota until measured
		s.mu.Unlock()
		m.afterOpMeasure(s)
	}
	m.mu.Lock()
	if n := m.nodes[o.Node]; n != nil {
		n.lastRestore = time.Now() // eviction's order (budget.go)
	}
	m.mu.Unlock()
	if w := m.st.Warning(); w != "" {
		res.Warnings = append(res.Warnings, w)
	}
	return res, nil
}

func (m *Manager) restoreLocked(ctx context.Context, id string, o RestoreOptions) (_ *OpResult, err error) {
	t0 := time.Now()
	nodeID := o.Node
	s, unlock, waited, err := m.beginOp(ctx, id, "restore", o.Wait)
	if err != nil {
		return nil, err
	}
	defer unlock()
	t0 = t0.Add(waited)
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
	r := &restore{m: m, s: s, nodeID: nodeID, image: image, lazy: o.LazyImage, res: &OpResult{Sandbox: id, WaitedMS: ms(waited)}}
	defer func() {
		if err != nil {
			m.countFailed(s, "restore", r.refused)
		}
	}()
	defer func() {
		if r.discarded { // a new preparation follows whatever happened
			m.prepareNext(s) // +checklocksignore: opMu held since beginOp
		}
		if r.tmplLocked {
			s.tmplMu.Unlock() // +checklocksignore: templates (step 1) took it: r.tmplLocked
		}
		if r.fam != nil {
			r.fam.release() // templates (step 1) took it: r.fam
		}
		for _, f := range r.after { // before unlock: the gate holds them until then
			m.afterAnswer(s, f)
		}
	}()
	// A spare first (a look at s's few), then the templates it must not hold, a walk of
	// every node's: a restore with no spare of its node pays for no walk.
	if m.hasSpare(s, nodeID) && !m.hasOwnTemplates(s) { // they live in the namespace a swap ends
		if sp := m.takeSpare(s, nodeID); sp != nil {
			err := m.restoreFromSpare(r, sp, t0) // +checklocksignore: opMu held since beginOp
			if err == nil {
				return r.finish(t0), nil // +checklocksignore: as above
			}
			if !errors.Is(err, errSpareUnusable) {
				return nil, err
			}
		}
	}
	if err := runSteps(m, "restore", restoreSteps, r, &r.inject, r.res, t0); err != nil {
		r.failure = err
		if uerr := r.undo.run(); uerr != nil {
			m.log.Error("restore failed, and its undo could not put everything back", "sandbox", id, "node", nodeID, "err", err, "undo", uerr)
			err = withUndo(err, uerr)
		}
		if r.late {
			return nil, fmt.Errorf("restore to %s failed after the sandbox's processes were ended: %w; its files are as they were, and its sessions were ended (they start afresh on their next call)", nodeID, err)
		}
		return nil, err
	}
	return r.finish(t0), nil // +checklocksignore: opMu held since beginOp
}

// finish completes a restore's answer.
// +checklocks:r.s.opMu
func (r *restore) finish(t0 time.Time) *OpResult {
	r.res.Node = r.m.nodeInfo(r.nodeID)
	r.res.DurationMS = ms(time.Since(t0))
	r.res.Memory = r.m.memoryNow(r.s)
	return r.res
}

// templates is step 1: the node's process templates, if this sandbox made them; a gone
// one refuses the restore before anything changes.
// +checklocks:r.s.opMu
// +checklocksacquire:r.s.tmplMu
func (r *restore) templates() error {
	m, s := r.m, r.s
	// The common case first (the node's templates are here): one lock, then no more.
	if !m.hasTemplatesIn(s, r.nodeID) && m.fastPath(s) && m.hasImage(r.nodeID) && m.pidsKept(s, r.nodeID) {
		m.roomForImage(s, r.nodeID) // before tmplMu, which its eviction takes
	}
	// tmplMu keeps background parking off them (taken first: a template that parking
	// lets go is briefly not seen stopped). Held until Restore returns.
	s.tmplMu.Lock()
	r.tmplLocked = true
	tps, err := m.templatesFor(s, r.nodeID)
	if err == nil && len(tps) == 0 {
		// A node made before a fast fork: its templates are the family's holder's,
		// placed into this member's namespace (family.go).
		if ftps, fam, ferr := m.familyTemplates(s, r.nodeID); ferr != nil || len(ftps) > 0 {
			tps, err = ftps, ferr
			if fam != nil {
				fam.hold() // until Restore returns (r.fam), as tmplMu
				r.fam = fam
			}
		}
	}
	if (err != nil || len(tps) == 0) && m.fastPath(s) && m.hasProcessImage(r.nodeID) {
		// Evicted or lost: the node's durable image brings them back (durable.go).
		m.dropNodeTemplates(s, r.nodeID)
		itps, lazy, ierr := m.restoreImage(s, r.nodeID, r.lazy)
		switch {
		case ierr != nil:
			err = ierr
		case len(itps) > 0:
			tps, err, r.res.FromImage = itps, nil, true
			r.res.LazyImage = lazy
			m.log.Info("restored a node's templates from its durable image", "sandbox", s.rec.ID, "node", r.nodeID, "processes", len(itps))
		}
	}
	if err != nil {
		r.refused = "template_gone"
		return err
	}
	// The node's CRIU trees (criutrees.go), read before anything changes.
	ts, err := m.criuTreesOf(r.nodeID)
	if err != nil {
		return err
	}
	if ts != nil {
		m.mu.Lock()
		maker := ""
		if n := m.nodes[r.nodeID]; n != nil {
			maker = n.Sandbox
		}
		m.mu.Unlock()
		ok, why := m.criuTreesUsable()
		switch {
		case !m.pidsKept(s, r.nodeID):
			r.res.Warnings = append(r.res.Warnings, fmt.Sprintf("node %s's %d processes that CRIU took come back only in sandbox %s, which made it (their PIDs are there)", r.nodeID, ts.count(), maker))
		case !m.fastPath(s):
		case !ok:
			r.res.Warnings = append(r.res.Warnings, fmt.Sprintf("node %s's %d processes that CRIU took cannot come back: %s", r.nodeID, ts.count(), why))
		default:
			if err := m.prepareTreeSessions(s, ts); err != nil {
				return err
			}
			ts.private = maker != s.rec.ID
			r.criu = ts
			r.undo.push(func() error { m.abortTreeSessions(ts); return nil })
		}
	}
	rvs, err := m.prepareRevivals(s, tps, r.fam)
	if err != nil {
		return err
	}
	r.tps, r.rvs = tps, rvs
	r.undo.push(func() error { return m.abortRevivals(s, rvs) }) // +checklocksignore: an undo step: undoList.run runs it under opMu
	return nil
}

// upper is step 2.
// +checklocks:r.s.opMu
func (r *restore) upper() error {
	m, s := r.m, r.s
	oldSpec, err := m.spec(s.rec.Image, s.rec.Head, s.rec.Upper)
	if err != nil {
		return err
	}
	r.oldUpper, r.newUpper = s.rec.Upper, s.rec.Upper
	r.remount = !(s.rec.Head == r.nodeID && upperUnchanged(oldSpec.Upper, oldSpec.Lowers[0]))
	if !r.remount {
		return nil
	}
	spec, err := m.spec(r.image, r.nodeID, 0)
	if err != nil {
		return err
	}
	r.spec = spec
	// A warm state of the node (warm.go) replaces the mount.
	if w := m.takeWarm(s, r.nodeID, spec.Lowers); w != nil {
		r.w, r.newUpper, r.res.Warm = w, w.upper, true
		r.undo.push(func() error { m.dropWarm(w); return nil })
		return nil
	}
	if r.newUpper, err = m.freshUpper(spec.Lowers[0]); err != nil {
		return err
	}
	dir := m.st.LayerDir(r.newUpper)
	r.undo.push(func() error { return store.RemoveAll(dir) })
	return nil
}

// mount is step 3.
// +checklocks:r.s.opMu
func (r *restore) mount() error {
	if !r.remount {
		return nil
	}
	if r.w != nil {
		r.newState = r.w.state
		return nil
	}
	m, s := r.m, r.s
	spec := r.spec
	spec.Upper, spec.Work = m.st.LayerDiff(r.newUpper), m.st.LayerWork(r.newUpper)
	var err error
	if r.newState, err = s.rt.BuildState(spec); err != nil {
		return fmt.Errorf("restore: mount the node's state: %w", err)
	}
	st := r.newState
	r.undo.push(func() error { st.Close(); return nil })
	return nil
}

// kill is step 4. From endLive on, the live processes are gone: a failure ends their
// sessions.
// +checklocks:r.s.opMu
func (r *restore) kill() error {
	m, s, res := r.m, r.s, r.res
	// The upper is about to be discarded, and with it what was prepared on it; a new
	// preparation follows whatever happens (Restore). (A preparation under way holds
	// prepMu until it ends: the wait is the discard phase.)
	tp := time.Now()
	m.discardNext(s)
	r.discarded = true
	phase(res, "discard", &tp)
	keep := m.keepPids(s, nil)
	holders, holderHosts, ended, _ := m.endLive(s)
	phase(res, "kill", &tp) // the session processes: seized, memory handed over, killed
	if len(holders) > 0 {
		keep = append(keep, holders...)
		// Not gated like afterAnswer's work: a holder left until the next operation
		// would be in that operation's way (the sandbox would hold more than its kept
		// processes, and init's kill-all would free the memory on its critical path).
		m.wg.Add(1)
		go func() {
			defer m.wg.Done()
			time.Sleep(holderDelay)
			for _, h := range holderHosts {
				_ = unix.Kill(h, unix.SIGKILL) // init reaps it
			}
		}()
	}
	if len(ended) == 0 {
		n, err := m.killAll(s, keep, false)
		if err != nil {
			return err
		}
		res.Killed = n
		r.goLate()
		return nil
	}
	r.goLate()
	// The processes endLive killed must be reaped before their PIDs are reused, and
	// init's exit messages for them must come before the revived processes' watchers
	// (same PIDs) are set: init answers after both. init reaps just them (no scan of
	// /proc: 0.1-0.2 ms); its kill-all runs only if the sandbox holds anything else.
	res.Killed = len(ended)
	if _, err := s.rt.Reap(ended...); err != nil {
		return fmt.Errorf("reap the sandbox's ended processes: %w", err)
	}
	phase(res, "reap_init", &tp) // init's answer once it reaped them
	// What else the sandbox runs (background jobs of execs) is killed after. (Reading
	// the cgroup while init reaps was tried: no difference in MCTS's reap phase.)
	n, err := m.killAll(s, keep, false)
	if err != nil {
		return err
	}
	phase(res, "killall", &tp)
	res.Killed += n
	return nil
}

// goLate marks the live processes ended: from here a failure ends the sessions, after
// everything else is undone.
// +checklocks:r.s.opMu
func (r *restore) goLate() {
	m, s := r.m, r.s
	r.late = true
	r.undo.push(func() error {
		m.endSessions(s, r.lateFailure())
		return nil
	})
}

// lateFailure is why a session ended when the restore failed after its kill.
func (r *restore) lateFailure() string {
	return fmt.Sprintf("ended: a restore to %s failed after its process was ended: %v", r.nodeID, r.failure)
}

// install is step 5.
// +checklocks:r.s.opMu
func (r *restore) install() error {
	if !r.remount {
		return nil
	}
	s := r.s
	r.oldNS = s.rt.TakeState()
	s.rt.PutState(r.newState)
	r.undo.push(func() error {
		s.rt.TakeState()       // +checklocksignore: an undo step: undoList.run runs it under opMu; newState, which step 3's undo releases
		s.rt.PutState(r.oldNS) // +checklocksignore: an undo step: undoList.run runs it under opMu
		return nil
	})
	return nil
}

// revive is step 6.
// +checklocks:r.s.opMu
func (r *restore) revive() error {
	m, s := r.m, r.s
	if len(r.rvs) == 0 {
		if err := r.inject(); err != nil {
			return err
		}
		return r.restoreCRIUTrees()
	}
	ns, err := s.rt.StateNS()
	if err != nil {
		return err
	}
	r.after = append(r.after, func() { unix.Close(ns) }) // as at a checkpoint
	var tg *fastpath.Target
	if r.fam != nil {
		t, closeTarget, err := s.rt.PlaceTarget(r.fam.rt)
		if err != nil {
			return err
		}
		r.after = append(r.after, closeTarget)
		tg = t
	}
	if err := m.reviveAll(s, r.rvs, ns, tg, r.inject); err != nil {
		return err
	}
	return r.restoreCRIUTrees()
}

// restoreCRIUTrees restores the node's CRIU trees onto the new state, stopped until the
// publish. Each on its own: a tree that cannot be restored (a PID another process took
// in a sandbox started afresh, an image CRIU refuses) is left out with a warning naming
// it, and its session, if it is one, ends; the files and the other processes are
// restored. Undo: they are ended.
// +checklocks:r.s.opMu
func (r *restore) restoreCRIUTrees() error {
	m, s, ts := r.m, r.s, r.criu
	if ts == nil {
		return nil
	}
	tc := time.Now()
	// The sessions the node lacks end first (publish would end them): a tree's own pty
	// comes back at its number (durable/dump.go: ExternalTTYs), which the terminal of
	// a session started since the checkpoint may hold, and the kernel frees a pty's
	// number only once every fd of its master is closed: the daemon's, and the copy
	// init keeps for the next daemon (keepSessions makes init close it). Their
	// processes are gone since step 4, and a failure from here ends every session.
	r.ended = m.endSessionsExcept(s, r.tps, ts, r.endedNoState())
	if len(r.ended) > 0 {
		m.keepSessions(s)
		names := r.ended
		r.undo.push(func() error {
			s.mu.Lock()
			defer s.mu.Unlock()
			for _, n := range names {
				s.ended[n] = r.lateFailure() // not ended by a restore that succeeded
			}
			return nil
		})
	}
	st, err := currentState(s.rt)
	if err != nil {
		return err
	}
	defer st.Close()
	// Trees with TCP connections are restored with those locked until they run
	// (publish: resume), so that a connection restored before its peer (in a tree
	// restored next) is not reset (durable/tcp.go).
	if ts.holdTCP() {
		r.undo.push(ts.unlockNet) // first: a lock that failed half way goes too
		if err := ts.lockNet(s); err != nil {
			return err
		}
	}
	r.undo.push(func() error { return m.endCRIUTrees(s, ts) }) // +checklocksignore: an undo step: undoList.run runs it under opMu
	var restored []*criuTree
	for _, t := range ts.trees {
		one := &criuTrees{dir: ts.dir, trees: []*criuTree{t}, private: ts.private}
		if err := m.restoreCRIUTrees(s, one, st); err != nil {
			what := fmt.Sprintf("process %d's tree", t.Pids[0])
			if t.Session != "" {
				what = "session " + t.Session + "'s tree"
			}
			r.res.Warnings = append(r.res.Warnings, fmt.Sprintf("node %s's %s could not be restored (processes not running: %d): %v", r.nodeID, what, len(t.Pids), err))
			m.log.Warn("restore: a CRIU tree could not be restored", "sandbox", s.rec.ID, "node", r.nodeID, "tree", what, "err", err)
			t.closePeer()
			if t.created {
				t.sess.Release()
			}
			t.sess, t.old, t.created, t.exit = nil, nil, false, nil
			continue
		}
		restored = append(restored, t)
	}
	ts.trees = restored
	phase(r.res, "criu_restore", &tc)
	return nil
}

// endedNoState is why a session the node lacks ends at its restore.
func (r *restore) endedNoState() string {
	return "ended by a restore to " + r.nodeID + ", where it had no process state"
}

// publish is step 7: from here nothing fails.
// +checklocks:r.s.opMu
func (r *restore) publish() error {
	m, s, res := r.m, r.s, r.res
	r.undo.release()
	// Before anything of the sandbox runs again; at publish, as the removal of IPC
	// objects cannot be undone (a failure at steps 5-7 leaves them as they were).
	m.resetKernelState(s, r.nodeID)
	var failed []string
	res.Sessions, failed, res.ProcessErrors = m.commitRevivals(s, r.rvs)
	res.Processes = len(r.rvs) - len(res.ProcessErrors)
	if r.criu != nil {
		res.Sessions = append(res.Sessions, m.commitTreeSessions(s, r.criu)...)
		slices.Sort(res.Sessions)
		if err := r.criu.resume(); err != nil {
			res.ProcessErrors = append(res.ProcessErrors, err.Error())
		}
		res.CRIUProcesses = r.criu.count()
	}
	ended := m.endSessionsExcept(s, r.tps, r.criu, r.endedNoState())
	res.SessionsEnded = append(append(failed, r.ended...), ended...)
	sort.Strings(res.SessionsEnded)
	m.mu.Lock()
	s.rec.Head, s.rec.Image, s.rec.Upper = r.nodeID, r.image, r.newUpper
	s.seq = m.st.Index.Apply(store.Op{PutSandbox: &s.rec})
	m.mu.Unlock()
	if r.newUpper != r.oldUpper {
		dir, oldNS := m.st.LayerDir(r.oldUpper), r.oldNS
		m.afterAnswer(s, func() {
			oldNS.Close()
			// Queued after the record that stops naming the old upper.
			m.st.Index.Apply(store.Op{After: func() { _ = store.RemoveAll(dir) }}) // an unused layer: the start-up sweep removes it
		})
	}
	switch {
	case res.Processes > 0 || res.CRIUProcesses > 0:
		m.countPath(s, "restore", pathProcess)
		s.mu.Lock()
		if res.FromImage {
			s.stats.RestorePaths.Image++
		}
		if res.CRIUProcesses > 0 {
			s.stats.RestorePaths.CRIU++
		}
		s.mu.Unlock()
	case !m.fastPath(s):
		p, _ := m.filesOnlyPath(s)
		m.countPath(s, "restore", p)
	case m.nodeHasTemplatesElsewhere(s, r.nodeID):
		m.countPath(s, "restore", pathOtherSandbox)
	default:
		m.countPath(s, "restore", pathNoTemplates)
	}
	m.warmNode(s, r.nodeID) // for the next restore to this node
	tps, node, fam := r.tps, r.nodeID, r.fam
	if fam == nil { // the holder's templates are its own tracer's, and its record's
		m.startProcWarm(s, r.rvs)
	} else {
		m.spareNext(s, node) // for its next restore (spares.go)
	}
	m.afterAnswer(s, func() {
		m.keepSessions(s)
		switch {
		case fam != nil:
			// The revive moved the holder's templates' counters: a next daemon's
			// Reattach checks them against the record (fastpath.Template.Record).
			m.recordTemplatesOf(fam.id, &fam.mu, node, tps)
		case len(tps) > 0:
			m.recordTemplates(s, node, tps)
		}
	})
	return nil
}
