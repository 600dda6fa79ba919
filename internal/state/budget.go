package state

import (
	"context"
	"fmt"
	"sort"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/cgroup"
	"deltabox/internal/errdefs"
	"deltabox/internal/procfs"
)

// ---- the template memory budget (issue 17, item 3) ----
//
// A sandbox's spares (spares.go) count with its templates (their copies' Pss when
// made), and go first when a checkpoint finds no room: every spare of the sandbox over
// its own budget, every sandbox's over the total.
//
// A page is charged to the memory cgroup of the process that first faulted it, so after
// a live process's copy-on-write the old page, now its template's alone, stays charged
// to the sandbox; and the charge cannot be moved on this kernel (cgroup v1's
// memory.move_charge_at_immigrate = 3 fails with EINVAL). So the budget is accounting,
// not a second cgroup:
//
//   - the sandbox's kernel limit is memory_mb plus what its templates may come to hold
//     alone, up to their budget (fitKernelLimit): templates within their budget cannot
//     get a live process OOM-killed, and the live processes cannot use the budget for
//     themselves beyond the pages they share with templates (a sandbox without
//     templates has memory_mb, as before budgets);
//   - what the templates hold is measured after each checkpoint and restore answer, in
//     the background (measureBudget): the sum of their pss_anon_bytes, the anonymous
//     pages they hold, a page shared with k other processes counting 1/(k+1). Pages a
//     template shares with a live process therefore count in part (k/(k+1) of a page k
//     templates share with one live process): the figure is at least the templates'
//     own share (what no live process maps), and over it by a part of what they still
//     share with the live processes;
//   - a checkpoint is admitted (admitCheckpoint, before it takes any lock) while its
//     sandbox's templates are within its budget and every sandbox's within the total;
//     else it waits for room (its wait_ms, or defaultBudgetWait), polling, and then
//     fails with 507 (errdefs.ErrTemplateBudget) naming the budget, the usage and what
//     to do. The admission reads only the sandbox's cgroup usage (one pread, kept open)
//     while that is under the budget: the templates' anonymous pages are charged to
//     the sandbox, so they cannot hold more than it uses. Past that it adds what the
//     sandbox came to use since the last measure to that measure, and walks the
//     templates' page tables again (smaps_rollup, about 1 ms per 100 MB) only when that
//     bound is over the budget. For the total, one read of the daemon's memory cgroup
//     (its sandboxes' sum) bounds every sandbox's templates while under the total; past
//     it, each sandbox's bound, and walks of all of them only when that is over.
//
// The budget is soft by one checkpoint: one admitted just under it makes templates that
// share the live processes' pages at first, and the budget is passed as those rewrite
// them; the next checkpoint waits. The kernel's limit is the hard one.
//
// Over budget, templates are evicted (evictForRoom): those of unpinned nodes whose
// durable image is complete (durable.go), least recently restored first; a pinned
// node's never. The node's next restore brings them back from its image. With no such
// node, a checkpoint over budget waits, then fails.

// defaultBudgetWait is how long a checkpoint without a wait_ms waits for room under its
// template budgets: long enough for a concurrent DELETE of nodes, short enough for an
// agent that is told to remove nodes.
const defaultBudgetWait = time.Second

// budgetPoll is how often a waiting checkpoint measures again.
const budgetPoll = 100 * time.Millisecond

// minMeasureGap spaces the walks of a sandbox's templates after answers: an MCTS
// step every few ms would otherwise walk every template of the tree each time.
const minMeasureGap = 250 * time.Millisecond

// budgetMeasure is what measureBudget last found of a sandbox's templates (sb.budget,
// under sb.mu).
type budgetMeasure struct {
	used   int64     // the templates' pss_anon_bytes (or a bound on it, see exact)
	usage  int64     // the sandbox's cgroup usage when measured
	exact  bool      // used was measured; else it is the usage, a bound
	at     time.Time // zero: never measured
	pinned int64     // of used, the templates of pinned nodes (exact measures only)
	pnodes int       // pinned nodes with templates in the sandbox
}

// templateBudget is s's template budget in bytes, -1 for none. The record's value is
// fixed at create; a record older than budgets (0) has the daemon's default.
func (m *Manager) templateBudget(s *sb) int64 {
	switch mb := s.budgetMB; {
	case mb < 0:
		return -1
	case mb == 0:
		return m.cfg.TemplateBudgetBytes
	default:
		return mb << 20
	}
}

// fitKernelLimit sets s's kernel memory limit to memory_mb plus what its templates
// could come to hold alone, up to their budget: the sum of their anonymous resident
// memory (RssAnon, read once per template: a stopped process's does not change). A
// template's pages are all it can ever hold alone (it is stopped), so the live
// processes keep memory_mb whatever they rewrite; and without templates the limit is
// memory_mb, a sandbox's containment as before budgets. (The sum counts a page several
// templates share once per template: the limit is then higher than needed, up to
// memory_mb plus the budget.) Called after each checkpoint, before its answer, with grow
// (its new templates: nothing to do once the limit is at its most), and after answers
// and node removals (it comes down; the kernel refuses, EBUSY, while it cannot reclaim
// to the lower limit: then the next call tries again).
func (m *Manager) fitKernelLimit(s *sb, grow bool) { m.fitKernelLimitPlus(s, grow, 0) }

// fitKernelLimitPlus is fitKernelLimit counting coming templates that will hold extra
// bytes alone (a checkpoint's early answer, before its fork: checkpoint.go).
func (m *Manager) fitKernelLimitPlus(s *sb, grow bool, extra int64) {
	s.limitMu.Lock()
	defer s.limitMu.Unlock()
	want, ok := m.kernelLimitWant(s, grow, extra)
	if !ok || want == s.kernelLimit {
		return
	}
	s.mu.Lock()
	rt := s.memRT
	s.mu.Unlock()
	if err := rt.SetMemoryLimit(want); err != nil {
		m.log.Debug("template budget: kernel memory limit not changed", "sandbox", s.rec.ID, "from", s.kernelLimit, "to", want, "err", err)
		return
	}
	s.kernelLimit = want
}

// kernelLimitAfter is the kernel memory limit fitKernelLimitPlus(s, grow, extra) sets,
// without setting it: an early answer reports it, and its checkpoint sets it after the
// answer, before the fork (the processes run nothing in between: a write of the
// cgroup's limit, 60-100 us of the answer in the daemon, loaded, is off its path).
func (m *Manager) kernelLimitAfter(s *sb, grow bool, extra int64) int64 {
	s.limitMu.Lock()
	defer s.limitMu.Unlock()
	if want, ok := m.kernelLimitWant(s, grow, extra); ok {
		return want
	}
	return s.kernelLimit
}

// kernelLimitWant is the limit fitKernelLimitPlus would set, ok false when it sets
// none (no budget of the sandbox's own, the limit at its most already when it grows, or
// the sandbox not running).
// +checklocks:s.limitMu
func (m *Manager) kernelLimitWant(s *sb, grow bool, extra int64) (int64, bool) {
	b := m.templateBudget(s)
	if b <= 0 {
		return 0, false // no budget of their own: memory_mb, templates included
	}
	if grow && s.kernelLimit >= s.rec.Limits.MemoryBytes+b {
		return 0, false // at its most already: a checkpoint's templates only add
	}
	m.mu.Lock()
	var ts []*procTemplate
	for _, tl := range m.templates {
		for _, t := range tl {
			if t.sandbox == s.rec.ID {
				ts = append(ts, t)
			}
		}
	}
	m.mu.Unlock()
	sum := extra
	for _, t := range ts {
		if t.rssAnon == 0 {
			t.rssAnon = max(rssAnon(t.tmpl.HostPid), 1) // 1: read (a template gone holds nothing)
		}
		sum += t.rssAnon
	}
	s.mu.Lock()
	rt := s.memRT
	s.mu.Unlock()
	if rt == nil {
		return 0, false
	}
	return s.rec.Limits.MemoryBytes + min(b, sum), true
}

// rssAnon is hostPid's anonymous resident memory, RssAnon, from /proc/PID/statm:
// resident less shared (RssFile + RssShmem), kernel counters read without a walk; 0 if
// gone. (statm, not status: a status read took 75 µs p50 here, on a checkpoint's path.)
func rssAnon(hostPid int) int64 {
	st, _ := procfs.ReadStatm(hostPid) // gone: zero, nothing held
	return st.AnonBytes()
}

// kernelLimitNow is the kernel memory limit fitKernelLimit last wrote.
func (s *sb) kernelLimitNow() int64 {
	s.limitMu.Lock()
	defer s.limitMu.Unlock()
	return s.kernelLimit
}

// sandboxUsage is s's memory cgroup usage now (0 when it is not running): one pread of
// a file kept open.
func sandboxUsage(s *sb) int64 {
	s.mu.Lock()
	rt := s.memRT
	s.mu.Unlock()
	if rt == nil {
		return 0
	}
	return rt.MemoryUsage()
}

// bound is what s's templates may hold now, at most, from its last measure: the
// templates' anonymous pages are charged to s, so they hold no more than its usage, and
// since the measure they gained no more than its usage grew (a live process's
// copy-on-write charges the copy). (Exceptions make the bound lenient, never strict:
// a live process's exit or a restore hands pages it shared with templates to them
// without growth; the next measure, after that answer, sees them.)
func (s *sb) bound(usage int64) int64 {
	s.mu.Lock()
	last := s.budget
	s.mu.Unlock()
	if last.at.IsZero() {
		return usage
	}
	return min(usage, last.used+max(0, usage-last.usage))
}

// othersBound bounds what every sandbox's templates but except's hold now, for the
// total: the daemon's memory cgroup's usage (one read: its sandboxes' sum) less except's
// when that is within total, else each sandbox's bound.
func (m *Manager) othersBound(except *sb, exceptUsage, total int64) int64 {
	if all := cgroup.V1MemoryUsageAll(); all > 0 && all <= total {
		return max(0, all-exceptUsage)
	}
	m.mu.Lock()
	var others []*sb
	for _, s := range m.sandboxes {
		if s != except {
			others = append(others, s)
		}
	}
	m.mu.Unlock()
	var sum int64
	for _, s := range others {
		sum += s.bound(sandboxUsage(s))
	}
	return sum
}

// measureBudget measures what s's templates hold and records it (sb.budget). With walk
// false, a sandbox using under half its budget, while every sandbox's measures are
// under half the total, records its usage as a bound instead of walking the templates
// (an MCTS step would otherwise walk every template of its tree, about 1 ms per 100 MB,
// once a second); maxAge is the templates' cache (templateMemory).
func (m *Manager) measureBudget(s *sb, walk bool, maxAge time.Duration) budgetMeasure {
	usage := sandboxUsage(s)
	b := m.templateBudget(s)
	if !walk {
		s.mu.Lock()
		last := s.budget
		s.mu.Unlock()
		switch {
		case (b < 0 || usage <= b/2) && m.totalUsed(s)+usage <= m.cfg.TemplateBudgetTotalBytes/2:
			bm := budgetMeasure{used: usage, usage: usage, at: time.Now()}
			s.mu.Lock()
			s.budget = bm
			s.mu.Unlock()
			return bm
		case last.exact && time.Since(last.at) < minMeasureGap:
			return last // its bound (sb.bound) holds until the next
		}
	}
	perNode, perSandbox, _ := m.templateCosts(nil, s.rec.ID, maxAge)
	bm := budgetMeasure{usage: usage, exact: true, at: time.Now()}
	if t := perSandbox[s.rec.ID]; t != nil {
		bm.used = t.PssAnon
	}
	spares, _ := m.sparesPSS(s)
	bm.used += spares // its spares' copies count as templates do (spares.go)
	m.mu.Lock()
	for id, t := range perNode {
		if n := m.nodes[id]; n != nil && n.pinned {
			bm.pinned += t.PssAnon
			bm.pnodes++
		}
	}
	m.mu.Unlock()
	s.mu.Lock()
	s.budget = bm
	s.mu.Unlock()
	return bm
}

// totalUsed sums the last measures of every sandbox but except.
func (m *Manager) totalUsed(except *sb) int64 {
	m.mu.Lock()
	all := make([]*sb, 0, len(m.sandboxes))
	for _, s := range m.sandboxes {
		if s != except {
			all = append(all, s)
		}
	}
	m.mu.Unlock()
	var sum int64
	for _, s := range all {
		s.mu.Lock()
		sum += s.budget.used
		s.mu.Unlock()
	}
	return sum
}

// measureOthers measures the templates of every sandbox but except (for the total).
func (m *Manager) measureOthers(except *sb) {
	m.mu.Lock()
	var all []*sb
	for _, s := range m.sandboxes {
		if s != except {
			all = append(all, s)
		}
	}
	m.mu.Unlock()
	for _, s := range all {
		m.measureBudget(s, true, 0)
	}
}

// budgetCheck is what an admission compares: a sandbox's templates against its budget,
// and every sandbox's against the total.
type budgetCheck struct {
	sandbox     string
	budget      int64 // bytes; < 0: none
	used        int64 // the sandbox's templates (pss_anon)
	total       int64 // bytes; <= 0: none
	totalUsed   int64 // every sandbox's templates, this one's included
	pinned      int64 // of used, pinned nodes' templates
	evictable   int64 // of used, templates that could be evicted (a complete image, not pinned)
	topNodes    string
	nodesInSbox int
}

// over says what the checkpoint waits for ("" when it may go).
func (c budgetCheck) over() string {
	if c.budget >= 0 && c.used > c.budget {
		return fmt.Sprintf("sandbox %s's template budget: its checkpoints' templates hold %s of template_budget_mb %s", c.sandbox, mib(c.used), mib(c.budget))
	}
	if c.total > 0 && c.totalUsed > c.total {
		return fmt.Sprintf("the daemon's total template budget: the templates of every sandbox hold %s of %s (DELTABOX_TEMPLATE_BUDGET_TOTAL; this sandbox's hold %s)", mib(c.totalUsed), mib(c.total), mib(c.used))
	}
	return ""
}

// refusal is the 507 of a checkpoint that waited for room in vain.
func (c budgetCheck) refusal(waited time.Duration) error {
	what := c.over()
	pinned := ""
	if c.pinned > 0 {
		pinned = fmt.Sprintf("; %s of it pinned", mib(c.pinned))
	}
	return fmt.Errorf("checkpoint of %s waited %v for room under %s (%d nodes%s%s; none can be evicted: templates without a complete durable image, or pinned, are never dropped): remove nodes you will not restore (DELETE /v1/nodes/ID, deltabox tree rm ID, ckpt.remove() in Python), or create the sandbox with a larger template_budget_mb: %w",
		c.sandbox, roundDur(waited), what, c.nodesInSbox, c.topNodes, pinned, errdefs.ErrTemplateBudget)
}

// waitForRoom polls check until it finds room (nil), ctx ends, or deadline passes (the
// 507 naming the last check). evict is given each over-budget check first, to make room
// if it can.
func waitForRoom(ctx context.Context, deadline time.Time, check func(fresh bool) budgetCheck, evict func(budgetCheck) bool) error {
	t0 := time.Now()
	c := check(false)
	for first := true; ; first = false {
		if c.over() == "" {
			return nil
		}
		if !first || evict == nil || !evict(c) {
			left := time.Until(deadline)
			if left <= 0 {
				return c.refusal(time.Since(t0))
			}
			select {
			case <-ctx.Done():
				return fmt.Errorf("checkpoint of %s abandoned while it waited for room under %s: %w", c.sandbox, c.over(), ctx.Err())
			case <-time.After(min(left, budgetPoll)):
			}
		}
		c = check(true)
		if c.over() != "" && evict != nil && evict(c) {
			c = check(true)
		}
	}
}

// admitCheckpoint admits a checkpoint of s under the template budgets, waiting for room
// up to wait (0: defaultBudgetWait); see the top of this file. It holds no lock while it
// waits. It returns how long it waited.
func (m *Manager) admitCheckpoint(ctx context.Context, s *sb, wait time.Duration) (time.Duration, error) {
	if !m.fastPath(s) {
		return 0, nil // no templates
	}
	if wait <= 0 {
		wait = defaultBudgetWait
	}
	t0 := time.Now()
	check := func(fresh bool) budgetCheck {
		c := budgetCheck{sandbox: s.rec.ID, budget: m.templateBudget(s), total: m.cfg.TemplateBudgetTotalBytes}
		usage := sandboxUsage(s)
		// A spare's pages are mostly its node's templates', charged to the family's
		// holder, not to s: its usage does not bound them (over-counted here at worst,
		// which only makes the check measure).
		spares, _ := m.sparesPSS(s)
		c.used = s.bound(usage) + spares
		c.totalUsed = c.used + m.othersBound(s, usage, c.total)
		if fresh || c.over() != "" {
			bm := m.measureBudget(s, true, 0)
			c.used, c.pinned = bm.used, bm.pinned
			c.totalUsed = c.used + m.othersBound(s, bm.usage, c.total)
			if c.total > 0 && c.totalUsed > c.total {
				// Over the total on the others' bounds: measure them.
				m.measureOthers(s)
				c.totalUsed = c.used + m.othersBound(s, bm.usage, c.total)
			}
			if c.over() != "" {
				c.nodesInSbox, c.topNodes = m.budgetNodes(s)
			}
		}
		return c
	}
	err := waitForRoom(ctx, t0.Add(wait), check, func(c budgetCheck) bool {
		// Spares first: they are only ahead-of-time work, made again when wanted.
		return m.dropSparesForRoom(s, c) || m.evictForRoom(s, c) > 0
	})
	return time.Since(t0), err
}

// budgetNodes counts s's nodes with templates and names the three that hold most.
func (m *Manager) budgetNodes(s *sb) (int, string) {
	perNode, _, _ := m.templateCosts(nil, s.rec.ID, time.Second)
	return len(perNode), topNodes(perNode, 3)
}

// afterOpMeasure queues the measure of s's templates after an answer.
func (m *Manager) afterOpMeasure(s *sb) {
	m.afterAnswer(s, func() {
		m.fitKernelLimit(s, false)
		m.measureBudget(s, false, 0)
	})
}

// ---- eviction ----

// imageComplete reports whether node's process image is complete, so that its
// templates may be dropped and its processes restored from the image: Manager.imageDone,
// which durable images (issue 17, item 2) will set; until then, never.
func (m *Manager) imageComplete(node string) bool {
	return m.imageDone != nil && m.imageDone(node)
}

// evictionOrder lists s's nodes whose templates may be evicted, least recently restored
// (or, never restored, made) first: unpinned, with a complete image. Precondition: m.mu.
// +checklocks:m.mu
func (m *Manager) evictionOrder(s *sb) []string {
	var ids []string
	for id, ts := range m.templates {
		n := m.nodes[id]
		if n == nil || n.pinned || !m.imageComplete(id) {
			continue
		}
		for _, t := range ts {
			if t.sandbox == s.rec.ID {
				ids = append(ids, id)
				break
			}
		}
	}
	nodes := m.nodes // for sort.Slice's closure, which runs here, under m.mu
	used := func(id string) time.Time {
		n := nodes[id]
		if n.lastRestore.IsZero() {
			return n.Created
		}
		return n.lastRestore
	}
	sort.Slice(ids, func(i, j int) bool { return used(ids[i]).Before(used(ids[j])) })
	return ids
}

// evictForRoom drops the templates of s's evictable nodes (evictionOrder) until the
// check's excess is freed, and returns how many nodes it evicted. It takes s.tmplMu, so
// that no restore is forking from what it drops.
func (m *Manager) evictForRoom(s *sb, c budgetCheck) int {
	need := max(c.used-c.budget, c.totalUsed-c.total)
	if c.budget < 0 {
		need = c.totalUsed - c.total
	}
	n := 0
	defer func() {
		if n > 0 {
			s.mu.Lock()
			s.stats.EvictedNodes += n
			s.mu.Unlock()
		}
	}()
	s.tmplMu.Lock()
	defer s.tmplMu.Unlock()
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, id := range m.evictionOrder(s) {
		if need <= 0 {
			break
		}
		var keep []*procTemplate
		for _, t := range m.templates[id] {
			if t.sandbox != s.rec.ID {
				keep = append(keep, t)
				continue
			}
			if mem, err := templateMemory(t.tmpl.HostPid, time.Minute); err == nil {
				need -= mem.PssAnon
			}
			t.tmpl.Kill()
		}
		m.templates[id] = keep
		if len(keep) == 0 {
			delete(m.templates, id)
		}
		n++
		m.log.Info("evicted a node's templates over the template budget", "sandbox", s.rec.ID, "node", id)
	}
	if n > 0 {
		m.afterOpMeasure(s) // the kernel limit comes down, and they are measured again
	}
	return n
}

// ---- pins ----

// PinNode pins (or unpins) a node: a hint that the client will restore it again, so
// that its templates are never evicted over a template budget.
func (m *Manager) PinNode(id string, pinned bool) (*NodeInfo, error) {
	if err := m.awaitNode(context.Background(), id); err != nil { // a node answered early (answer.go)
		return nil, err
	}
	m.mu.Lock()
	n := m.nodes[id]
	if n != nil {
		n.pinned = pinned
	}
	m.mu.Unlock()
	if n == nil {
		return nil, fmt.Errorf("no node %q (deltabox tree lists them): %w", id, errdefs.ErrNotFound)
	}
	return m.nodeInfo(id), nil
}

// budgetInfo is SandboxInfo's template_budget: s's templates (perSandbox, measured by
// the caller) against its budget and the total.
func (m *Manager) budgetInfo(s *sb, used *TemplateInfo, perNode map[string]*TemplateInfo) *TemplateBudget {
	tb := &TemplateBudget{BudgetBytes: m.templateBudget(s), TotalBudgetBytes: m.cfg.TemplateBudgetTotalBytes}
	if used != nil {
		tb.UsedBytes = used.PssAnon
	}
	m.mu.Lock()
	for id, t := range perNode {
		if n := m.nodes[id]; n != nil && n.pinned {
			tb.PinnedBytes += t.PssAnon
			tb.PinnedNodes++
		}
		if n := m.nodes[id]; n != nil && !n.pinned && m.imageComplete(id) {
			tb.EvictableBytes += t.PssAnon
		}
	}
	m.mu.Unlock()
	tb.TotalUsedBytes = m.totalUsed(s) + tb.UsedBytes
	tb.KernelLimitBytes = s.kernelLimitNow()
	return tb
}

// TemplateBudget is SandboxInfo's template_budget. The wire form is defined once, in
// apitypes.
type TemplateBudget = apitypes.TemplateBudget

// budgetWarning warns in a checkpoint's or restore's answer when s's templates hold over
// half their budget. It walks the templates only when the sandbox uses over half of it
// (the bound of admitCheckpoint), with the templates' one-second cache.
func (m *Manager) budgetWarning(res *OpResult, id string) {
	s, err := m.get(id)
	if err != nil {
		return
	}
	b := m.templateBudget(s)
	if b <= 0 || sandboxUsage(s) <= b/2 {
		return
	}
	perNode, perSandbox, _ := m.templateCosts(nil, id, time.Second)
	t := perSandbox[id]
	if t == nil || t.PssAnon <= b/2 {
		return
	}
	res.Memory.Templates = t
	res.Warnings = append(res.Warnings, fmt.Sprintf("the templates of this sandbox's checkpoints hold %s of their %s budget (template_budget_mb; %d processes kept by %d nodes%s): past it, checkpoints wait and then fail with 507. Remove the nodes you no longer need (DELETE /v1/nodes/ID, deltabox tree rm ID, ckpt.remove() in Python), or create the sandbox with a larger template_budget_mb",
		mib(t.PssAnon), mib(b), t.Processes, len(perNode), topNodes(perNode, 3)))
}

// roomForImage makes room in s's template budget, before a restore brings node's
// templates back from its image, for what they will hold (the image's full bytes: a
// restored template shares no page with the others). A restore is not admitted like a
// checkpoint (it never waits): it evicts what it can and goes on. Without it, restores
// from the images of many nodes (bench durable: 11 nodes of a 500 MB python) kept a
// template each until the sandbox's memory cgroup was full and the kernel's OOM killer
// took one, perhaps a live process. Precondition: s.opMu held, s.tmplMu not held
// (evictForRoom takes it).
// +checklocks:s.opMu
// +checklocksexclude:s.tmplMu
func (m *Manager) roomForImage(s *sb, node string) {
	b := m.templateBudget(s)
	in := m.imageInfo(node)
	if b <= 0 || in == nil || in.FullBytes <= 0 {
		return
	}
	bm := m.measureBudget(s, true, 0)
	if bm.used+in.FullBytes <= b {
		return
	}
	// As a check whose budget is what is left for the others (never below 0: a
	// negative budget reads as none).
	m.evictForRoom(s, budgetCheck{sandbox: s.rec.ID, budget: max(b-in.FullBytes, 0), used: bm.used})
}
