package state

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"runtime"
	"sort"
	"sync/atomic"
	"time"

	"deltabox/internal/errdefs"
	"deltabox/internal/netproxy"
	"deltabox/internal/procfs"
	"deltabox/internal/sandbox"
	"deltabox/internal/sbinit"
	"deltabox/internal/store"
)

// Spares (docs/design/spares.md). A member s of a fast fork's family restores a node F
// made before the fork by forking F's templates, which live in the family's holder
// (P_S), into its own namespace P_i: the fork of a 63 MB python is 3.6 ms of the
// restore's critical path. A spare is that work done ahead: a new sibling namespace of
// the family (a branch init on F's files, a fresh upper, no process of s's), F's
// templates placed into it at their PIDs and kept stopped (a fastBranch never
// committed). A restore of F in s that finds one swaps runtimes instead of forking: s's
// runtime ends (its branch init's death ends P_i, and with it every process of s), the
// spare's becomes s's, and its copies resume. Then the next spare of (s, F) is made in
// the background, as the warm states are (warm.go): tree search and RL come back to the
// same node.
//
// Why this is exactly F's state: nothing ran in the spare. Its upper is fresh; its
// copies were forked from F's templates and stopped before their first instruction
// (fastpath.Revival.ReviveInto), traced by the holder's tracer, until commit; its
// namespace's only other process is its init, which runs no code of the sandbox.
//
// Why only for nodes whose templates are in a holder: a spare must sit in a namespace
// no live code of the sandbox can reach. P_i's siblings are such (the fork's isolation:
// docs/design/fork.md); a child of P_i, the only place a sandbox that never forked, or
// a member's own post-fork templates (in P_i), could fork into, is not: the live code
// sees its processes in /proc, and with the same host uid and its template's Landlock
// domain could signal or ptrace them, and so change what the restore returns.
//
// Why a runtime of its own name: a spare's cgroups are made while s's runtime holds the
// ones named s (cgroup2 has no rename), so a spare is named s~spareN and, once swapped
// in, s's record names it (store.Sandbox.Cgroup) for the next daemon. A spare is memory
// only: at a daemon restart its cgroups are no record's, and the start-up sweep kills
// them (its init, its copies) and its upper is an unused layer.

// maxSpares bounds the spares one sandbox holds (the oldest goes first): the node just
// restored and one the client named, typically.
const maxSpares = 2

// spare is (s, node)'s: a branch runtime with node's templates placed, stopped.
type spare struct {
	node string
	b    *fastBranch
	kns  *sbinit.NS
	net  *netproxy.Sandbox // its network's proxy, attached as s's would be (nil: none)
	made time.Time
	// pss is what its copies hold, measured when made: their smaps_rollup PssAnon, as
	// the template budget counts templates (budget.go); private is what they hold alone,
	// their Private_Dirty and page tables (VmPTE), what the spare adds to the machine.
	pss, private int64
}

// spareBuilds is how many spares are made at once: one per two CPUs. A spare's making
// is a branch init's start (an exec, the Go runtime's start, its mounts: 30-100 ms of
// CPU on this 2-core VM) and its placement; after an RL step's resets of B members, B
// of them at once took the CPUs from the next step's actions (bench rl, B = 8:
// docs/design/spares.md). Made one after the other, they leave a CPU to the agents.
// Background spares only: one a client asks for (PrepareSpare) is made at once.
func spareBuilds() int { return max(1, runtime.NumCPU()/2) }

// A spare made in the background (after a restore: spareNow) starts only once no task
// waited for a CPU for a whole window (spareIdleWindow) by the kernel's pressure
// accounting (/proc/pressure/cpu, "some": the time at least one runnable task waited),
// or once it has waited spareIdleMax. The agents' calls it would serve are what keeps
// the CPUs busy: at B = 64 on 2 cores a step's 64 actions and resets saturate both,
// and spares made beside them took half their CPU (bench rl: docs/design/spares.md);
// the trainer's policy leaves them idle. A spare the client asks for (PrepareSpare)
// is made at once: the client waits for it.
const (
	spareIdleWindow = 10 * time.Millisecond
	// spareIdleStall is the most the window may hold of waiting for a CPU: a tenth.
	spareIdleStall = time.Millisecond
	// spareIdleMax bounds the wait: on a machine never idle a spare is made anyway, as
	// before the rule (a restore that finds none forks), so that spares do not stop.
	spareIdleMax = 2 * time.Second
	// spareNice is a background spare's branch init's nice until the swap
	// (sbinit/nice.go): its setup yields the CPUs to the agents' calls that start
	// meanwhile.
	spareNice = 10
)

// waitCPUIdle returns once a window of spareIdleWindow passed with no more than
// spareIdleStall of waiting for a CPU, after spareIdleMax, or at once without pressure
// accounting; it reports how long it waited and whether the CPUs were found idle.
func waitCPUIdle(ctx context.Context, stop <-chan struct{}) (time.Duration, bool) {
	t0 := time.Now()
	last, ok := procfs.CPUStall()
	if !ok {
		return 0, false
	}
	for time.Since(t0) < spareIdleMax {
		select {
		case <-time.After(spareIdleWindow):
		case <-ctx.Done():
			return time.Since(t0), false
		case <-stop:
			return time.Since(t0), false
		}
		now, _ := procfs.CPUStall() // ok as at the first read
		if now-last <= spareIdleStall {
			return time.Since(t0), true
		}
		last = now
	}
	return time.Since(t0), false
}

// spareSeq numbers spares' runtimes (their cgroups' names).
var spareSeq atomic.Uint64

// spareRefusal says why node cannot have a spare for s ("" when it can) and returns
// s's family. Precondition: s.opMu held.
//
// A node holding processes that CRIU took (criutrees.go) has none: a spare is copies
// of the node's templates alone, and its swap restores no CRIU tree, so a restore from
// it returned the node without those processes (TestModelForkSpares found it: a CRIU
// holder gone after the swap). Those processes come back through CRIU, at a restore
// that forks.
// +checklocks:s.opMu
func (m *Manager) spareRefusal(s *sb, node string) (*family, string) {
	fam, why := m.spareFamily(s, node)
	if why != "" {
		return nil, why
	}
	if ts, err := m.criuTreesOf(node); err != nil {
		return nil, err.Error()
	} else if n := ts.count(); n > 0 {
		return nil, fmt.Sprintf("node %s holds %d processes that CRIU took, which come back only through CRIU at a restore that forks (a spare holds copies of the node's templates alone): restore it as usual", node, n)
	}
	return fam, ""
}

// spareFamily is spareRefusal's part under m.mu: s's family holds node's templates,
// and s holds none of its own.
// +checklocks:s.opMu
func (m *Manager) spareFamily(s *sb, node string) (*family, string) {
	if m.cfg.NoSpares {
		return nil, "spares are off (DELTABOX_SPARES=0)"
	}
	if s.rt == nil {
		return nil, "the sandbox is not running"
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	fam := m.famOf[s.rec.ID]
	if fam == nil || !s.rt.IsBranch() || fam.rt == nil || fam.tracer == nil {
		return nil, fmt.Sprintf("node %s's processes are not in a fork family's holder for sandbox %s: a spare would have to sit in a child of the namespace where the sandbox's code runs, which could see, signal and ptrace it; fork the sandbox first (POST /v1/sandboxes/%s/fork, sb.fork(count=N)) and prepare a node made before the fork for one of its members", node, s.rec.ID, s.rec.ID)
	}
	n, own := 0, 0
	for id, ts := range m.templates {
		for _, t := range ts {
			switch {
			case id == node && t.sandbox == fam.id:
				n++
			case t.sandbox == s.rec.ID:
				own++
			}
		}
	}
	if own > 0 {
		return nil, fmt.Sprintf("sandbox %s holds templates of its own nodes (made after the fork), in its namespace, which a restore from a spare ends: it would lose them; remove those nodes (or evict them, with durable images) to use spares, or restore %s as usual", s.rec.ID, node)
	}
	if n == 0 {
		return nil, fmt.Sprintf("node %s has no process template in sandbox %s's family holder (a node made after the fork keeps its templates in the member's own namespace, where its code runs; or its templates were evicted): restore it as usual", node, s.rec.ID)
	}
	return fam, ""
}

// PrepareSpare makes sure sandbox id holds a spare of node (id "": the node's own
// sandbox), made now if it has none, and returns the node.
func (m *Manager) PrepareSpare(ctx context.Context, node, id string) (*NodeInfo, error) {
	if err := m.awaitNode(ctx, node); err != nil { // a node answered early (answer.go)
		return nil, err
	}
	m.mu.Lock()
	n := m.nodes[node]
	if n != nil && id == "" {
		id = n.Sandbox
	}
	m.mu.Unlock()
	if n == nil {
		return nil, fmt.Errorf("no node %q (deltabox tree lists them): %w", node, errdefs.ErrNotFound)
	}
	s, err := m.get(id)
	if err != nil {
		return nil, err
	}
	// Refused before a spare held already is taken for an answer (one made before
	// the sandbox's own templates, which it cannot be used with).
	s.opMu.Lock()
	_, why := m.spareRefusal(s, node)
	s.opMu.Unlock()
	if why != "" {
		return nil, fmt.Errorf("%s: %w", why, errdefs.ErrConflict)
	}
	if err := m.makeSpare(ctx, s, node, false); err != nil {
		return nil, err
	}
	return m.Node(node)
}

// makeSpare makes (s, node)'s spare unless s holds one. Its work runs without s.opMu
// (its branch init's start, tens of milliseconds, would hold up s's calls), under the
// family's mu for the placement only. A background one (after a restore) waits for
// idle CPUs first (waitCPUIdle).
func (m *Manager) makeSpare(ctx context.Context, s *sb, node string, background bool) error {
	s.spareMu.Lock()
	for s.spareMaking[node] != nil {
		done := s.spareMaking[node]
		s.spareMu.Unlock()
		select {
		case <-done:
		case <-ctx.Done():
			return ctx.Err()
		}
		s.spareMu.Lock()
	}
	if s.spareClosed {
		s.spareMu.Unlock()
		return fmt.Errorf("sandbox %s is being removed or the daemon stops: %w", s.rec.ID, errdefs.ErrConflict)
	}
	for _, sp := range s.spares {
		if sp.node == node {
			s.spareMu.Unlock()
			return nil
		}
	}
	done := make(chan struct{})
	s.spareMaking[node] = done
	s.spareMu.Unlock()
	defer func() {
		s.spareMu.Lock()
		delete(s.spareMaking, node)
		s.spareMu.Unlock()
		close(done)
	}()
	s.opMu.Lock()
	fam, why := m.spareRefusal(s, node)
	var rec store.Sandbox
	var iso *sandbox.Isolation
	var err error
	if why == "" {
		rec = s.rec
		iso, _, err = m.isolation(s, false)
	}
	topLower := m.identityLayer(s.rec.ID) // "" for the source, which has none
	s.opMu.Unlock()
	if why != "" {
		return fmt.Errorf("%s: %w", why, errdefs.ErrConflict)
	}
	if err != nil {
		return err
	}
	nice := 0
	if background {
		select { // one of spareBuilds
		case m.spareSlots <- struct{}{}:
		case <-ctx.Done():
			return ctx.Err()
		}
		defer func() { <-m.spareSlots }()
		if waited, idle := waitCPUIdle(ctx, m.stop); waited >= spareIdleWindow {
			m.log.Debug("a spare waited for idle CPUs", "sandbox", s.rec.ID, "node", node, "waited", waited, "idle", idle)
		}
		if why := m.spareGone(s, node); why != "" { // while it waited
			return fmt.Errorf("spare of %s for %s: %s: %w", node, s.rec.ID, why, errdefs.ErrConflict)
		}
		nice = spareNice
	}
	sp, err := m.buildSpare(fam, s, rec, iso, node, topLower, nice)
	if err != nil {
		m.log.Info("spare not made", "sandbox", s.rec.ID, "node", node, "err", err)
		return fmt.Errorf("spare of %s for %s: %w", node, s.rec.ID, err)
	}
	s.spareMu.Lock()
	closed := s.spareClosed
	var out []*spare
	if !closed {
		s.spares = append(s.spares, sp)
		for len(s.spares) > maxSpares {
			out = append(out, s.spares[0])
			s.spares = s.spares[1:]
		}
	}
	s.spareMu.Unlock()
	s.mu.Lock()
	s.stats.SparesMade++
	s.mu.Unlock()
	if closed {
		out = append(out, sp)
	}
	m.dropSpares(s, out)
	return nil
}

// buildSpare makes the spare: its runtime (startFastBranch, named s~spareN), its
// kernel state and network as s's would be at a restore of node, its sessions, then
// node's templates placed into it, stopped. On error what it made is removed.
func (m *Manager) buildSpare(fam *family, s *sb, rec store.Sandbox, iso *sandbox.Isolation, node, topLower string, nice int) (_ *spare, err error) {
	m.mu.Lock()
	var tps []*procTemplate
	for _, t := range m.templates[node] {
		if t.sandbox == fam.id {
			tps = append(tps, t)
		}
	}
	famRT := fam.rt
	m.mu.Unlock()
	if len(tps) == 0 {
		return nil, fmt.Errorf("node %s's templates are gone from the family's holder: %w", node, errdefs.ErrConflict)
	}
	floor := m.pidFloor(s)
	for _, t := range tps {
		floor = max(floor, t.tmpl.Pid)
	}
	name := fmt.Sprintf("%s~spare%d", rec.ID, spareSeq.Add(1))
	b, err := m.startFastBranch(famRT, rec, iso, node, rec.ID, name, floor, topLower, nice)
	if err != nil {
		return nil, err
	}
	sp := &spare{node: node, b: b}
	defer func() {
		if err != nil {
			err = withUndo(err, sp.remove(m))
		}
	}()
	b.rt.User = rec.User
	if sp.kns, err = openKernelNS(b.rt); err != nil {
		return nil, err
	}
	m.resetKNS(sp.kns, rec, node)
	if sp.net, err = m.netFor(rec, b.rt); err != nil {
		return nil, err
	}
	if err := b.prepare(famRT, tps); err != nil {
		return nil, err
	}
	// The sessions' terminals go to the spare's init now, as keepSessions hands a
	// running sandbox's to its own: a daemon that dies after the swap, before its
	// after-answer work, would otherwise leave a runtime whose sessions' only terminal
	// masters died with it (the next daemon adopts it without them).
	s.mu.Lock()
	opts := maps.Clone(s.sessionOpts)
	s.mu.Unlock()
	for _, c := range b.pending {
		if c.sess == nil {
			continue
		}
		data, _ := json.Marshal(keptSession{Opts: opts[c.pt.session], Kind: c.pt.kind, Argv: c.pt.argv, Pid: c.pt.tmpl.Pid, Started: time.Now().UTC()})
		if err := c.sess.Keep(sessionKey+c.pt.session, string(data)); err != nil {
			return nil, fmt.Errorf("keep session %s in the spare's init: %w", c.pt.session, err)
		}
	}
	fam.hold()
	for _, t := range tps {
		if !templateAlive(t.tmpl) {
			err = fmt.Errorf("the process template of %s at node %s (pid %d) is gone: %w", t.what, node, t.tmpl.Pid, errdefs.ErrConflict)
			break
		}
	}
	if err == nil {
		err = m.place(fam.tracer, famRT, b, tps)
	}
	fam.release()
	if err != nil {
		return nil, err
	}
	// The placement moved the holder's templates' counters (as a restore does): a next
	// daemon's Reattach checks them against the record, and kills a template that does
	// not match (it ran). Recorded at once and waited for, so that a crash after the
	// spare is made does not cost the node its templates (one during the placement
	// still can, as one during a restore's fork: docs/design/spares.md).
	m.recordTemplatesOf(fam.id, &fam.mu, node, tps)
	_ = m.st.Index.WaitDurable(m.st.Index.Seq()) // an error is the index's, reported by its next durable op
	for _, c := range b.copies {
		if mem, err := templateMemory(c.r.HostPid, time.Minute); err == nil {
			sp.pss += mem.PssAnon
			sp.private += mem.PrivateDirty
		}
		sp.private += procfs.PageTables(c.r.HostPid)
	}
	sp.made = time.Now()
	return sp, nil
}

// remove ends the spare: its copies, its init (its namespace), its upper, its handles.
func (sp *spare) remove(m *Manager) error {
	if sp.net != nil {
		sp.net.Close()
		sp.net = nil
	}
	if sp.kns != nil {
		sp.kns.Close()
		sp.kns = nil
	}
	return sp.b.remove(m)
}

// dropSpares removes spares of s in the background, counted.
func (m *Manager) dropSpares(s *sb, sps []*spare) {
	if len(sps) == 0 {
		return
	}
	s.mu.Lock()
	s.stats.SparesDropped += len(sps)
	s.mu.Unlock()
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		for _, sp := range sps {
			if err := sp.remove(m); err != nil {
				m.log.Warn("a spare's removal", "sandbox", s.rec.ID, "node", sp.node, "err", err)
			}
		}
	}()
}

// hasSpare reports whether s holds a spare of node (takeSpare may still find none: the
// spare may be dropped meanwhile).
func (m *Manager) hasSpare(s *sb, node string) bool {
	s.spareMu.Lock()
	defer s.spareMu.Unlock()
	for _, sp := range s.spares {
		if sp.node == node {
			return true
		}
	}
	return false
}

// takeSpare returns (s, node)'s spare, taken out of s's, or nil.
func (m *Manager) takeSpare(s *sb, node string) *spare {
	s.spareMu.Lock()
	defer s.spareMu.Unlock()
	for i, sp := range s.spares {
		if sp.node == node {
			s.spares = append(s.spares[:i], s.spares[i+1:]...)
			return sp
		}
	}
	return nil
}

// closeSpares removes every spare of s, before it returns, and makes none again (s
// removed, the daemon stopping): at a stop, before the holder's tracer is closed, which
// would let their copies run.
func (m *Manager) closeSpares(s *sb) {
	s.spareMu.Lock()
	s.spareClosed = true
	sps := s.spares
	s.spares = nil
	s.spareMu.Unlock()
	for _, sp := range sps {
		if err := sp.remove(m); err != nil {
			m.log.Warn("a spare's removal", "sandbox", s.rec.ID, "node", sp.node, "err", err)
		}
	}
	if len(sps) > 0 {
		s.mu.Lock()
		s.stats.SparesDropped += len(sps)
		s.mu.Unlock()
	}
}

// dropNodeSpares drops every sandbox's spares of nodes (removed, or their templates
// evicted or gone).
func (m *Manager) dropNodeSpares(nodes ...string) {
	drop := map[string]bool{}
	for _, n := range nodes {
		drop[n] = true
	}
	for _, s := range m.allSandboxes() {
		var out []*spare
		s.spareMu.Lock()
		keep := s.spares[:0]
		for _, sp := range s.spares {
			if drop[sp.node] {
				out = append(out, sp)
			} else {
				keep = append(keep, sp)
			}
		}
		s.spares = keep
		s.spareMu.Unlock()
		m.dropSpares(s, out)
	}
}

// spareGone says why a spare of node for s is no longer wanted ("" if it is): the
// daemon stops, s is being removed, node was removed.
func (m *Manager) spareGone(s *sb, node string) string {
	select {
	case <-m.stop:
		return "the daemon stops"
	default:
	}
	s.spareMu.Lock()
	closed := s.spareClosed
	s.spareMu.Unlock()
	if closed {
		return "the sandbox is being removed"
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.nodes[node] == nil {
		return "the node was removed"
	}
	return ""
}

// spareNext makes (s, node)'s next spare in the background, after the answer.
func (m *Manager) spareNext(s *sb, node string) {
	m.afterAnswer(s, func() { m.spareNow(s, node) })
}

// spareNow makes (s, node)'s next spare (spareNext's work) unless the daemon stops.
func (m *Manager) spareNow(s *sb, node string) {
	select {
	case <-m.stop:
		return
	default:
	}
	_ = m.makeSpare(context.Background(), s, node, true) // no one waits for it: a failed build makeSpare logs; a refusal (the node, the sandbox or the daemon gone) is no error
}

// sparesOf lists the sandboxes holding a spare of node, sorted (NodeInfo.Spares).
func (m *Manager) sparesOf(node string) []string {
	var out []string
	for _, s := range m.allSandboxes() {
		s.spareMu.Lock()
		for _, sp := range s.spares {
			if sp.node == node {
				out = append(out, s.rec.ID)
				break
			}
		}
		s.spareMu.Unlock()
	}
	sort.Strings(out)
	return out
}

// spareAlive reports why sp cannot be used ("" when it can): a copy of it died (killed
// from the host, say) or is not in its stop.
func spareDead(sp *spare) string {
	if !sp.b.rt.Alive() {
		return "its init is gone"
	}
	for _, c := range sp.b.copies {
		select {
		case <-c.exit:
			return fmt.Sprintf("its copy of %s (pid %d) is gone", c.pt.what, c.pt.tmpl.Pid)
		default:
		}
		if st := procfs.State(c.r.HostPid); st != 't' && st != 'T' {
			return fmt.Sprintf("its copy of %s (pid %d) is not stopped (state %q)", c.pt.what, c.pt.tmpl.Pid, st)
		}
	}
	return ""
}

// swap is a restore from a spare in progress: restoreLocked's, under s.opMu.
type swap struct {
	r  *restore
	sp *spare
	// old is s's runtime until the swap; oldKNS its kernel-state handles.
	old    *sandbox.Sandbox
	oldKNS *sbinit.NS
}

// swapSteps are a restore from a spare's steps; step k of "restore-spare" (failStep)
// is swapSteps[k-1]. Everything that can fail comes before s's runtime ends (step 3,
// which fails in no part: no fault point inside it): a failure at or before any step
// leaves the sandbox exactly as it was (the spare is dropped).
//
//  1. check: the spare's init and copies are there, stopped. A spare found dead is
//     dropped and the restore takes the usual path. (A sandbox holding templates of
//     its own does not take its spare: they live in the namespace the swap ends.)
//  2. quiesce: what works on s's runtime stops: the warm-up of restored processes, the
//     prepared and warm states (mounted by its init).
//  3. swap: s's runtime ends (its init killed: its PID namespace, its processes; the
//     family init reaps its placed ones), the spare's becomes s's (network, kernel
//     state, sessions, host PIDs); the copies resume; the record names the spare's
//     runtime, the node, its upper. Nothing here fails.
var swapSteps = []step[*swap]{
	{"spare_check", (*swap).check, false},
	{"spare_quiesce", (*swap).quiesce, false},
	{"spare_swap", (*swap).swapAndPublish, false},
}

// errSpareUnusable: the check found the spare unusable; the restore goes the usual way.
var errSpareUnusable = errors.New("spare unusable")

// restoreFromSpare runs r from sp. It returns errSpareUnusable when the restore must
// take the usual path (nothing changed, sp dropped), another error when it failed
// (nothing changed, sp dropped).
// +checklocksignore: under r.s.opMu, restoreLocked's (beginOp's); each step is annotated
func (m *Manager) restoreFromSpare(r *restore, sp *spare, t0 time.Time) error {
	w := &swap{r: r, sp: sp}
	var inject func() error
	if err := runSteps(m, "restore-spare", swapSteps, w, &inject, r.res, t0); err != nil {
		m.dropSpares(r.s, []*spare{sp}) // step 3 fails in no part: nothing changed
		m.reopenWarm(r.s)               // step 2 closed them; s's runtime is as it was
		return err
	}
	return nil
}

// check is step 1.
// +checklocks:w.r.s.opMu
func (w *swap) check() error {
	m, s, r := w.r.m, w.r.s, w.r
	why := spareDead(w.sp)
	if why == "" && (s.rt == nil || !s.rt.IsBranch()) {
		why = "the sandbox's runtime is not a member's"
	}
	if why == "" {
		// Its init becomes s's: at the nice of a sandbox's (a background spare's was
		// made at spareNice), it and every thread and command it starts from now on.
		if err := sbinit.ResetNice(w.sp.b.rt.InitPid()); err != nil {
			why = "its init's priority: " + err.Error()
		}
	}
	if why == "" {
		s.lazyMu.Lock()
		if len(s.lazy) > 0 {
			why = "a lazy restore is still copying pages into the sandbox"
		}
		s.lazyMu.Unlock()
	}
	if why != "" {
		r.res.Warnings = append(r.res.Warnings, "the node's spare was not used ("+why+"): restored by forking its templates")
		m.log.Info("spare not used", "sandbox", s.rec.ID, "node", r.nodeID, "why", why)
		return errSpareUnusable
	}
	return nil
}

// hasOwnTemplates reports whether s holds templates of its own (in its namespace).
func (m *Manager) hasOwnTemplates(s *sb) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, ts := range m.templates {
		for _, t := range ts {
			if t.sandbox == s.rec.ID {
				return true
			}
		}
	}
	return false
}

// quiesce is step 2.
// +checklocks:w.r.s.opMu
func (w *swap) quiesce() error {
	m, s := w.r.m, w.r.s
	if err := m.stopProcWarm(s); err != nil {
		return err
	}
	m.discardNext(s)
	w.r.discarded = true // a new preparation follows whatever happens (restoreLocked)
	m.closeWarm(s)       // reopened at publish (reopenWarm)
	return nil
}

// swapAndPublish is step 3: nothing in it fails.
// +checklocks:w.r.s.opMu
func (w *swap) swapAndPublish() error {
	tp := time.Now()
	w.swap()
	phase(w.r.res, "spare_end_and_install", &tp)
	w.publish()
	return nil
}

// swap is step 3's first part: s's runtime ends, the spare's takes its place.
// +checklocks:w.r.s.opMu
func (w *swap) swap() {
	m, s, r, sp := w.r.m, w.r.s, w.r, w.sp
	w.old, w.oldKNS = s.rt, s.kns
	// s's runtime ends: its processes are frozen here (one write: none of them runs
	// again), and killed after the answer: its init's death ends its PID namespace and
	// every process in it (the family init reaps the placed ones). Their exit frees
	// their memory, 1-2 ms of CPU for a 63 MB python, which would compete with the
	// answer (as a restore's memory holders would: background.go). A freeze that fails
	// leaves them running until that kill, in a namespace nothing of s's sees.
	old, oldKNS := w.old, w.oldKNS
	if err := old.Freeze(); err != nil {
		m.log.Warn("restore from a spare: freeze the old runtime", "sandbox", s.rec.ID, "err", err)
	}
	m.detachNet(s)
	// After the answer: the old runtime's end, then the next spare (spareNext's work),
	// one after the other: both are the family init's (it reaps the old runtime's
	// placed processes, and starts the new spare's branch init).
	node := r.nodeID
	m.afterAnswer(s, func() {
		oldKNS.Close()
		if err := old.Destroy(); err != nil {
			m.log.Warn("restore from a spare: the old runtime", "sandbox", s.rec.ID, "err", err)
		}
		m.spareNow(s, node)
	})
	s.rt, s.kns = sp.b.rt, sp.kns
	sp.kns = nil
	if sp.net != nil {
		s.mu.Lock()
		s.net = sp.net
		s.mu.Unlock()
		sp.net = nil
	}
	ended := m.endSessions(s, "ended by a restore to "+r.nodeID+", where it had no process state")
	r.res.Killed = len(ended)
	s.mu.Lock()
	for name, sess := range sp.b.sessions {
		s.sessions[name] = sess
		delete(s.ended, name)
	}
	s.memRT = s.rt
	s.oomSeen = s.rt.OOMKills()
	s.mu.Unlock()
	s.keepMu.Lock() // its sessions were kept by the spare's init when made (buildSpare)
	for _, c := range sp.b.copies {
		if c.sess != nil {
			s.kept[c.pt.session] = keptMark{c.sess, c.pt.tmpl.Pid}
		}
	}
	s.keepMu.Unlock()
	clear(s.hostPids)
	for _, c := range sp.b.copies {
		if c.sess != nil {
			s.hostPids[c.pt.tmpl.Pid] = c.r.HostPid
		}
	}
	r.res.SessionsEnded = nil
	for _, e := range ended {
		if sp.b.sessions[e] == nil {
			r.res.SessionsEnded = append(r.res.SessionsEnded, e)
		}
	}
	sort.Strings(r.res.SessionsEnded)
}

// publish is step 3's second part: the copies resume, the record follows.
// +checklocks:w.r.s.opMu
func (w *swap) publish() {
	m, s, r, sp := w.r.m, w.r.s, w.r, w.sp
	b := sp.b
	n := len(b.copies)
	tp := time.Now()
	err := b.commit()
	phase(r.res, "spare_resume", &tp)
	r.res.Processes = n - len(b.failed)
	r.res.ProcessErrors = b.failed
	r.res.Sessions = b.sessionNames()
	if err != nil {
		m.log.Warn("restore from a spare: a process could not be resumed", "sandbox", s.rec.ID, "err", err)
	}
	r.res.FromSpare, r.res.Mounted = true, true
	oldUpper := s.rec.Upper
	m.mu.Lock()
	s.rec.Head, s.rec.Image, s.rec.Upper, s.rec.Cgroup = r.nodeID, r.image, b.upper, s.rt.ID
	m.mu.Unlock()
	m.recordInit(s) // +checklocksignore: opMu held (restoreLocked)
	m.mu.Lock()
	s.seq = m.st.Index.Apply(store.Op{PutSandbox: &s.rec})
	m.mu.Unlock()
	phase(r.res, "spare_record", &tp)
	// DELTABOX_CRASH_AT=restore-spare:5, a test hook: the record on disk, the old runtime
	// frozen, not ended (TestSpareCutByCrash).
	m.crashPointRecorded("restore-spare", 5) // len(swapSteps)+2: after runSteps' own last point
	if oldUpper != b.upper {
		dir := m.st.LayerDir(oldUpper)
		m.st.Index.Apply(store.Op{After: func() { _ = store.RemoveAll(dir) }}) // after the record that stops naming it
	}
	m.countPath(s, "restore", pathProcess)
	s.mu.Lock()
	s.stats.RestorePaths.Spare++
	s.mu.Unlock()
	m.reopenWarm(s)
	s.limitMu.Lock()
	s.kernelLimit = s.rec.Limits.MemoryBytes // the new runtime's, as made (createFastBranch); fitted after
	s.limitMu.Unlock()
	m.warmNode(s, r.nodeID) // the next spare follows the old runtime's end (swap)
	m.afterAnswer(s, func() { m.keepSessions(s) })
	m.afterOpMeasure(s)
}

// reopenWarm lets warm and prepared states be made again on s's new runtime.
func (m *Manager) reopenWarm(s *sb) {
	s.prepMu.Lock()
	s.warmClosed = false
	s.prepMu.Unlock()
}

// allSandboxes lists the sandboxes (a copy: taken under m.mu, used without it).
func (m *Manager) allSandboxes() []*sb {
	m.mu.Lock()
	defer m.mu.Unlock()
	all := make([]*sb, 0, len(m.sandboxes))
	for _, s := range m.sandboxes {
		all = append(all, s)
	}
	return all
}

// sparesPSS is what s's spares hold (their copies' PssAnon when made), for the budget,
// and of it what they hold alone (Private_Dirty and page tables).
func (m *Manager) sparesPSS(s *sb) (pss, private int64) {
	s.spareMu.Lock()
	defer s.spareMu.Unlock()
	for _, sp := range s.spares {
		pss += sp.pss
		private += sp.private
	}
	return pss, private
}

// dropSparesForRoom drops spares for a checkpoint of s over a template budget (c): s's
// over its own, every sandbox's over the total. It reports whether it dropped any.
func (m *Manager) dropSparesForRoom(s *sb, c budgetCheck) bool {
	who := []*sb{s}
	if c.total > 0 && c.totalUsed > c.total {
		who = m.allSandboxes()
	}
	dropped := false
	for _, x := range who {
		x.spareMu.Lock()
		sps := x.spares
		x.spares = nil
		x.spareMu.Unlock()
		if len(sps) > 0 {
			dropped = true
			m.log.Info("dropped spares over a template budget", "sandbox", x.rec.ID, "spares", len(sps))
			m.dropSpares(x, sps)
		}
	}
	return dropped
}
