package state

import (
	"fmt"
	"time"

	"deltabox/internal/errdefs"
	"deltabox/internal/overlay"
	"deltabox/internal/store"
)

// newLayer allocates a layer id and creates its (empty) directories.
func (m *Manager) newLayer() (uint64, error) {
	m.mu.Lock()
	m.nextLayer++
	id := m.nextLayer
	m.mu.Unlock()
	if err := m.st.NewLayer(id); err != nil {
		return 0, fmt.Errorf("create layer %d: %w", id, err)
	}
	return id, nil
}

// stack returns the layer ids of node id's filesystem, top first (image excluded).
// Precondition: mu held.
// +checklocks:m.mu
func (m *Manager) stack(id string) []uint64 {
	var out []uint64
	var last uint64
	for id != "" {
		n := m.nodes[id]
		if n == nil {
			break
		}
		if n.Squash != 0 { // it stands for the rest of the stack
			if n.Squash != last {
				out = append(out, n.Squash)
			}
			break
		}
		if n.Layer != 0 && n.Layer != last {
			out = append(out, n.Layer)
			last = n.Layer
		}
		id = n.Parent
	}
	return out
}

// spec is the overlay of a sandbox standing on head with upper.
func (m *Manager) spec(image, head string, upper uint64) (overlay.Spec, error) {
	m.mu.Lock()
	ids := m.stack(head)
	m.mu.Unlock()
	var lowers []string
	for _, l := range ids {
		lowers = append(lowers, m.st.LayerFrozen(l))
	}
	lowers = append(lowers, m.st.ImageRootfs(image))
	if len(lowers) > overlay.MaxLowers {
		return overlay.Spec{}, fmt.Errorf("the node's stack has %d layers, over overlayfs's limit of %d: %w", len(lowers), overlay.MaxLowers, errdefs.ErrConflict)
	}
	return overlay.Spec{Lowers: lowers, Upper: m.st.LayerDiff(upper), Work: m.st.LayerWork(upper)}, nil
}

// upperUnchanged reports whether upper holds no change relative to top, the root
// directory of the layer under it: no entries, and the same attributes of "/" (a chmod,
// touch or setxattr of / changes only the upper's root directory: store.RootAttrs).
func upperUnchanged(upper, top string) bool {
	u, err := store.ReadUpper(upper)
	return err == nil && u.Empty && rootUnchanged(u.Root, top)
}

// rootUnchanged reports whether "/"'s attributes a are those of top's root.
func rootUnchanged(a *store.RootAttrs, top string) bool {
	b, err := store.ReadRootAttrs(top)
	return err == nil && a.Equal(b)
}

// freshUpper allocates an empty upper whose root directory has the attributes of top's
// (mode, owner, times, the sandbox's xattrs: overlayfs takes those of "/" from the
// upper's root alone).
func (m *Manager) freshUpper(top string) (uint64, error) {
	a, err := store.ReadRootAttrs(top)
	if err != nil {
		return 0, fmt.Errorf("read the attributes of /: %w", err)
	}
	return m.freshUpperWith(a)
}

// freshUpperWith allocates an empty upper whose root directory has the attributes a.
func (m *Manager) freshUpperWith(a *store.RootAttrs) (uint64, error) {
	var id uint64
	select {
	case id = <-m.uppers:
	default:
		var err error
		if id, err = m.newLayer(); err != nil {
			return 0, err
		}
	}
	if err := store.SetRootAttrs(m.st.LayerDiff(id), a); err != nil {
		return 0, withUndo(fmt.Errorf("give a new upper the attributes of /: %w", err), store.RemoveAll(m.st.LayerDir(id)))
	}
	return id, nil
}

// fillUppers keeps a few empty layers ready (mkdir of diff and work: ~100 us off the
// critical path) until Close. Ready layers are in no record, so a restart sweeps them.
func (m *Manager) fillUppers() {
	defer m.wg.Done()
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
			_ = store.RemoveAll(m.st.LayerDir(id)) // an unused layer: the start-up sweep removes it
			return
		}
	}
}

// ---- tree ----

// setState mounts spec for s and records how long the overlay and the namespace took.
// +checklocks:s.opMu
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
