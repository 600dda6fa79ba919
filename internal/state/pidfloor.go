package state

import (
	"os"
	"path/filepath"

	"deltabox/internal/durable"
)

// pidFloor is the largest PID (in the sandbox) that a restore into s may have to give
// back: the live PIDs and template PIDs its nodes' process records name, the PIDs of
// their durable images (a copy of the template was dumped: its PID) and of their CRIU
// trees, their threads' included. boot raises the sandbox's next PID above it: a sandbox started afresh over its
// record (after a machine or daemon restart without adoption) counts PIDs from 2 again,
// and a thread that init's Go runtime made later took PID 15, which a restore from an
// image then needed (clone3 set_tid: EEXIST; 6 of 8 runs of
// TestDurableImageAfterSandboxesEnd on a loaded machine). Precondition: s not yet shared.
func (m *Manager) pidFloor(s *sb) int { return m.pidFloorFor(s.rec.ID, s.rec.ForkOf) }

// pidFloorFor is pidFloor of the nodes sandbox made and of forkOf and its ancestors.
func (m *Manager) pidFloorFor(sandbox, forkOf string) int {
	floor := 0
	var nodes []string
	m.mu.Lock()
	for id, n := range m.nodes {
		if n.Sandbox != sandbox && !m.forkLineLocked(forkOf, id) {
			continue
		}
		nodes = append(nodes, id)
		if pr := m.procRecs[id]; pr != nil {
			for _, t := range pr.Templates {
				floor = max(floor, t.Template.Proc.Pid, t.Template.SelfPid)
			}
		}
	}
	m.mu.Unlock()
	if m.img == nil {
		return floor
	}
	for _, id := range nodes {
		// Its image's, and an imported one's (processImageDir).
		var subs []string
		for _, dir := range []string{m.imagesDir(id), m.importedDir(id)} {
			ents, _ := os.ReadDir(dir)
			for _, e := range ents {
				subs = append(subs, filepath.Join(dir, e.Name()))
			}
		}
		for _, sub := range subs {
			if man, err := durable.ReadManifest(sub); err == nil {
				floor = max(floor, man.Pid, durable.ImageMaxPid(sub))
			}
			if tr, err := readTemplateRecord(sub); err == nil {
				floor = max(floor, tr.Template.Proc.Pid, tr.Template.SelfPid)
			}
		}
		if ts, err := m.criuTreesOf(id); err == nil && ts != nil {
			for _, t := range ts.trees {
				for _, p := range t.Pids {
					floor = max(floor, p)
				}
				// Its threads' IDs too: a branch's init made a thread that took a
				// python's second thread's ID (20, the process being 19), and the
				// tree's restore failed ("Unable to create a thread: -17", 1 run in 8
				// of TestForkCarriesTCPConnection).
				floor = max(floor, durable.ImageMaxPid(t.dir))
			}
		}
	}
	return floor
}

// pidsKept reports whether node's processes may be restored into s from their images:
// s made node, or s is a fork branch of node or of a descendant of it (fork.go), whose
// boot kept the PIDs of every node on that line free (pidFloor). Elsewhere an image's
// PIDs may be taken.
func (m *Manager) pidsKept(s *sb, node string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	if n := m.nodes[node]; n != nil && n.Sandbox == s.rec.ID {
		return true
	}
	return m.forkLineLocked(s.rec.ForkOf, node)
}

// forkLineLocked reports whether node is forkOf (a sandbox's fork parent: its record's
// ForkOf) or one of its ancestors. Precondition: m.mu held.
// +checklocks:m.mu
func (m *Manager) forkLineLocked(forkOf, node string) bool {
	for id := forkOf; id != ""; {
		if id == node {
			return true
		}
		n := m.nodes[id]
		if n == nil {
			return false
		}
		id = n.Parent
	}
	return false
}
