package state

import (
	"context"
	"fmt"
	"slices"
	"sort"

	"deltabox/internal/apitypes"
	"deltabox/internal/errdefs"
	"deltabox/internal/store"
)

// NodeInfo is what the API shows of a node. The wire form is defined once, in apitypes.
type NodeInfo = apitypes.NodeInfo

// +checklocks:m.mu
func (m *Manager) newNodeID() string {
	for {
		id := randomID("n")[:7]
		if _, ok := m.nodes[id]; !ok && !m.idsTaken[id] && m.pending[id] == nil {
			if _, ok := m.sandboxes[id]; !ok {
				return id
			}
		}
	}
}

// nodeInfo describes one node. It is on every restore's answer, so it takes the node's
// children from m.kids instead of a walk of every node (Tree does that once for all
// nodes): with the walk, a checkpoint's answer took 14-19 µs at p50 for its node in
// trees of 150-200 nodes on a loaded two-CPU machine (docs/research/filesonly), and
// that grows with the tree.
func (m *Manager) nodeInfo(id string) *NodeInfo {
	m.mu.Lock()
	defer m.mu.Unlock()
	ch, st := map[string][]string{}, map[string][]string{}
	// nodes for sort.Slice's closure, which runs here, under m.mu; an id no longer in it
	// (none: kids follows nodes) is left out rather than looked up.
	c, nodes := slices.Clone(m.kids[id]), m.nodes
	c = slices.DeleteFunc(c, func(k string) bool { return nodes[k] == nil })
	sort.Slice(c, func(i, j int) bool { return nodes[c[i]].Created.Before(nodes[c[j]].Created) })
	ch[id] = c
	for _, s := range m.sandboxes {
		if s.rec.Head == id {
			st[id] = append(st[id], s.rec.ID)
		}
	}
	sort.Strings(st[id])
	return m.nodeInfoLocked(id, ch, st)
}

// addNodeLocked puts nd in the tree: m.nodes, and its parent's children (m.kids).
// +checklocks:m.mu
func (m *Manager) addNodeLocked(nd *node) {
	m.nodes[nd.ID] = nd
	if m.kids == nil {
		m.kids = map[string][]string{}
	}
	m.kids[nd.Parent] = append(m.kids[nd.Parent], nd.ID)
}

// removeNodeLocked takes node id out of the tree (m.nodes, its parent's children).
// +checklocks:m.mu
func (m *Manager) removeNodeLocked(id string) {
	n := m.nodes[id]
	if n == nil {
		return
	}
	delete(m.nodes, id)
	ks := slices.DeleteFunc(m.kids[n.Parent], func(k string) bool { return k == id })
	if len(ks) == 0 {
		delete(m.kids, n.Parent)
	} else {
		m.kids[n.Parent] = ks
	}
}

// childIndex maps node id to its children. Precondition: mu held.
// +checklocks:m.mu
func (m *Manager) childIndex() map[string][]string {
	ch := map[string][]string{}
	for _, n := range m.nodes {
		ch[n.Parent] = append(ch[n.Parent], n.ID)
	}
	nodes := m.nodes // for sort.Slice's closure, which runs here, under m.mu
	for k := range ch {
		c := ch[k]
		sort.Slice(c, func(i, j int) bool { return nodes[c[i]].Created.Before(nodes[c[j]].Created) })
	}
	return ch
}

// standing maps node id to the sandboxes on it. Precondition: mu held.
// +checklocks:m.mu
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

// +checklocks:m.mu
func (m *Manager) nodeInfoLocked(id string, ch, st map[string][]string) *NodeInfo {
	n := m.nodes[id]
	if n == nil {
		return nil
	}
	in := &NodeInfo{
		Node:       apiNode(n.Node),
		Durable:    m.st.Index.Durable(n.seq),
		Children:   ch[id],
		Sandboxes:  st[id],
		Depth:      len(m.stack(id)),
		Pinned:     n.pinned,
		CompleteMS: n.completeMS,
	}
	if !n.lastRestore.IsZero() {
		t := n.lastRestore.UTC()
		in.LastRestored = &t
	}
	in.ProcessImage = m.imageInfo(id)
	return in
}

// apiNode is what the API shows of a node's index record (store.Node): the two are
// separate types, so that neither the wire nor the disk changes with the other.
func apiNode(n store.Node) apitypes.Node {
	return apitypes.Node{ID: n.ID, Parent: n.Parent, Image: n.Image, Created: n.Created, Label: n.Label,
		Sandbox: n.Sandbox, Layer: n.Layer, Own: n.Own, Bytes: n.Bytes, SquashLayer: n.Squash}
}

// Tree is the whole snapshot tree. The wire form is defined once, in apitypes.
type Tree = apitypes.Tree

// Tree returns every node.
func (m *Manager) Tree() *Tree {
	m.awaitPending() // the nodes of checkpoints that answered early (answer.go)
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
	if err := m.awaitNode(context.Background(), id); err != nil { // a node answered early (answer.go)
		return nil, err
	}
	if n := m.nodeInfo(id); n != nil {
		perNode, _, _ := m.templateCosts([]string{id}, "", 0)
		n.Templates = perNode[id]
		n.Spares = m.sparesOf(id)
		return n, nil
	}
	return nil, fmt.Errorf("no node %q (deltabox tree lists them): %w", id, errdefs.ErrNotFound)
}

// RemoveNode removes node id and its whole subtree, refusing if a sandbox stands on
// any node of it. Layers owned by the removed nodes are deleted after the index
// stops naming them.
func (m *Manager) RemoveNode(id string) ([]string, error) {
	if err := m.awaitNode(context.Background(), id); err != nil { // a node answered early (answer.go)
		return nil, err
	}
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
	m.dropNodeSpares(sub...)
	m.mu.Lock()
	var ops []store.Op
	var dirs []string
	// The sandboxes whose templates go measure them again (budget.go), in the
	// background: their last measures count them still.
	for _, n := range sub {
		for _, t := range m.templates[n] {
			if s := m.sandboxes[t.sandbox]; s != nil {
				m.afterOpMeasure(s)
			}
		}
	}
	m.dropTemplatesLocked(sub)
	for _, n := range sub {
		if m.nodes[n].Own {
			dirs = append(dirs, m.st.LayerDir(m.nodes[n].Layer))
		}
		if sq := m.nodes[n].Squash; sq != 0 {
			dirs = append(dirs, m.st.LayerDir(sq))
		}
		dirs = append(dirs, m.importedDir(n)) // transfer.go: an imported node's process image
		m.removeNodeLocked(n)
		delete(m.procRecs, n)
		ops = append(ops, store.Op{DeleteNode: n})
		if m.img != nil {
			dirs = append(dirs, m.imagesDir(n), m.criuTreesDir(n))
			m.forgetImage(n)
		}
	}
	ops = append(ops, store.Op{After: func() {
		for _, d := range dirs {
			_ = store.RemoveAll(d) // what stays, the start-up sweeps remove
		}
		m.imagesRemoved()
	}})
	m.st.Index.Apply(ops...)
	m.diskFreed.Add(1) // its images counted against its sandbox's quota (diskquota.go)
	return sub, nil
}

// Sync waits until everything done so far is durable.
func (m *Manager) Sync() error { return m.st.Index.WaitDurable(m.st.Index.Seq()) }

// Images lists the store's images.
func (m *Manager) Images() ([]store.Image, error) { return m.st.Images() }
