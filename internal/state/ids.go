package state

import (
	"fmt"

	"deltabox/internal/errdefs"
	"deltabox/internal/sandbox"
	"deltabox/internal/sbinit"
)

// Host id ranges of sandboxes' user namespaces. Each sandbox maps its ids 0..65535
// onto a range of its own, idsFirst + k*idsPerSandbox for the lowest slot k no other
// sandbox holds, recorded with it (Sandbox.UIDBase) so that it keeps the range across
// restarts. The ranges start at 2^30, far above the ranges that useradd gives out in
// /etc/subuid (from 100000, 65536 at a time) and below the 2^31 that some tools take
// for negative; 16384 sandboxes fit.
//
// Distinct ranges are what keep sandboxes apart where the kernel compares ids: a root
// of one sandbox is not the owner of another's processes (kill, ptrace, /proc) nor of
// its files. Files on disk keep the ids they have inside (layers are seen through an
// idmapped mount: overlay.IDMapped), so a range says nothing about a layer's files.
const (
	idsFirst      = 1 << 30
	idsPerSandbox = 1 << 16
	idsSlots      = 1 << 14
)

// isolation returns the sandbox's user namespace setting, allocating its id range if
// its record has none (a new sandbox, or one recorded while isolation was off); nil
// with isolation off. It reports whether it changed the record. Precondition: s.opMu
// held (the record is s's).
func (m *Manager) isolation(s *sb) (*sandbox.Isolation, bool, error) {
	if m.cfg.NoIsolation {
		return nil, false, nil
	}
	changed := false
	if s.rec.UIDBase == 0 {
		m.mu.Lock()
		used := map[uint32]bool{}
		for _, o := range m.sandboxes {
			if o != s {
				used[o.rec.UIDBase] = true
			}
		}
		for k := uint32(0); k < idsSlots; k++ {
			if b := idsFirst + k*idsPerSandbox; !used[b] {
				s.rec.UIDBase = b
				break
			}
		}
		m.mu.Unlock()
		if s.rec.UIDBase == 0 {
			return nil, false, fmt.Errorf("all %d user id ranges are taken: remove sandboxes: %w", idsSlots, errdefs.ErrConflict)
		}
		changed = true
	}
	if (s.rec.UIDBase-idsFirst)%idsPerSandbox != 0 || s.rec.UIDBase < idsFirst {
		return nil, false, fmt.Errorf("sandbox %s records uid base %d, which is not one of the daemon's ranges", s.rec.ID, s.rec.UIDBase)
	}
	return &sandbox.Isolation{IDs: sbinit.IDRange{Base: s.rec.UIDBase, Size: idsPerSandbox}, Store: m.st.Root}, changed, nil
}

// IDBase is the host uid that root of sandbox id maps to, 0 if it has no user namespace
// (or no such sandbox).
func (m *Manager) IDBase(id string) uint32 {
	if m.cfg.NoIsolation {
		return 0
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if s, ok := m.sandboxes[id]; ok {
		return s.rec.UIDBase
	}
	return 0
}
