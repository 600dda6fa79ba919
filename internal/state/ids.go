package state

import (
	"errors"
	"fmt"
	"os"

	"deltabox/internal/errdefs"
	"deltabox/internal/hostids"
	"deltabox/internal/sandbox"
	"deltabox/internal/sbinit"
)

// Host id ranges of sandboxes' user namespaces. Each sandbox maps its ids 0..65535
// onto a range of its own, idsFirst + k*idsPerSandbox for the lowest slot k that no
// sandbox of any daemon of the host holds (package hostids keeps the host's record),
// recorded with it (Sandbox.UIDBase) so that it keeps the range across restarts. The
// ranges start at 2^30, far above the ranges that useradd gives out in /etc/subuid
// (from 100000, 65536 at a time) and below the 2^31 that some tools take for negative;
// 16384 sandboxes fit.
//
// Distinct ranges are what keep sandboxes apart where the kernel compares ids: a root
// of one sandbox is not the owner of another's processes (kill, ptrace, /proc) nor of
// its files, and the first id of the range owns the sandbox's user namespace, to which
// the kernel charges the sandbox's per-user budgets (sbinit.startIn). Files on disk
// keep the ids they have inside (layers are seen through an idmapped mount:
// overlay.IDMapped), so a range says nothing about a layer's files.
const (
	idsFirst      = 1 << 30
	idsPerSandbox = 1 << 16
	idsSlots      = 1 << 14
)

// isolation returns the sandbox's user namespace setting, claiming its id range in the
// host's record: the range its record names, or a new one if it names none (a new
// sandbox, or one recorded while isolation was off) or, when mayMove, if another
// daemon's sandbox holds it now (the host's record was lost, or predates it: the
// sandbox's init is not running, so a new range costs nothing). nil with isolation off.
// It reports whether it changed the record. Precondition: s.opMu held (the record is
// s's).
// +checklocks:s.opMu
func (m *Manager) isolation(s *sb, mayMove bool) (*sandbox.Isolation, bool, error) {
	if m.cfg.NoIsolation {
		return nil, false, nil
	}
	h := m.idHolder(s.rec.ID)
	if f := s.rec.Family; f != nil {
		h = m.idHolder(f.Source) // a fork family's range is its source's (family.go)
	}
	// The directory is the record's proof of life (hostids.Holder.Dir): it exists
	// before the claim.
	if err := os.MkdirAll(h.Dir, 0o700); err != nil {
		return nil, false, err
	}
	base, err := m.ids.Claim(h, s.rec.UIDBase)
	if errors.Is(err, hostids.ErrTaken) && mayMove {
		m.log.Warn("sandbox's id range is another's: it gets a new one", "sandbox", s.rec.ID, "err", err)
		base, err = m.ids.Claim(h, 0)
	}
	if errors.Is(err, hostids.ErrFull) {
		return nil, false, fmt.Errorf("%v: %w", err, errdefs.ErrConflict)
	}
	if err != nil {
		return nil, false, fmt.Errorf("sandbox %s: %w", s.rec.ID, err)
	}
	changed := base != s.rec.UIDBase
	s.rec.UIDBase = base
	return &sandbox.Isolation{IDs: sbinit.IDRange{Base: base, Size: idsPerSandbox}, Store: m.st.Root}, changed, nil
}

// releaseIDs gives sandbox id's range back to the host, once its directory is gone.
func (m *Manager) releaseIDs(id string, base uint32) {
	if m.ids == nil || base == 0 {
		return
	}
	if err := m.ids.Release(m.idHolder(id), base); err != nil {
		m.log.Warn("release id range", "sandbox", id, "base", base, "err", err)
	}
}

func (m *Manager) idHolder(id string) hostids.Holder {
	return hostids.Holder{Store: m.st.Root, Sandbox: id, Dir: m.st.SandboxDir(id)}
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
