package state

import (
	"errors"
	"fmt"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/errdefs"
	"deltabox/internal/store"
)

// Disk quotas: what a sandbox's upper layer holds is capped at its disk_mb.
//
// The kernel here has no XFS quota support, so the daemon enforces the quota itself,
// after the fact (store/project.go says what kernel project quotas would add):
//
//   - Measure: every upper carries its layer's XFS project id, and one
//     XFS_IOC_BULKSTAT pass over the store (store.ProjectUsage) gives every upper's
//     allocated bytes at once: 10.8 ms for the 18257 inodes of a store with the default
//     image (0.59 µs/inode), where a walk of the same tree took 180 ms, and it counts
//     what a walk misses (a file deleted while open, a copy-up in progress).
//   - When: statfs of the store every diskPoll (about 2 µs), and a pass when
//     diskInterval has gone by since the last one, when the store's used space grew by
//     diskGrowth (or a quarter of the smallest quota) since then, or when less than
//     store.ReserveBytes is free. The interval stretches to diskCostFactor times the
//     last pass's cost, so that a store of millions of inodes costs the watcher at most
//     5% of a CPU while idle (a store with 200,000 more files: 163 ms a pass, where a
//     walk of the layer holding them alone took 2.8 s).
//   - Enforce: an upper over its sandbox's disk_mb stops its writers: every process of
//     the sandbox but its templates is killed (SIGKILL through init, as a restore
//     does; sessions restart at their next call), and until the upper is back under
//     the quota (a file deleted through the files API, or a restore) the sandbox's
//     execs, session calls, file writes and checkpoints answer 507 "disk quota
//     exceeded". A checkpoint is refused because it would keep the oversized layer
//     for ever as a node. Reads, deletes, restores and rm are allowed.
//   - The store itself full (less than the reserve free, whatever the quotas): the
//     sandbox whose upper grew most since the last pass is stopped the same way, so
//     that the other sandboxes keep checkpointing; the index commits anyway
//     (store/reserve.go).
//
// A writer gets up to one interval of its bandwidth past the quota before it is
// stopped (diskGrowth bounds that when the store is busy with little else): a `>>`
// loop wrote 72 MiB at a 64 MiB quota (TestDiskQuotaStopsFiller). The count includes
// XFS's speculative preallocation (store.ProjectUsage), as a kernel quota's would. The
// quota covers the upper, what the sandbox's code can grow; the frozen layers of its
// nodes are the client's to keep or remove (their sizes are in the tree).
const (
	diskPoll       = 100 * time.Millisecond
	diskInterval   = time.Second
	diskGrowth     = 64 << 20
	diskCostFactor = 20
	// DefaultDiskMB is a sandbox's quota unless it asks for another (disk_mb): 10 GiB,
	// ten times the largest workspace the benches write, and far below the store.
	DefaultDiskMB = 10 << 10
)

// diskState is what the watcher knows of a sandbox's upper (sb.disk, under sb.mu).
type diskState struct {
	upper    uint64 // the upper it measured
	bytes    int64
	measured time.Time
	over     string // why the sandbox is stopped ("" when it is not)
}

// watchDisk runs until Close (counted in m.wg).
func (m *Manager) watchDisk() {
	defer m.wg.Done()
	tick := time.NewTicker(diskPoll)
	defer tick.Stop()
	var last time.Time
	var lastUsed int64
	var cost time.Duration
	for {
		select {
		case <-m.stop:
			return
		case <-tick.C:
		}
		free, used, err := m.st.Space()
		if err != nil {
			continue
		}
		due := time.Since(last) >= max(diskInterval, diskCostFactor*cost) ||
			used-lastUsed >= m.diskGrowth() || free < store.ReserveBytes
		if !due {
			continue
		}
		t0 := time.Now()
		if err := m.diskPass(free < store.ReserveBytes); err != nil {
			m.log.Warn("disk usage", "err", err)
		}
		last, cost, lastUsed = time.Now(), time.Since(t0), used
		if m.st.Warning() != "" {
			if err := m.st.TopUp(); err == nil {
				m.log.Info("the store's reserve is made again")
			}
		}
	}
}

// diskPass measures every upper and stops the sandboxes over their quota (and, when
// full, the one whose upper grew most).
// Lock order: diskMu first (it is taken under no other lock), then each sandbox's opMu.
func (m *Manager) diskPass(full bool) error {
	m.diskMu.Lock()
	defer m.diskMu.Unlock()
	usage, err := m.st.ProjectUsage()
	walk := errors.Is(err, store.ErrNoBulkstat)
	if err != nil && !walk {
		return err
	}
	m.mu.Lock()
	all := make([]*sb, 0, len(m.sandboxes))
	for _, s := range m.sandboxes {
		all = append(all, s)
	}
	m.mu.Unlock()
	var grew *sb
	var growth int64
	for _, s := range all {
		m.mu.Lock()
		upper, limit := s.rec.Upper, diskLimit(s.rec.DiskMB)
		m.mu.Unlock()
		var b int64
		if walk {
			b = store.DirBytes(m.st.LayerDir(upper))
		} else {
			b = usage[store.ProjectOf(upper)].Bytes
		}
		s.mu.Lock()
		prev := s.disk
		s.disk.upper, s.disk.bytes, s.disk.measured = upper, b, time.Now()
		if b <= limit {
			s.disk.over = ""
		}
		over := b > limit && prev.over == ""
		if d := b - prev.bytes; prev.upper == upper && d > growth {
			grew, growth = s, d
		}
		s.mu.Unlock()
		if over {
			m.stopWriters(s, upper, fmt.Sprintf("disk quota exceeded: %d MB > disk_mb %d", b>>20, limit>>20))
		}
	}
	if full && grew != nil {
		grew.mu.Lock()
		stopped, upper := grew.disk.over != "", grew.disk.upper
		grew.mu.Unlock()
		if !stopped {
			free, _, _ := m.st.Space()
			m.stopWriters(grew, upper, fmt.Sprintf("the store is full (%d MB free) and this sandbox wrote the most since the last look (%d MB)", free>>20, growth>>20))
		}
	}
	return nil
}

// diskGrowth is how much the store may grow before a pass runs early: diskGrowth, or a
// quarter of the smallest quota, so that a writer passes a small quota by little more
// than that (at least 4 MiB, so that ordinary writes do not make a pass every poll).
func (m *Manager) diskGrowth() int64 {
	g := int64(diskGrowth)
	m.mu.Lock()
	for _, s := range m.sandboxes {
		g = min(g, diskLimit(s.rec.DiskMB)/4)
	}
	m.mu.Unlock()
	return max(g, 4<<20)
}

func diskLimit(mb int64) int64 {
	if mb <= 0 {
		mb = DefaultDiskMB
	}
	return mb << 20
}

// stopWriters kills every process of s but its templates and marks it over quota,
// unless its upper is no longer the one measured (a restore or checkpoint came between).
func (m *Manager) stopWriters(s *sb, upper uint64, why string) {
	s.opMu.Lock()
	defer s.opMu.Unlock()
	s.mu.Lock()
	gone := s.removed || s.rec.Upper != upper
	if !gone {
		s.disk.over = why
	}
	s.mu.Unlock()
	if gone || s.rt == nil || !s.rt.Alive() {
		return
	}
	keep := m.keepPids(s, nil)
	n, err := m.killAll(s, keep, true)
	m.log.Warn("sandbox stopped", "sandbox", s.rec.ID, "why", why, "killed", n, "err", err)
}

// diskRefusal is the 507 a write to s answers while it is over its quota; nil when it
// is not. A sandbox marked over is measured again first (a pass, ~10 ms), so that a
// delete or a restore takes effect at the next call. Precondition: no lock held.
func (m *Manager) diskRefusal(s *sb) error {
	s.mu.Lock()
	over := s.disk.over != ""
	s.mu.Unlock()
	if !over {
		return nil
	}
	if err := m.diskPass(false); err != nil {
		m.log.Warn("disk usage", "err", err)
	}
	s.mu.Lock()
	why := s.disk.over
	s.mu.Unlock()
	if why == "" {
		return nil
	}
	return fmt.Errorf("sandbox %s: %s; delete files (DELETE /v1/sandboxes/%s/files?path=P, deltabox files rm) or restore: %w", s.rec.ID, why, s.rec.ID, errdefs.ErrQuota)
}

// diskInfo is what SandboxInfo shows of s's disk. Precondition: s.opMu held.
func (m *Manager) diskInfo(s *sb) *apitypes.DiskInfo {
	s.mu.Lock()
	d := s.disk
	s.mu.Unlock()
	in := &apitypes.DiskInfo{LimitMB: diskLimit(s.rec.DiskMB) >> 20, Exceeded: d.over, Warning: m.st.Warning()}
	if d.upper == s.rec.Upper {
		in.UpperBytes = d.bytes
		if !d.measured.IsZero() {
			in.MeasuredMSAgo = time.Since(d.measured).Milliseconds()
		}
	}
	return in
}
