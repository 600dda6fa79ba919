package state

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sort"
	"sync"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/cgroup"
	"deltabox/internal/errdefs"
	"deltabox/internal/remote"
	"deltabox/internal/sandbox"
	"deltabox/internal/sbinit"
	"deltabox/internal/store"
)

// A fast fork (docs/design/fork.md) of a live sandbox src at node F:
//
//  1. branches: N sandboxes whose inits src's init makes in sibling namespaces
//     (startFastBranch, at once), each on F's files, F's templates placed into each
//     at their PIDs (place, one after the other: src's tracer holds them), then let run.
//  2. the source moves, last: its first runtime becomes the family's holder (its init,
//     PID 1 of P_S, and every template src made, moved into cgroups of their own so that
//     src's removal ends neither), its live processes are ended, and it gets a branch
//     runtime of its own (P_0) on F, F's templates placed into it as into any branch.
//     From then on no live code of the family sits in P_S, the ancestor of every branch.
//
// Failure before step 2 removes every branch made; src is untouched. A failure in step
// 2 after its live processes were ended leaves src on a fresh state of F with its
// sessions ended (a restore's late failure), the branches standing.
//
// The holder lives while any sandbox of the family does (family.members); the last one's
// removal ends it (its init's death ends P_S and the templates) and releases the
// family's host uid range (every member runs as it: U_i maps U_S one to one).

// family is a fast fork's holder.
type family struct {
	id  string           // the holder's templates are recorded under this sandbox id
	src string           // the sandbox whose first runtime it is
	rt  *sandbox.Sandbox // the family init's runtime (its cgroups are the holder's)
	// tracer holds the holder's templates (the source's tracer at the move).
	tracer *remote.Tracer
	base   uint32 // the family's host uid range (src's claim, kept until the end)
	// members are the sandboxes placed from it (the source included). Under Manager.mu.
	members map[string]bool
	once    sync.Once
	// mu is held by a member's restore that places the holder's templates (one at a
	// time: they are tracer's), and by a spare's placement. Lock order (doc.go): after
	// the member's opMu and tmplMu, before its copyMu, buildMu and Manager.mu.
	mu sync.Mutex
}

// familyTemplates returns node's templates in the holder of s's family, if s is a
// member and the holder has them, and an error if one of them is gone. Precondition:
// s.opMu held (a restore's first step).
// +checklocks:s.opMu
func (m *Manager) familyTemplates(s *sb, node string) ([]*procTemplate, *family, error) {
	if !m.fastPath(s) {
		return nil, nil, nil
	}
	m.mu.Lock()
	fam := m.famOf[s.rec.ID]
	if s.rt == nil || !s.rt.IsBranch() {
		fam = nil // restarted afresh (famrestart.go): not in the family's namespaces
	}
	var ts []*procTemplate
	if fam != nil {
		for _, t := range m.templates[node] {
			if t.sandbox == fam.id {
				ts = append(ts, t)
			}
		}
	}
	m.mu.Unlock()
	for _, t := range ts {
		if !templateAlive(t.tmpl) {
			return nil, nil, fmt.Errorf("the process template of %s at node %s (pid %d) is gone: that node's process state is lost: %w", t.what, node, t.tmpl.Pid, errdefs.ErrConflict)
		}
	}
	if len(ts) == 0 {
		return nil, nil, nil
	}
	return ts, fam, nil
}

// fastForkPossible says why node's fork from src cannot take the fast path ("" when it
// can), with node's templates in src. Precondition: src.opMu and src.tmplMu held.
// +checklocks:src.opMu
func (m *Manager) fastForkPossible(src *sb, node string) ([]*procTemplate, string) {
	switch {
	case !m.cfg.ForkFast:
		return nil, "the fast path of a fork is off (Config.ForkFast)"
	case src.rt == nil:
		return nil, "the node's sandbox is not running"
	case m.cfg.NoIsolation:
		return nil, "isolation is off: the fast path's branches are user namespaces of the sandbox's"
	}
	m.mu.Lock()
	fam := m.famOf[src.rec.ID]
	m.mu.Unlock()
	if fam != nil {
		return nil, "the node's sandbox is itself of a fast fork's family (a second generation is not built)"
	}
	if src.rec.Head != node {
		return nil, "the node's sandbox has moved on from it: its move into a namespace of its own would roll it back"
	}
	if sp, err := m.spec(src.rec.Image, src.rec.Head, src.rec.Upper); err != nil || !upperUnchanged(sp.Upper, sp.Lowers[0]) {
		return nil, "the node's sandbox has written files since the node: its move into a namespace of its own would roll them back"
	}
	if ts, err := m.criuTreesOf(node); err != nil || ts.count() > 0 {
		return nil, "the node holds processes that CRIU took, which the fast path does not place"
	}
	tps, err := m.templatesFor(src, node)
	if err != nil {
		return nil, "the node's templates: " + err.Error()
	}
	if len(tps) == 0 {
		return nil, "the node has no template in its sandbox"
	}
	return tps, ""
}

// forkFast is Fork's fast path (see above). It returns nil and the reason when the
// fork cannot take it and nothing was changed.
// +checklocksignore: holds src's opMu, tmplMu and copyMu throughout (its branches' goroutines work under them), and each new branch's opMu in turn
func (m *Manager) forkFast(ctx context.Context, node, maker string, ids []string, co CreateOptions, o ForkOptions, execs int64) (*ForkResult, string, error) {
	t0 := time.Now()
	src, err := m.get(maker)
	if err != nil {
		return nil, "the node's sandbox is gone", nil
	}
	m.fastForks.Add(1) // the disk watcher's timed pass waits (diskDue)
	defer m.fastForks.Add(-1)
	src.opMu.Lock()
	defer src.opMu.Unlock()
	src.tmplMu.Lock()
	defer src.tmplMu.Unlock()
	src.copyMu.Lock() // no template is copied for an image meanwhile
	defer src.copyMu.Unlock()
	tps, why := m.fastForkPossible(src, node)
	if why != "" {
		return nil, why, nil
	}
	src.mu.Lock()
	ran := int64(src.stats.Execs) != execs
	src.mu.Unlock()
	if ran {
		return nil, "the sandbox ran a command between its checkpoint and the fork: its move back onto the node would lose what that did", nil
	}
	iso, floor, err := m.fastFamily(src, tps)
	if err != nil {
		return nil, err.Error(), nil
	}
	start, err := src.rt.InitStartTime()
	if err != nil {
		return nil, "the sandbox's init: " + err.Error(), nil
	}
	// What the branches' records name until the fork is made (famrestart.go).
	fref := store.FamilyRef{ID: src.rec.ID + ".family", Source: src.rec.ID, Holder: store.InitRef{Pid: src.rt.InitPid(), Start: start, Level: sbinit.FeatureLevel}}
	res := &ForkResult{Node: node, Count: o.Count}
	outs, err := m.startAndPlace(ctx, src.rt, m.tracer(src), nil, src.rec, iso, floor, node, "", ids, co, o, tps, fref)
	if err != nil {
		return nil, "", err
	}
	tPlaced := time.Now()
	m.crashPointRecorded("forkfast", 1) // DELTABOX_CRASH_AT=forkfast:K, a test hook: the branches placed, their records not made
	fam := &family{id: fref.ID, src: src.rec.ID, base: src.rec.UIDBase, members: map[string]bool{}}
	m.addMembers(fam, outs)
	reason := fmt.Sprintf("forked from the node's %d templates into a namespace of its own, at their PIDs", len(tps))
	m.commitBranches(outs, res, maker, node, o, tps, reason)
	tCommitted := time.Now()
	var sumInit, sumState, sumPlace, maxInit time.Duration
	for _, x := range outs {
		sumInit += x.b.init
		sumState += x.b.state
		sumPlace += x.b.place
		maxInit = max(maxInit, x.b.init)
	}
	if err := m.moveSource(src, fam, node, tps, iso, floor); err != nil {
		m.log.Error("fork: the source could not move into a namespace of its own", "sandbox", maker, "err", err)
		for i := range res.Branches {
			res.Branches[i].Reason += "; the source could not move into a namespace of its own: " + err.Error()
		}
	}
	branches := make([]*sb, len(outs))
	for i, x := range outs {
		branches[i] = x.s
	}
	// Each member's sessions' terminals go to its init before the records say the family
	// is made: the daemon holds the only masters until then, and a crash would hang them
	// up (SIGHUP ends the sessions' shells and interpreters) in branches it then adopts.
	var kw sync.WaitGroup
	for _, s := range append(branches, src) {
		kw.Add(1)
		go func() {
			defer kw.Done()
			m.keepSessions(s)
		}()
	}
	kw.Wait()
	m.recordFamily(src, fam, fref, branches)
	m.crashPointRecorded("forkfast", 3)
	res.DurationMS = ms(time.Since(t0))
	n := time.Duration(len(outs))
	m.log.Debug("fork: fast path", "branches", len(outs), "start_and_place_ms", ms(tPlaced.Sub(t0)),
		"commit_ms", ms(tCommitted.Sub(tPlaced)), "move_ms", ms(time.Since(tCommitted)),
		"init_mean_ms", ms(sumInit/n), "init_max_ms", ms(maxInit), "state_mean_ms", ms(sumState/n), "place_mean_ms", ms(sumPlace/n))
	return res, "", nil
}

// forkStarts is how many branches of a fast fork start at once: two per CPU. Their
// inits' starts are CPU work and mount-table changes (under the kernel's one namespace
// lock); 64 started at once on 2 cores each took 0.5-1.0 s and the first was ready for
// its placement only after most had started, where 4 at a time each took 78 ms and the
// placements, one after the other, began at once (same total at load 20:
// docs/design/fork.md).
func forkStarts() int { return 2 * runtime.NumCPU() }

// fastOut is one branch of a fast fork being made: its sandbox, its runtime, and when
// its making began.
type fastOut struct {
	s   *sb
	b   *fastBranch
	err error
	t0  time.Time
}

// startAndPlace makes the branches ids of a fast fork of node: each a sandbox on node's
// files booted by the family init famRT (createFastBranch, forkStarts at once), node's
// templates tps placed into it by tracer as soon as it is ready (placeMember, one after
// the other: the placements overlap the other branches' starts), under hold when it is
// set (the holder's family.mu, which its templates' other placements take). On error
// every branch made is removed and the templates are as they were.
// +checklocksignore: each new branch's opMu, held here only (the branch is not answered yet)
func (m *Manager) startAndPlace(ctx context.Context, famRT *sandbox.Sandbox, tracer *remote.Tracer, fam *family, base store.Sandbox, iso *sandbox.Isolation, floor int, node, forkOf string, ids []string, co CreateOptions, o ForkOptions, tps []*procTemplate, fref store.FamilyRef) ([]fastOut, error) {
	outs := make([]fastOut, len(ids))
	ready := make(chan int, len(ids))
	slots := make(chan struct{}, forkStarts())
	for i := range ids {
		go func() {
			slots <- struct{}{}
			defer func() { <-slots }()
			outs[i].t0 = time.Now()
			ident := &apitypes.ForkIdentity{Branch: i, Count: o.Count, ParentNode: node}
			outs[i].s, outs[i].b, outs[i].err = m.createFastBranch(ctx, famRT, base, iso, floor, node, forkOf, ids[i], co, ident, tps, fref)
			ready <- i
		}()
	}
	var failed error
	for range ids {
		i := <-ready
		x := outs[i]
		if failed != nil {
			continue
		}
		if x.err != nil {
			failed = fmt.Errorf("branch %d of %d: %w", i, o.Count, x.err)
			continue
		}
		x.s.opMu.Lock()
		if fam != nil {
			fam.hold()
			for _, t := range tps {
				if !templateAlive(t.tmpl) {
					x.err = fmt.Errorf("the process template of %s at node %s (pid %d) is gone: %w", t.what, node, t.tmpl.Pid, errdefs.ErrConflict)
					break
				}
			}
		}
		err := x.err
		if err == nil {
			err = m.placeMember(tracer, famRT, x.s, x.b, tps, node)
		}
		if fam != nil {
			fam.release()
		}
		x.s.opMu.Unlock()
		if err != nil {
			failed = fmt.Errorf("branch %d of %d: %w", i, o.Count, err)
		}
	}
	if failed == nil {
		return outs, nil
	}
	var undo []error
	for _, x := range outs {
		if x.s != nil {
			if rerr := m.Remove(x.s.rec.ID); rerr != nil && !errors.Is(rerr, errdefs.ErrNotFound) {
				undo = append(undo, rerr)
			}
		}
	}
	return nil, withUndo(fmt.Errorf("fork of %s (fast path): %w (the branches made were removed)", node, failed), errors.Join(undo...))
}

// addMembers makes each branch of outs a member of fam.
func (m *Manager) addMembers(fam *family, outs []fastOut) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, x := range outs {
		fam.members[x.s.rec.ID] = true
		m.famOf[x.s.rec.ID] = fam
	}
}

// commitBranches lets each placed branch's processes run, counts the fork on it and on
// maker (the node's sandbox), and adds its answer to res.
// +checklocksignore: each new branch's opMu, held here only (the branch is not answered yet)
func (m *Manager) commitBranches(outs []fastOut, res *ForkResult, maker, node string, o ForkOptions, tps []*procTemplate, reason string) {
	for i, x := range outs {
		x.s.opMu.Lock()
		err := x.b.commit()
		x.s.opMu.Unlock()
		if err != nil {
			m.log.Warn("fork: a branch's process could not be resumed", "sandbox", x.s.rec.ID, "err", err)
		}
		ident := &apitypes.ForkIdentity{Sandbox: x.s.rec.ID, Branch: i, Count: o.Count, ParentNode: node}
		op := &OpResult{Sandbox: x.s.rec.ID, Node: m.nodeInfo(node), Processes: len(tps) - len(x.b.failed), ProcessErrors: x.b.failed, Sessions: x.b.sessionNames()}
		m.countFork(maker, x.s.rec.ID, &apitypes.ForkOrigin{Node: node, Branch: i, Count: o.Count, Path: forkFastPath, Reason: reason})
		// Get's info once (its usage readings are cgroup files: 64 branches read them
		// in the fork's critical path); info alone only if the branch is gone already.
		info, gerr := m.Get(x.s.rec.ID)
		if gerr != nil {
			x.s.opMu.Lock()
			info = m.info(x.s)
			x.s.opMu.Unlock()
		}
		res.Branches = append(res.Branches, apitypes.ForkBranch{Branch: i, Sandbox: *info, Path: forkFastPath, Reason: reason, Restore: op, Identity: ident, DurationMS: ms(time.Since(x.t0))})
	}
}

// createFastBranch makes sandbox id, a branch of a family standing on node (a fresh
// upper), booted by the family's init famRT (its own cgroups and limits, co's options,
// the rest and the host uid range base's: the source's record, or a member's), with no
// process yet. forkOf is its record's ForkOf (pidsKept, pidFloor): "" for a first fork's
// branches, as before.
// +checklocksignore: under the source's opMu (forkFast's, for its goroutines) or none (forkFamily's: famRT is the holder's); holds the new s.opMu until it returns
func (m *Manager) createFastBranch(ctx context.Context, famRT *sandbox.Sandbox, base store.Sandbox, iso *sandbox.Isolation, floor int, node, forkOf, id string, co CreateOptions, ident *apitypes.ForkIdentity, tps []*procTemplate, fref store.FamilyRef) (*sb, *fastBranch, error) {
	if id == "" {
		id = randomID("sb-")
	}
	if !idRE.MatchString(id) {
		return nil, nil, fmt.Errorf("sandbox id %q: use 1-63 characters of a-z, 0-9, '.', '_', '-': %w", id, errdefs.ErrInvalid)
	}
	hostname := co.Hostname
	if hostname == "" {
		hostname = id
	}
	m.mu.Lock()
	image := base.Image
	if n := m.nodes[node]; n != nil {
		image = n.Image
	}
	if _, ok := m.sandboxes[id]; ok {
		m.mu.Unlock()
		return nil, nil, fmt.Errorf("sandbox %s already exists: %w", id, errdefs.ErrConflict)
	}
	lim := base.Limits
	if co.MemoryMB > 0 || co.Pids > 0 || co.CPUs > 0 {
		lim = cgroup.WithDefaults(cgroup.Limits{MemoryBytes: co.MemoryMB << 20, Pids: co.Pids, CPUs: co.CPUs})
	}
	s := m.newSB(store.Sandbox{ID: id, Image: image, Workdir: base.Workdir, Hostname: hostname, User: base.User, Created: time.Now().UTC(), DiskMB: base.DiskMB, TemplateBudgetMB: base.TemplateBudgetMB, Network: co.Network, Limits: lim, UIDBase: base.UIDBase, Head: node, ForkOf: forkOf, Family: &fref})
	ident.Sandbox = id
	s.opMu.Lock()
	defer s.opMu.Unlock()
	m.sandboxes[id] = s
	m.mu.Unlock()
	fail := func(err error, b *fastBranch) (*sb, *fastBranch, error) {
		m.mu.Lock()
		delete(m.sandboxes, id)
		m.mu.Unlock()
		var derr error
		if b != nil {
			derr = b.remove(m)
		}
		return nil, nil, withUndo(err, errors.Join(derr, store.RemoveAll(m.st.SandboxDir(id))))
	}
	if err := m.writeIdentity(s, *ident); err != nil {
		return fail(err, nil)
	}
	b, err := m.startFastBranch(famRT, s.rec, iso, node, id, id, floor, m.identityLayer(id), 0)
	if err != nil {
		return fail(err, nil)
	}
	s.rec.Upper = b.upper
	s.rt = b.rt
	s.rt.User = s.rec.User
	kns, err := openKernelNS(s.rt)
	if err != nil {
		return fail(err, b)
	}
	s.kns = kns
	if err := m.attachNet(s); err != nil {
		s.kns.Close()
		s.kns, s.rt = nil, nil
		return fail(err, b)
	}
	if err := b.prepare(famRT, tps); err != nil {
		m.detachNet(s)
		s.kns.Close()
		s.kns, s.rt = nil, nil
		return fail(err, b)
	}
	m.recordInit(s)
	s.limitMu.Lock()
	s.kernelLimit = s.rec.Limits.MemoryBytes
	s.limitMu.Unlock()
	s.mu.Lock()
	s.memRT = s.rt
	s.oomSeen = s.rt.OOMKills()
	s.mu.Unlock()
	s.seq = m.st.Index.Apply(store.Op{PutSandbox: &s.rec})
	return s, b, nil
}

// placeMember places node's templates tps (in family's PID namespace, held by tr) into
// member s's runtime b, their sessions registered as s's, and puts s's kernel state as
// node's.
// +checklocks:s.opMu
func (m *Manager) placeMember(tr *remote.Tracer, family *sandbox.Sandbox, s *sb, b *fastBranch, tps []*procTemplate, node string) error {
	if err := m.place(tr, family, b, tps); err != nil {
		return err
	}
	m.resetKernelState(s, node)
	s.mu.Lock()
	for name, sess := range b.sessions {
		s.sessions[name] = sess
		delete(s.ended, name)
	}
	s.mu.Unlock()
	for _, c := range b.copies {
		if c.sess != nil {
			s.hostPids[c.pt.tmpl.Pid] = c.r.HostPid
		}
	}
	return nil
}

// moveSource is step 2 (see above): src becomes a member of fam, on a branch runtime of
// its own on node, its first runtime the holder. Precondition: src.opMu, src.tmplMu
// and src.copyMu held; the branches committed.
// +checklocks:src.opMu
func (m *Manager) moveSource(src *sb, fam *family, node string, tps []*procTemplate, iso *sandbox.Isolation, floor int) error {
	err := m.moveSourceSteps(src, fam, node, tps, iso, floor)
	if err != nil && src.rt == nil {
		// Its old runtime is the holder's now, and no live code of the family may run
		// in it again: the sandbox stays broken, with why (checkLive), its files as F.
		src.err = fmt.Errorf("it could not move into a namespace of its own at a fork of %s: %v", node, err)
	}
	return err
}

// moveSourceSteps is moveSource's work.
// +checklocks:src.opMu
func (m *Manager) moveSourceSteps(src *sb, fam *family, node string, tps []*procTemplate, iso *sandbox.Isolation, floor int) error {
	old := src.rt
	// What the old runtime built ahead of time goes with it.
	m.discardNext(src)
	m.closeWarm(src)
	if err := m.stopProcWarm(src); err != nil {
		return err
	}
	// The holder: the family init and every template of src into cgroups of their own.
	var hosts []int
	m.mu.Lock()
	var mine []*procTemplate
	for _, ts := range m.templates {
		for _, t := range ts {
			if t.sandbox == src.rec.ID {
				mine = append(mine, t)
				hosts = append(hosts, t.tmpl.HostPid)
			}
		}
	}
	m.mu.Unlock()
	if err := old.BecomeHolder(fam.id, hosts); err != nil {
		return fmt.Errorf("the family's holder: %w", err)
	}
	fam.rt, fam.tracer = old, src.tracer
	src.tracer = nil // the source's next processes get a tracer of their own
	m.mu.Lock()
	for _, t := range mine {
		t.sandbox = fam.id
	}
	fam.members[src.rec.ID] = true
	m.famOf[src.rec.ID] = fam
	m.families = append(m.families, fam)
	m.mu.Unlock()
	m.crashPointRecorded("forkfast", 2) // the holder in its cgroups, the source's record not yet a member's
	// The source's live processes end (those left in its cgroups: not the holder's),
	// and so do its sessions; its network and kernel-state handles are the old init's.
	m.detachNet(src)
	if src.kns != nil {
		src.kns.Close()
		src.kns = nil
	}
	src.rt = nil
	if err := old.KillOwnCgroup(); err != nil {
		return fmt.Errorf("end the source's processes: %w", err)
	}
	old.DropState()
	m.endSessions(src, "ended: the sandbox moved into a namespace of its own at a fork of "+node+" (its process state is the node's)")
	src.mu.Lock()
	clear(src.hostPids)
	src.mu.Unlock()
	oldUpper := src.rec.Upper
	b, err := m.startFastBranch(old, src.rec, iso, node, src.rec.ID, src.rec.ID, floor, "", 0)
	if err != nil {
		return err
	}
	src.rt = b.rt
	src.rt.User = src.rec.User
	if src.kns, err = openKernelNS(src.rt); err != nil {
		return err
	}
	if err := m.attachNet(src); err != nil {
		return err
	}
	if err := m.placeMember(fam.tracer, old, src, b, tps, node); err != nil {
		return err
	}
	err = b.commit()
	m.mu.Lock()
	src.rec.Head, src.rec.Upper = node, b.upper
	src.seq = m.st.Index.Apply(store.Op{PutSandbox: &src.rec})
	m.mu.Unlock()
	m.recordInit(src)
	src.mu.Lock()
	src.memRT = src.rt
	src.mu.Unlock()
	if oldUpper != b.upper {
		dir := m.st.LayerDir(oldUpper)
		m.st.Index.Apply(store.Op{After: func() { _ = store.RemoveAll(dir) }}) // an unused layer: the start-up sweep removes it
	}
	m.prepareNext(src)
	return err
}

// leaveFamily drops sandbox id from its family, if it has one; the last member's
// leaving ends the holder (its init, P_S, its templates) and releases the family's uid
// range. It reports whether id's own uid claim must stay (the family holds it).
func (m *Manager) leaveFamily(id string) (keepIDs bool) {
	m.mu.Lock()
	fam := m.famOf[id]
	if fam == nil {
		m.mu.Unlock()
		return false
	}
	delete(m.famOf, id)
	delete(fam.members, id)
	last := len(fam.members) == 0
	if last {
		for i, f := range m.families {
			if f == fam {
				m.families = append(m.families[:i], m.families[i+1:]...)
				break
			}
		}
		m.dropSandboxTemplatesLocked(fam.id)
	}
	m.mu.Unlock()
	if !last {
		return id == fam.src
	}
	fam.once.Do(func() { m.endFamily(fam) })
	return false
}

// endFamily ends fam's holder and gives its uid range back.
func (m *Manager) endFamily(fam *family) {
	if fam.tracer != nil {
		_ = fam.tracer.Close() // its templates end with the family init
	}
	if fam.rt != nil {
		if err := fam.rt.Destroy(); err != nil {
			m.log.Warn("fork: the family's holder", "family", fam.id, "err", err)
		}
	}
	m.mu.Lock()
	_, again := m.sandboxes[fam.src] // a new sandbox of the same id
	m.mu.Unlock()
	if !again {
		_ = store.RemoveAll(m.st.SandboxDir(fam.src)) // no record names it: the start-up sweep removes what stays
	}
	m.releaseIDs(fam.src, fam.base)
}

// sessionNames are the branch's sessions, sorted.
func (b *fastBranch) sessionNames() []string {
	var out []string
	for n := range b.sessions {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// closeFamilies lets go of the families' holders as the daemon stops: with the
// sandboxes stopped, each holder ends; left running, its tracer detaches its templates
// (stopped) and the holder goes on for the members (a next daemon does not know it:
// their restores of pre-fork nodes take the durable path).
func (m *Manager) closeFamilies() {
	m.mu.Lock()
	fams := m.families
	m.families = nil
	m.mu.Unlock()
	for _, fam := range fams {
		if fam.tracer != nil {
			_ = fam.tracer.Close() // stopping: one template it could not put back it killed, the others stay stopped
		}
		if m.cfg.StopSandboxes && fam.rt != nil {
			if err := fam.rt.Destroy(); err != nil {
				m.log.Warn("close: a fork family's holder", "family", fam.id, "err", err)
			}
		}
	}
}

// hold takes f.mu for a restore that places the holder's templates, from its step 1
// until it returns (restore.fam); release gives it back.
// +checklocksignore: held across a restore's steps (restore.fam records it)
func (f *family) hold() { f.mu.Lock() }

// +checklocksignore: see hold
func (f *family) release() { f.mu.Unlock() }
