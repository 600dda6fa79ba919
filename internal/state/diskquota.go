package state

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/apitypes"
	"deltabox/internal/errdefs"
	"deltabox/internal/store"
)

// Disk quotas: what a sandbox adds to the store is capped at its disk_mb: its upper's
// blocks and inodes, and the process images of the checkpoints it made.
//
// This kernel has no XFS quotas (CONFIG_XFS_QUOTA is not set: mount -o prjquota fails
// with "quota support not available"), so nothing refuses a write in the kernel; the
// daemon bounds each kind of growth where it can see it (docs/design/disk-quota.md):
//
//   - One call: a fallocate, which reserves any number of blocks at once (200 MiB in 3
//     ms with the exec around it), longer than the whole quota fails with EDQUOT
//     (sbinit's seccomp filter), and no file grows past the quota (RLIMIT_FSIZE, set
//     by init: EFBIG, SIGXFSZ). What many calls add up to is the watcher's.
//   - The process images of its checkpoints: a checkpoint whose CRIU trees' images would
//     take the sandbox past its quota is refused (507) once they are written and before
//     they are kept; a node's durable image whose new pages would fails, and is removed
//     (imageFits).
//   - Writes and inodes: the watcher, after the fact. Every upper carries its layer's XFS
//     project id, one of its store's range (so that no other store's layer on the
//     filesystem has it: store/projrange.go), and one XFS_IOC_BULKSTAT pass over the store (store.ProjectUsage)
//     gives every upper's blocks and inodes at once: 10.8 ms for the 18257 inodes of a
//     store with the default image (0.59 µs/inode), where a walk took 180 ms, and it
//     counts what a walk misses (a file deleted while open, a copy-up in progress). An
//     inode counts the store's inode size (512 B): 300,000 empty files took 159 MiB of
//     the store and their blocks were 13 MB.
//   - When: statfs of the store every diskPoll (about 2 µs), and a pass when
//     diskInterval has gone by since the last one, when the store's used space grew by
//     diskGrowth (or a quarter of the smallest quota) since then, or when less than
//     store.ReserveBytes is free. The interval stretches to diskCostFactor times the
//     last pass's cost, so that a store of millions of inodes costs the watcher at most
//     5% of a CPU while idle (a store with 200,000 more files: 163 ms a pass). A pass
//     due by its interval alone waits up to diskForkWait for the fast forks under way.
//   - Enforce: a sandbox over its disk_mb has every process but its templates killed
//     (SIGKILL through init, as a restore does; sessions restart at their next call),
//     and until it is back under (files deleted through the files API, nodes it made
//     removed, or a restore) its execs, session calls, file writes and checkpoints
//     answer 507 "disk quota exceeded". Reads, deletes, restores and rm are allowed.
//   - The store short (less than store.ReserveBytes free, whatever the quotas): the
//     upper of the stopped sandbox holding most is given back (reclaimDisk: restored
//     to the node it stands on, or removed when it has none), so that the store does
//     not stay full because of it; with none, the sandbox that added most to the store
//     since the last pass (diskMinGuilt at least: one that wrote nothing is never the
//     one) is stopped the same way, and given back at the next pass. Stopping alone
//     would not do: the stopped sandbox keeps its blocks, and each pass would stop
//     whoever wrote next (TestDiskFullInnocentWriterKept). The index commits anyway
//     (store/reserve.go).
//
// A writer of many files passes the quota by what it writes before the next pass: a
// new 1 MiB file at a time, killed at 77 MiB counted at a 64 MiB quota
// (TestDiskQuotaStopsFiller); one file stops at the quota. A loop of fallocates each
// under the quota is stopped only by the pass: 32 calls of 128 MiB took 4 GiB at a
// 256 MiB quota; on a store that fills first, the store-short rule stops it and gives
// the space back. The frozen layers of its nodes are the client's to keep or remove
// (their sizes are in the tree); the process images of its nodes count because the
// sandbox's code decides their size (its memory).
const (
	diskPoll       = 100 * time.Millisecond
	diskInterval   = time.Second
	diskGrowth     = 64 << 20
	diskCostFactor = 20
	// DefaultDiskMB is a sandbox's quota unless it asks for another (disk_mb): 10 GiB,
	// ten times the largest workspace the benches write, and far below the store.
	DefaultDiskMB = 10 << 10
)

// diskState is what the watcher knows of a sandbox's disk (sb.disk, under sb.mu).
type diskState struct {
	upper    uint64 // the upper it measured
	bytes    int64  // the upper's blocks and inodes (inodes times the store's inode size)
	images   int64  // its checkpoints' process images (imageBytes)
	measured time.Time
	over     string // why the sandbox is stopped ("" when it is not)
	full     bool   // stopped because the store ran short: its upper may be dropped (reclaim)
}

// total is what counts against the sandbox's disk_mb.
func (d diskState) total() int64 { return d.bytes + d.images }

// diskReclaimMin is the least upper a stopped sandbox must hold for the watcher to drop
// it when the store is short: what gives the store its reserve back. A sandbox stopped
// for a smaller one (it wrote most in the last pass, but little) runs again once the
// store has room.
const diskReclaimMin = store.ReserveBytes

// diskMinGuilt is the least a sandbox must have added to the store since the last pass
// to be stopped when the store runs short: a sandbox that wrote nothing (a few inodes
// of a fresh upper) is never the one stopped.
const diskMinGuilt = 1 << 20

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
		if !diskDue(time.Since(last), cost, used-lastUsed, m.diskGrowth(), free, m.fastForks.Load() > 0) {
			continue
		}
		t0 := time.Now()
		if err := m.diskPass(free < store.ReserveBytes, 0); err != nil {
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

// diskForkWait is how long past its interval a timed pass may wait for the fast forks
// under way: a 64-branch fork takes about a second, and a pass in it was 18% of the
// daemon's CPU there (the bulkstat reads every inode of the filesystem, other stores'
// too), in a fork bound by the machine's two CPUs.
const diskForkWait = 4 * time.Second

// diskDue says whether the watcher passes now: since is the time since the last pass,
// cost what it took, grew what the store's used space grew since, free the store's free
// bytes, forking whether a fast fork is under way. A pass that is due only by its
// interval waits for the forks (diskForkWait at most); growth past diskGrowth (growth)
// or a short store pass at once, fork or not: a fork's branches add empty uppers, so
// growth is a sandbox's writes.
func diskDue(since, cost time.Duration, grew, growth, free int64, forking bool) bool {
	if grew >= growth || free < store.ReserveBytes {
		return true
	}
	every := max(diskInterval, diskCostFactor*cost)
	if forking {
		every += diskForkWait
	}
	return since >= every
}

// diskStop is a sandbox a pass marked over its quota (or stopped for the store), whose
// processes stopWriters ends after the pass.
type diskStop struct {
	s     *sb
	upper uint64 // the upper measured
	full  bool
	why   string
}

// diskPass measures every sandbox's disk and stops those over their quota. When the
// store runs short (full, or found so), it drops the upper of the stopped sandbox that
// holds most (reclaimDisk; diskReclaimMin at least), so that the store does not stay
// full because of it; with none, it stops the sandbox that added most to the store
// since the last pass, which the next pass finds stopped and reclaims. Nobody else is
// stopped while an upper is being given back. With reuse > 0, a pass that started less
// than reuse ago, with nothing lowered through the API since (diskFreed), stands
// instead (diskRefusal).
//
// The pass marks whom it stops (diskState.over: their writes answer 507 from then on)
// and ends their processes after it has let go of diskMu, each in the background
// (stopWriters): that takes the sandbox's opMu, which a checkpoint holds for as long as
// its CRIU dump takes (seconds), and the watcher and every other sandbox's refusals must
// not wait for that. Precondition: no lock held.
func (m *Manager) diskPass(full bool, reuse time.Duration) error {
	freed := m.diskFreed.Load()
	m.diskMu.Lock()
	if reuse > 0 && !m.passAt.IsZero() && time.Since(m.passAt) < reuse && m.passFreed == freed {
		m.diskMu.Unlock()
		return nil
	}
	t0 := time.Now()
	stops, err := m.measureDisk(full)
	if err == nil {
		m.passAt, m.passFreed = t0, freed
	}
	m.diskMu.Unlock()
	for _, st := range stops {
		m.stopWritersLater(st)
	}
	return err
}

// measureDisk is diskPass's measure and decisions: it returns whom to stop. Precondition:
// diskMu held.
// +checklocks:m.diskMu
func (m *Manager) measureDisk(full bool) ([]diskStop, error) {
	usage, err := m.st.ProjectUsage()
	walk := errors.Is(err, store.ErrNoBulkstat)
	if err != nil && !walk {
		return nil, err
	}
	if m.inodeBytes == 0 {
		m.inodeBytes = max(m.st.InodeBytes(), 1)
	}
	images := m.imageBytes()
	free, _, err := m.st.Space()
	short := full || err == nil && free < store.ReserveBytes
	m.mu.Lock()
	all := make([]*sb, 0, len(m.sandboxes))
	for _, s := range m.sandboxes {
		all = append(all, s)
	}
	m.mu.Unlock()
	var stops []diskStop
	var grew, reclaim *sb
	var growth, held int64
	var busy bool
	for _, s := range all {
		m.mu.Lock()
		id, upper, limit := s.rec.ID, s.rec.Upper, diskLimit(s.rec.DiskMB)
		m.mu.Unlock()
		var b int64
		if walk {
			b = store.DirBytes(m.st.LayerDir(upper))
		} else {
			u := usage[m.st.LayerProject(upper)]
			b = u.Bytes + u.Inodes*m.inodeBytes
		}
		now := diskState{upper: upper, bytes: b, images: images[id], measured: time.Now()}
		s.mu.Lock()
		prev := s.disk
		now.over, now.full = prev.over, prev.full
		if now.total() <= limit && (!prev.full || !short) {
			now.over, now.full = "", false // back under, or the store has room again
		}
		if now.total() > limit && prev.over == "" && !s.removed {
			now.over = fmt.Sprintf("disk quota exceeded: %d MB > disk_mb %d (its files %d MB, its checkpoints' process images %d MB)",
				now.total()>>20, limit>>20, now.bytes>>20, now.images>>20)
			stops = append(stops, diskStop{s: s, upper: upper, why: now.over})
		}
		s.disk = now
		busy = busy || s.reclaiming
		s.mu.Unlock()
		// What it added to the store since the last pass: its upper's growth (all of a
		// new upper's), and its images'.
		d := now.bytes
		if prev.upper == upper {
			d -= prev.bytes
		}
		if !prev.measured.IsZero() {
			d += now.images - prev.images
		}
		if d >= diskMinGuilt && d > growth && now.over == "" {
			grew, growth = s, d
		}
		if short && now.over != "" && now.bytes >= diskReclaimMin && now.bytes > held {
			reclaim, held = s, now.bytes
		}
	}
	switch {
	case !short:
	case busy:
		// An upper is being given back: the store is short because of it, not of
		// whoever writes meanwhile.
	case reclaim != nil:
		m.reclaimDisk(reclaim)
	case grew != nil:
		why := fmt.Sprintf("the store is full (%d MB free) and this sandbox added the most to it since the last look (%d MB)", free>>20, growth>>20)
		grew.mu.Lock()
		upper := grew.disk.upper
		grew.disk.over, grew.disk.full = why, true
		grew.mu.Unlock()
		stops = append(stops, diskStop{s: grew, upper: upper, full: true, why: why})
	}
	return stops, nil
}

// reclaimWait is how long reclaimDisk's restore queues behind the sandbox's running
// calls (file reads and watches still run over the quota) before it gives up until a
// later pass.
const reclaimWait = 30 * time.Second

// reclaimDisk gives back the space of a stopped sandbox's upper while the store is
// short: the sandbox is restored to the node it stands on (what it wrote since its last
// checkpoint or restore is dropped), or removed when it has none (it never
// checkpointed: its upper is all it has) or the restore fails for good. A restore that
// could not run now (409: calls still running after reclaimWait; 503: something the
// machine lacks for the moment) removes nothing: the sandbox stays stopped, and the
// next pass that finds the store short tries again. In the background: the restore
// waits for calls and measures again, and the pass must not wait for either.
func (m *Manager) reclaimDisk(s *sb) {
	select {
	case <-m.stop:
		return // Close may be waiting for m.wg: no goroutine is added to it now
	default:
	}
	s.mu.Lock()
	if s.reclaiming {
		s.mu.Unlock()
		return
	}
	s.reclaiming = true
	s.mu.Unlock()
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		defer func() {
			s.mu.Lock()
			s.reclaiming = false
			s.mu.Unlock()
		}()
		m.mu.Lock()
		id, head := s.rec.ID, s.rec.Head
		m.mu.Unlock()
		s.mu.Lock()
		held := s.disk.bytes
		s.mu.Unlock()
		var err error
		removed := head == ""
		if head != "" {
			ctx, cancel := context.WithTimeout(context.Background(), reclaimWait+time.Minute)
			_, err = m.RestoreWith(ctx, id, RestoreOptions{Node: head, Wait: reclaimWait})
			cancel()
			if errors.Is(err, errdefs.ErrConflict) || errors.Is(err, errdefs.ErrUnavailable) {
				m.log.Warn("the store is full: a stopped sandbox's upper is not dropped yet, tried again at the next pass", "sandbox", id, "restore_to", head, "mb", held>>20, "err", err)
				return
			}
			// A restore that fails for good leaves the upper: removal is what frees it then.
			removed = err != nil
		}
		if removed {
			if rerr := m.Remove(id); rerr != nil {
				err = errors.Join(err, rerr)
			}
		}
		m.log.Warn("the store is full: a stopped sandbox's upper is dropped", "sandbox", id, "restored_to", head, "removed", removed, "mb", held>>20, "err", err)
	}()
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

// stopWritersLater runs stopWriters(st) in the background (counted in m.wg), unless the
// manager is closing (the mark stays; the next daemon measures again).
func (m *Manager) stopWritersLater(st diskStop) {
	select {
	case <-m.stop:
		return // Close may be waiting for m.wg: no goroutine is added to it now
	default:
	}
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		m.stopWriters(st)
	}()
}

// stopWriters kills every process of st.s but its templates, which a pass marked over
// its quota (st.full: because the store ran short, which only a restore or removal
// ends), unless its upper is no longer the one measured (a restore or checkpoint came
// between): the mark is then taken back, if still the pass's. Precondition: no lock
// held (it takes opMu).
func (m *Manager) stopWriters(st diskStop) {
	s := st.s
	s.opMu.Lock()
	defer s.opMu.Unlock()
	s.mu.Lock()
	gone := s.removed || s.rec.Upper != st.upper
	if gone && s.disk.upper == st.upper && s.disk.over == st.why {
		s.disk.over, s.disk.full = "", false
	}
	s.mu.Unlock()
	if gone || s.rt == nil || !s.rt.Alive() {
		return
	}
	keep := m.keepPids(s, nil)
	n, err := m.killAll(s, keep, true)
	m.log.Warn("sandbox stopped", "sandbox", s.rec.ID, "why", st.why, "killed", n, "err", err)
}

// diskRecheck is the age of a pass diskRefusal reuses. What a sandbox over its quota
// holds falls only through the API: a restore (which clears the mark), files deleted or
// nodes removed (diskFreed, after which the next refusal measures again). So a client
// retrying a refused exec in a loop costs a pass per diskRecheck, not one per call (a
// pass over a store of 200,000 files takes 163 ms).
const diskRecheck = diskInterval

// diskRefusal is the 507 a write to s answers while it is over its quota; nil when it
// is not. A sandbox marked over is measured again first (a pass, ~10 ms, or the last one
// when it is recent: diskRecheck), so that a delete or a restore takes effect at the
// next call. Precondition: no lock held.
func (m *Manager) diskRefusal(s *sb) error {
	s.mu.Lock()
	over := s.disk.over != ""
	s.mu.Unlock()
	if !over {
		return nil
	}
	if err := m.diskPass(false, diskRecheck); err != nil {
		m.log.Warn("disk usage", "err", err)
	}
	s.mu.Lock()
	why := s.disk.over
	s.mu.Unlock()
	if why == "" {
		return nil
	}
	return fmt.Errorf("sandbox %s: %s; delete files (DELETE /v1/sandboxes/%s/files?path=P, deltabox files rm), remove nodes it made (DELETE /v1/nodes/ID), or restore: %w", s.rec.ID, why, s.rec.ID, errdefs.ErrQuota)
}

// diskInfo is what SandboxInfo shows of s's disk. Precondition: s.opMu held.
// +checklocks:s.opMu
func (m *Manager) diskInfo(s *sb) *apitypes.DiskInfo {
	s.mu.Lock()
	d := s.disk
	s.mu.Unlock()
	in := &apitypes.DiskInfo{LimitMB: diskLimit(s.rec.DiskMB) >> 20, Exceeded: d.over, Warning: m.st.Warning()}
	in.ImageBytes = d.images
	if d.upper == s.rec.Upper {
		in.UpperBytes = d.bytes
		if !d.measured.IsZero() {
			in.MeasuredMSAgo = time.Since(d.measured).Milliseconds()
		}
	}
	return in
}

// imageBytes sums, per sandbox, what the process images of the nodes it made hold in the
// store: each node's CRIU trees (criutrees.go; a directory CRIU wrote, measured once
// it is the node's: it never changes after) and its templates' durable image (the
// bytes its ingest added to the page store, and CRIU's other files: imageState.bytes).
// The pages an image shares with an earlier one are counted once, in the first.
func (m *Manager) imageBytes() map[string]int64 {
	out := map[string]int64{}
	if m.img == nil {
		return out
	}
	m.mu.Lock()
	owner := make(map[string]string, len(m.nodes))
	for id, n := range m.nodes {
		if n.Sandbox != "" {
			owner[id] = n.Sandbox
		}
	}
	m.mu.Unlock()
	m.img.mu.Lock()
	for node, st := range m.img.nodes {
		if o := owner[node]; o != "" {
			out[o] += st.bytes
		}
	}
	for node := range m.img.trees {
		if owner[node] == "" {
			delete(m.img.trees, node) // removed
		}
	}
	var unknown []string
	for node, o := range owner {
		if b, ok := m.img.trees[node]; ok {
			out[o] += b
		} else {
			unknown = append(unknown, node)
		}
	}
	m.img.mu.Unlock()
	for _, node := range unknown {
		// A node is in m.nodes once its trees are published (a rename before its record),
		// so a node without the directory has none.
		b, err := dirAllocated(m.criuTreesDir(node))
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			continue
		}
		m.img.mu.Lock()
		m.img.trees[node] = b
		m.img.mu.Unlock()
		out[owner[node]] += b
	}
	return out
}

// dirAllocated is what the files under dir hold in blocks (st_blocks), walked: an image's
// few files. An error when dir is not there.
func dirAllocated(dir string) (int64, error) {
	var n int64
	err := filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		var st unix.Stat_t
		if unix.Lstat(p, &st) == nil {
			n += st.Blocks * 512
		}
		return nil
	})
	return n, err
}

// imageRoom refuses (507) images of add bytes that would put s over its disk_mb, with
// what it holds as last measured (at most a pass old: diskInterval). what names them.
// Called once the images are written, before they are kept: they are then removed, so
// the store holds them past the quota for as long as that takes.
func (m *Manager) imageRoom(s *sb, add int64, what string) error {
	m.mu.Lock()
	limit := diskLimit(s.rec.DiskMB)
	m.mu.Unlock()
	s.mu.Lock()
	d := s.disk
	s.mu.Unlock()
	d.images = m.imageBytes()[s.rec.ID] // now: a restore since the last pass zeroed s.disk
	if d.total()+add <= limit {
		return nil
	}
	return fmt.Errorf("sandbox %s: disk quota exceeded: %s would take %d MB, and it holds %d MB of disk_mb %d (its files %d MB, its checkpoints' process images %d MB); remove nodes it made (DELETE /v1/nodes/ID) or delete files: %w",
		s.rec.ID, what, add>>20, d.total()>>20, limit>>20, d.bytes>>20, d.images>>20, errdefs.ErrQuota)
}
