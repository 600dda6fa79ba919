package state

import (
	"fmt"
	"sort"
	"strings"
	"sync"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/fastpath"
	"deltabox/internal/procfs"
)

// PathCounts counts a sandbox's checkpoints or restores per path: files and processes
// (the fast path) or files only, with the reason, and the operations that failed or
// were refused. The wire form is defined once, in apitypes.
type PathCounts = apitypes.PathCounts

type opPath int

const (
	pathProcess opPath = iota
	pathFastPathOff
	pathNoSessions
	pathOtherSandbox
	pathRunAs

	pathNoTemplates = pathNoSessions // a restore's name for it
)

// countPath counts a completed checkpoint or restore.
func (m *Manager) countPath(s *sb, op string, p opPath) {
	s.mu.Lock()
	defer s.mu.Unlock()
	c := &s.stats.CheckpointPaths
	if op == "restore" {
		c = &s.stats.RestorePaths
		s.stats.Restores++
		if p == pathProcess {
			s.stats.ProcessRestores++
		}
	} else {
		s.stats.Checkpoints++
		if p == pathProcess {
			s.stats.ProcessCheckpoints++
		}
	}
	switch p {
	case pathProcess:
		c.Process++
		return
	case pathFastPathOff:
		c.FastPathOff++
	case pathNoSessions:
		c.NoSessions++
	case pathOtherSandbox:
		c.OtherSandbox++
	case pathRunAs:
		c.RunAs++
	}
	c.FilesOnly++
}

// countFailed counts a failed or refused checkpoint or restore; why is "ineligible",
// "template_gone", "over_budget" or "".
func (m *Manager) countFailed(s *sb, op, why string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	c := &s.stats.CheckpointPaths
	if op == "restore" {
		c = &s.stats.RestorePaths
	}
	c.Failed++
	switch why {
	case "ineligible":
		c.Ineligible++
	case "template_gone":
		c.TemplateGone++
	case "over_budget":
		c.OverBudget++
	}
}

// TemplateInfo is what a node's process templates cost (fastpath.Memory); a sandbox's
// and the tree's totals have the same shape. The wire form is defined once, in apitypes.
type TemplateInfo = apitypes.TemplateInfo

// templateCosts reads the memory of the templates of the nodes given (all if nil) and,
// if sandbox is not empty, of that sandbox only, per node and per sandbox. It reads /proc
// outside m.mu: smaps_rollup walks the page tables, 0.1-2 ms per template of a python
// with 50 MB of heap, so figures younger than maxAge are taken from a cache (sandbox
// info, which clients may poll, passes a second; the tree and node answers 0).
func (m *Manager) templateCosts(nodes []string, sandbox string, maxAge time.Duration) (perNode, perSandbox map[string]*TemplateInfo, total *TemplateInfo) {
	type one struct {
		node, sandbox, session string
		host                   int
	}
	var all []one
	m.mu.Lock()
	if nodes == nil {
		for n := range m.templates {
			nodes = append(nodes, n)
		}
	}
	for _, n := range nodes {
		for _, t := range m.templates[n] {
			if sandbox != "" && t.sandbox != sandbox {
				continue
			}
			all = append(all, one{n, t.sandbox, t.session, t.tmpl.HostPid})
		}
	}
	m.mu.Unlock()
	perNode, perSandbox, total = map[string]*TemplateInfo{}, map[string]*TemplateInfo{}, &TemplateInfo{}
	for _, o := range all {
		mem, err := templateMemory(o.host, maxAge)
		if err != nil {
			continue // gone
		}
		for _, ti := range []*TemplateInfo{get(perNode, o.node), get(perSandbox, o.sandbox), total} {
			ti.Processes++
			fastpath.AddMemory(&ti.Memory, mem)
		}
		if o.session == "" {
			continue // a process outside the sessions: counted, not named
		}
		pn := perNode[o.node]
		pn.Sessions = append(pn.Sessions, o.session)
		sort.Strings(pn.Sessions)
	}
	return perNode, perSandbox, total
}

func get(m map[string]*TemplateInfo, k string) *TemplateInfo {
	if m[k] == nil {
		m[k] = &TemplateInfo{}
	}
	return m[k]
}

// memCache keeps the last smaps_rollup figures of each template (by host PID).
var memCache struct {
	sync.Mutex
	// +checklocks:Mutex
	m map[int]memEntry
}

type memEntry struct {
	at  time.Time
	mem fastpath.Memory
}

func templateMemory(host int, maxAge time.Duration) (fastpath.Memory, error) {
	now := time.Now()
	memCache.Lock()
	e, ok := memCache.m[host]
	memCache.Unlock()
	if ok && now.Sub(e.at) < maxAge {
		return e.mem, nil
	}
	mem, err := fastpath.ReadMemory(host)
	memCache.Lock()
	defer memCache.Unlock()
	if memCache.m == nil || len(memCache.m) > 4096 {
		memCache.m = map[int]memEntry{} // forget the dead, wholesale
	}
	if err != nil {
		delete(memCache.m, host)
		return mem, err
	}
	memCache.m[host] = memEntry{now, mem}
	return mem, nil
}

// ---- memory in answers: what templates hold of the limit ----

// OpMemory is a sandbox's memory after a checkpoint or restore. The wire form is
// defined once, in apitypes.
type OpMemory = apitypes.OpMemory

// memoryNow is s's limit and usage (one read of its memory cgroup). Precondition:
// s.opMu held.
// +checklocks:s.opMu
func (m *Manager) memoryNow(s *sb) *OpMemory {
	if s.rt == nil {
		return nil
	}
	mem := &OpMemory{LimitBytes: s.rec.Limits.MemoryBytes, UsageBytes: s.rt.MemoryUsage()}
	if b := m.templateBudget(s); b > 0 {
		mem.TemplateBudgetBytes, mem.KernelLimitBytes = b, s.kernelLimitNow()
	}
	return mem
}

// reportMemory completes res.Memory after an operation of sandbox id, outside its
// locks: the resident memory of the templates of node (a checkpoint's new node; "" for
// a restore), from /proc/PID/statm (a few µs each: it walks nothing); and, only when
// the sandbox uses over half its limit, what all of its templates hold (smaps_rollup:
// about 1 ms per 100 MB of template, too much for every answer; below half the limit
// the templates, which are in the sandbox's memory cgroup, cannot hold more than half
// of it), with a warning when they hold over half the limit. A template's share is its
// pss_bytes: pages it shares with the live processes or other templates are split
// between them.
func (m *Manager) reportMemory(res *OpResult, id, node string) {
	mem := res.Memory
	if mem == nil {
		return
	}
	if node != "" {
		m.mu.Lock()
		var hosts []int
		for _, t := range m.templates[node] {
			if t.sandbox == id {
				hosts = append(hosts, t.tmpl.HostPid)
			}
		}
		m.mu.Unlock()
		for _, h := range hosts {
			if st, err := procfs.ReadStatm(h); err == nil {
				mem.NodeTemplatesRSS += st.ResidentBytes()
			}
		}
	}
	if mem.TemplateBudgetBytes > 0 {
		// Templates have a budget of their own (budget.go): the live processes keep
		// memory_mb whatever the templates hold, and checkpoints past the budget wait,
		// then fail. Warned past half of the budget, measured as admission would.
		m.budgetWarning(res, id)
		return
	}
	if mem.LimitBytes <= 0 || mem.UsageBytes <= mem.LimitBytes/2 {
		return
	}
	// Over half of it, but with page cache (which reclaim frees before any OOM kill):
	// the templates' walk is worth it only when what cannot be reclaimed is. It took
	// 10-60 ms with 100 templates of a 63 MB python beside a 1 GiB workspace (bench
	// latency: the answer came 15 ms after the checkpoint, p50, at fea7946+issue 16).
	s, err := m.get(id)
	if err != nil {
		return
	}
	s.mu.Lock()
	rt := s.memRT // not s.rt: the operation let go of opMu
	s.mu.Unlock()
	if rt == nil || rt.MemoryAnon() <= mem.LimitBytes/2 {
		return
	}
	perNode, perSandbox, _ := m.templateCosts(nil, id, time.Second)
	mem.Templates = perSandbox[id]
	if mem.Templates == nil || mem.Templates.Pss <= mem.LimitBytes/2 {
		return
	}
	res.Warnings = append(res.Warnings, fmt.Sprintf("the templates of this sandbox's checkpoints hold %s of its %s memory limit (%d processes kept by %d nodes%s; the sandbox uses %s): a process that writes more memory may be OOM-killed. Remove the nodes you no longer need (DELETE /v1/nodes/ID, deltabox tree rm ID, ckpt.remove() in Python; their templates go with them), or create the sandbox with more memory (memory_mb)",
		mib(mem.Templates.Pss), mib(mem.LimitBytes), mem.Templates.Processes, len(perNode), topNodes(perNode, 3), mib(mem.UsageBytes)))
}

// oomNote explains kills (how many processes the sandbox's memory limit made the kernel
// kill during a call) for that call's answer: the limit, and what holds the memory, the
// templates of the sandbox's checkpoints included (measured now: rare enough).
func (m *Manager) oomNote(id string, limit, kills int64) string {
	perNode, perSandbox, _ := m.templateCosts(nil, id, 0)
	held := ""
	if t := perSandbox[id]; t != nil && t.Pss >= 1<<20 {
		held = fmt.Sprintf("; %s of it are held by the templates of the sandbox's checkpoints (%d processes kept by %d nodes%s): remove the nodes you no longer need (DELETE /v1/nodes/ID, deltabox tree rm ID, ckpt.remove() in Python), or create the sandbox with more memory (memory_mb)",
			mib(t.Pss), t.Processes, len(perNode), topNodes(perNode, 3))
	} else {
		held = "; no checkpoint template holds any of it: the sandbox's own processes used it (create the sandbox with more memory: memory_mb)"
	}
	lim := mib(limit)
	if s, err := m.get(id); err == nil {
		if b := m.templateBudget(s); b > 0 {
			// The kernel's limit is memory_mb plus the templates' budget (budget.go).
			lim = fmt.Sprintf("%s, plus %s for its templates (template_budget_mb)", mib(limit), mib(b))
		}
	}
	return fmt.Sprintf("the sandbox's memory limit (%s) was reached: the kernel killed %d of its processes%s", lim, kills, held)
}

// topNodes names the n nodes whose templates hold the most (pss), for messages.
func topNodes(perNode map[string]*TemplateInfo, n int) string {
	ids := make([]string, 0, len(perNode))
	for id := range perNode {
		ids = append(ids, id)
	}
	sort.Slice(ids, func(i, j int) bool {
		if perNode[ids[i]].Pss != perNode[ids[j]].Pss {
			return perNode[ids[i]].Pss > perNode[ids[j]].Pss
		}
		return ids[i] < ids[j]
	})
	var parts []string
	for i, id := range ids {
		if i == n {
			parts = append(parts, "...")
			break
		}
		parts = append(parts, id+" "+mib(perNode[id].Pss))
	}
	if len(parts) == 0 {
		return ""
	}
	return ": " + strings.Join(parts, ", ")
}

func mib(b int64) string {
	if b >= 10<<20 || b%(1<<20) == 0 {
		return fmt.Sprintf("%d MiB", b>>20)
	}
	return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20))
}
