package state

import (
	"sort"
	"sync"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/fastpath"
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
	}
	c.FilesOnly++
}

// countFailed counts a failed or refused checkpoint or restore; why is "ineligible",
// "template_gone" or "".
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
