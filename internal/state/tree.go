package state

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sort"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/errdefs"
	"deltabox/internal/fastpath"
	"deltabox/internal/overlay"
	"deltabox/internal/sandbox"
	"deltabox/internal/store"
)

// NodeInfo is what the API shows of a node.
type NodeInfo struct {
	store.Node
	Durable   bool     `json:"durable"`             // its index record is on disk
	Children  []string `json:"children,omitempty"`  // sorted by creation
	Sandboxes []string `json:"sandboxes,omitempty"` // sandboxes standing on it
	Depth     int      `json:"depth"`               // layers in its stack (image excluded)
	// Templates: the node's process templates and their memory (GET /v1/tree and
	// /v1/nodes/ID only; not in checkpoint and restore answers).
	Templates *TemplateInfo `json:"templates,omitempty"`
}

// OpResult reports one checkpoint or restore.
type OpResult struct {
	Node       *NodeInfo `json:"node"`
	Sandbox    string    `json:"sandbox"`
	Killed     int       `json:"killed_processes"` // processes ended (no process state yet)
	Mounted    bool      `json:"mounted"`          // false: nothing changed, no new mount
	DurationMS float64   `json:"duration_ms"`      // time inside the daemon
	// Processes is how many session processes were checkpointed (templates forked) or
	// restored from templates; ProcessErrors says which could not be (they were ended).
	Processes     int      `json:"processes"`
	ProcessErrors []string `json:"process_errors,omitempty"`
	// Warm: the restore installed a state of the node mounted ahead of time (warm.go).
	Warm bool `json:"warm,omitempty"`
	// Prepared: the checkpoint used the next state mounted ahead of time.
	Prepared bool `json:"prepared,omitempty"`
	// PhasesUS is the time of each step in microseconds, to see where latency goes.
	PhasesUS map[string]int64 `json:"phases_us,omitempty"`
}

// phase records the time since *t under name and resets *t.
func (r *OpResult) phase(name string, t *time.Time) {
	now := time.Now()
	if r.PhasesUS == nil {
		r.PhasesUS = map[string]int64{}
	}
	r.PhasesUS[name] += now.Sub(*t).Microseconds()
	*t = now
}

func (m *Manager) newNodeID() string {
	for {
		id := randomID("n")[:7]
		if _, ok := m.nodes[id]; !ok {
			if _, ok := m.sandboxes[id]; !ok {
				return id
			}
		}
	}
}

// beginOp locks s for a checkpoint or restore and refuses while an exec runs.
// On success the caller holds s.opMu and treeMu (shared) and must call the returned func.
func (m *Manager) beginOp(id, what string) (*sb, func(), error) {
	s, err := m.get(id)
	if err != nil {
		return nil, nil, err
	}
	if err := m.lockLive(s); err != nil {
		return nil, nil, err
	}
	s.mu.Lock()
	busy := s.execs
	s.mu.Unlock()
	if busy > 0 {
		s.opMu.Unlock()
		return nil, nil, fmt.Errorf("sandbox %s is running %d command(s); %s after they finish (or time out): %w", id, busy, what, errdefs.ErrConflict)
	}
	// A warm-up of restored processes (procwarm.go) lets go of its process first.
	m.stopProcWarm(s)
	end := s.bg.begin()
	m.treeMu.RLock()
	return s, func() { m.treeMu.RUnlock(); s.opMu.Unlock(); end() }, nil
}

// killAll ends every process but init and keep (sandbox PIDs: live sessions being
// checkpointed, templates); it skips the round trip to init (and init's walk of /proc)
// when the cgroup holds only keepHost (host PIDs of the same processes, and init's; nil:
// always ask init). (Counting is not enough: keep may name templates that died.)
func killAll(s *sb, keep []int, keepHost map[int]bool) (int, error) {
	if keepHost != nil && onlyKept(s, keepHost) {
		return 0, nil
	}
	n, err := s.rt.KillAll(keep...)
	if err != nil {
		return 0, fmt.Errorf("end the sandbox's processes: %w", err)
	}
	return n, nil
}

// onlyKept reports whether every process in s's cgroup is in keep (host PIDs).
func onlyKept(s *sb, keep map[int]bool) bool {
	pids, err := s.rt.Pids()
	if err != nil {
		return false
	}
	for _, p := range pids {
		if !keep[p] {
			return false
		}
	}
	return true
}

// upperUnchanged reports whether upper holds no change relative to top, the root
// directory of the layer under it: no entries, and the same root mode and owner
// (a chmod of / changes only the upper's root directory).
func upperUnchanged(upper, top string) bool {
	empty, err := store.IsEmptyDir(upper)
	if err != nil || !empty {
		return false
	}
	var a, b syscall.Stat_t
	if syscall.Stat(upper, &a) != nil || syscall.Stat(top, &b) != nil {
		return false
	}
	return a.Mode == b.Mode && a.Uid == b.Uid && a.Gid == b.Gid
}

// freshUpper allocates an empty upper whose root directory has the mode and owner of
// top (overlayfs takes the root's attributes from the upper).
func (m *Manager) freshUpper(top string) (uint64, error) {
	var id uint64
	select {
	case id = <-m.uppers:
	default:
		var err error
		if id, err = m.newLayer(); err != nil {
			return 0, err
		}
	}
	var st syscall.Stat_t
	if err := syscall.Stat(top, &st); err == nil && (st.Mode&0o7777 != 0o755 || st.Uid != 0 || st.Gid != 0) {
		d := m.st.LayerDiff(id)
		os.Chmod(d, os.FileMode(st.Mode&0o7777))
		os.Chown(d, int(st.Uid), int(st.Gid))
	}
	return id, nil
}

// fillUppers keeps a few empty layers ready (mkdir of diff and work: ~100 us off the
// critical path). Ready layers are in no record, so a restart sweeps them.
func (m *Manager) fillUppers() {
	for {
		id, err := m.newLayer()
		if err != nil {
			m.log.Error("prepare an upper layer", "err", err)
			select {
			case <-m.stop:
				return
			case <-time.After(time.Second):
			}
			continue
		}
		select {
		case m.uppers <- id:
		case <-m.stop:
			store.RemoveAll(m.st.LayerDir(id))
			return
		}
	}
}

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

// setState mounts spec for s and records how long the overlay and the namespace took.
func (m *Manager) setState(s *sb, res *OpResult, spec overlay.Spec) error {
	ovl, ns, err := s.rt.SetStateTimed(spec)
	if res.PhasesUS == nil {
		res.PhasesUS = map[string]int64{}
	}
	res.PhasesUS["overlay"] = ovl.Microseconds()
	res.PhasesUS["namespace"] = ns.Microseconds()
	return err
}

// measure fills in a node's layer size, off the critical path.
func (m *Manager) measure(id, dir string) {
	b := store.DirBytes(dir)
	m.mu.Lock()
	defer m.mu.Unlock()
	n, ok := m.nodes[id]
	if !ok {
		return
	}
	n.Bytes = b
	cp := n.Node
	n.seq = m.st.Index.Apply(store.Op{PutNode: &cp, MetaOnly: true})
}

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

// matchRoot gives upper's root directory the mode and owner of top's.
func matchRoot(upper, top string) {
	var a, b syscall.Stat_t
	if syscall.Stat(upper, &a) != nil || syscall.Stat(top, &b) != nil {
		return
	}
	if a.Mode&0o7777 != b.Mode&0o7777 {
		os.Chmod(upper, os.FileMode(b.Mode&0o7777))
	}
	if a.Uid != b.Uid || a.Gid != b.Gid {
		os.Chown(upper, int(b.Uid), int(b.Gid))
	}
}

// ---- tree ----

// nodeInfo describes one node. It is on every checkpoint's and restore's answer, so it
// looks only for that node's children and sandboxes instead of indexing the whole tree
// (Tree does that once for all nodes).
func (m *Manager) nodeInfo(id string) *NodeInfo {
	m.mu.Lock()
	defer m.mu.Unlock()
	ch, st := map[string][]string{}, map[string][]string{}
	for _, n := range m.nodes {
		if n.Parent == id {
			ch[id] = append(ch[id], n.ID)
		}
	}
	c := ch[id]
	sort.Slice(c, func(i, j int) bool { return m.nodes[c[i]].Created.Before(m.nodes[c[j]].Created) })
	for _, s := range m.sandboxes {
		if s.rec.Head == id {
			st[id] = append(st[id], s.rec.ID)
		}
	}
	sort.Strings(st[id])
	return m.nodeInfoLocked(id, ch, st)
}

// childIndex maps node id to its children. Precondition: mu held.
func (m *Manager) childIndex() map[string][]string {
	ch := map[string][]string{}
	for _, n := range m.nodes {
		ch[n.Parent] = append(ch[n.Parent], n.ID)
	}
	for k := range ch {
		c := ch[k]
		sort.Slice(c, func(i, j int) bool { return m.nodes[c[i]].Created.Before(m.nodes[c[j]].Created) })
	}
	return ch
}

// standing maps node id to the sandboxes on it. Precondition: mu held.
func (m *Manager) standing() map[string][]string {
	st := map[string][]string{}
	for _, s := range m.sandboxes {
		st[s.rec.Head] = append(st[s.rec.Head], s.rec.ID)
	}
	for _, v := range st {
		sort.Strings(v)
	}
	return st
}

func (m *Manager) nodeInfoLocked(id string, ch, st map[string][]string) *NodeInfo {
	n := m.nodes[id]
	if n == nil {
		return nil
	}
	return &NodeInfo{
		Node:      n.Node,
		Durable:   m.st.Index.Durable(n.seq),
		Children:  ch[id],
		Sandboxes: st[id],
		Depth:     len(m.stack(id)),
	}
}

// Tree is the whole snapshot tree.
type Tree struct {
	Nodes []*NodeInfo `json:"nodes"` // sorted by creation time
	// Roots are nodes directly on an image; OnImage lists sandboxes that stand on
	// their image with no node yet, per image.
	Roots   []string            `json:"roots"`
	OnImage map[string][]string `json:"on_image,omitempty"`
	// Templates totals every process template of the daemon and its memory.
	Templates *TemplateInfo `json:"templates"`
}

// Tree returns every node.
func (m *Manager) Tree() *Tree {
	perNode, _, total := m.templateCosts(nil, "", 0)
	m.mu.Lock()
	defer m.mu.Unlock()
	ch, st := m.childIndex(), m.standing()
	t := &Tree{Roots: ch[""], OnImage: map[string][]string{}, Templates: total}
	for id := range m.nodes {
		in := m.nodeInfoLocked(id, ch, st)
		in.Templates = perNode[id]
		t.Nodes = append(t.Nodes, in)
	}
	sort.Slice(t.Nodes, func(i, j int) bool { return t.Nodes[i].Created.Before(t.Nodes[j].Created) })
	for _, s := range m.sandboxes {
		if s.rec.Head == "" {
			t.OnImage[s.rec.Image] = append(t.OnImage[s.rec.Image], s.rec.ID)
		}
	}
	return t
}

// Node returns one node.
func (m *Manager) Node(id string) (*NodeInfo, error) {
	if n := m.nodeInfo(id); n != nil {
		perNode, _, _ := m.templateCosts([]string{id}, "", 0)
		n.Templates = perNode[id]
		return n, nil
	}
	return nil, fmt.Errorf("no node %q (deltabox tree lists them): %w", id, errdefs.ErrNotFound)
}

// RemoveNode removes node id and its whole subtree, refusing if a sandbox stands on
// any node of it. Layers owned by the removed nodes are deleted after the index
// stops naming them.
func (m *Manager) RemoveNode(id string) ([]string, error) {
	m.treeMu.Lock()
	defer m.treeMu.Unlock()
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.nodes[id]; !ok {
		return nil, fmt.Errorf("no node %q (deltabox tree lists them): %w", id, errdefs.ErrNotFound)
	}
	ch, st := m.childIndex(), m.standing()
	var sub []string
	var walk func(string)
	walk = func(n string) {
		sub = append(sub, n)
		for _, c := range ch[n] {
			walk(c)
		}
	}
	walk(id)
	for _, n := range sub {
		if sbs := st[n]; len(sbs) > 0 {
			where := "on it"
			if n != id {
				where = "on " + n + ", in its subtree"
			}
			return nil, fmt.Errorf("node %s cannot be removed: sandbox %s stands %s; restore that sandbox to another node or remove it first: %w", id, sbs[0], where, errdefs.ErrConflict)
		}
	}
	// Warm states of these nodes mount their layers: release them before the layers go
	// (marked first, so that none is made meanwhile; prepMu is not taken under mu).
	for _, n := range sub {
		m.nodes[n].removing = true
	}
	m.mu.Unlock()
	m.dropWarmNodes(sub)
	m.mu.Lock()
	var ops []store.Op
	var dirs []string
	m.dropTemplatesLocked(sub)
	for _, n := range sub {
		if m.nodes[n].Own {
			dirs = append(dirs, m.st.LayerDir(m.nodes[n].Layer))
		}
		delete(m.nodes, n)
		ops = append(ops, store.Op{DeleteNode: n})
	}
	ops = append(ops, store.Op{After: func() {
		for _, d := range dirs {
			store.RemoveAll(d)
		}
	}})
	m.st.Index.Apply(ops...)
	return sub, nil
}

// Sync waits until everything done so far is durable.
func (m *Manager) Sync() error { return m.st.Index.WaitDurable(m.st.Index.Seq()) }

// Images lists the store's images.
func (m *Manager) Images() ([]store.Image, error) { return m.st.Images() }
