package store

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
)

// Project ranges. XFS project ids are per filesystem, and a bulkstat pass reads every
// inode of the filesystem, whichever store made it: two stores on one XFS (two
// daemons, a test daemon's store under the host's) that both named a layer's project
// after its layer id, both numbered from 1, would measure each other's layers as
// their own: a sandbox charged, and stopped, for another store's bytes
// (TestStoresOnOneXFSMeasuredApart). So each store holds a range of the filesystem's
// ids of its own:
//
//	ROOT/projects     a directory whose own project id is the range's first id,
//	                  k<<projectRangeBits; the store's layers get the ids after it
//
// The claim is the inode itself: every bulkstat of the filesystem sees it, from any
// store, through any mount or bind mount of it, across reboots, and it goes when the
// store is deleted, so a deleted store's range is free again with nothing to clean
// up. A store takes a range that no inode of the filesystem carries an id of (a layer
// of a store whose marker was lost keeps its range taken), picked at random so that
// claims at the same time seldom meet; never range 0, where stores made before ranges
// numbered their layers (the bare layer id), and where a daemon of that version still
// does. After making its marker, a claimer reads every inode once and keeps the range
// only if no other inode carries an id of it, else it removes its marker and tries
// another. Two claims of one range never both keep it: if one's pass missed the
// other's marker, that marker was made after the pass began, so after the first
// marker, which is then there for the whole of the second claimer's pass. (Both may
// see each other and both try again.) No lock is shared, so daemons in any mount
// namespace, and a pass that takes seconds on a loaded store, hold nobody up.
//
// The marker is made as ROOT/.projects.new and renamed into place: a crash before the
// rename leaves a directory the next claim removes (until then it holds the range),
// one after it a complete claim.
//
// A layer's id is the next free one of the range after the last given (next-fit): ids
// are not tied to layer ids, which grow without bound, so no two live layers of a
// store share one. The ids in use are read from the layers' directories when the store
// gives its first id, and again when the cursor wraps (a removed layer's id is free
// from then on).
//
// Layers made before ranges keep their bare-id project (read from their directory,
// like any layer's): re-tagging them would mean setting every inode of a layer whose
// sandbox may be running (adopted across a daemon restart), and an inode left with the
// old id in a directory with the new one makes overlayfs's renames fail with EXDEV in
// the sandbox. An upper is replaced at the sandbox's next checkpoint or restore, so a
// sandbox is measured by its store's own range from then on; until then, two such
// stores' same-numbered uppers are measured together, as before ranges.
const (
	projectRangeBits = 20
	projectRangeSize = 1 << projectRangeBits // ids per store: its live layers, at most
	projectRanges    = 1 << (32 - projectRangeBits)
	projectsMarker   = "projects"
	projectClaimTry  = 32
)

// rangeCount is how many ranges a claim picks from (a variable for tests).
var rangeCount = uint32(projectRanges)

// projects is a store's range and the ids its live layers hold (Store.proj, under projMu).
type projects struct {
	base uint32          // first id of the range (the marker's); 0 until read or claimed
	next uint32          // next id to try
	used map[uint32]bool // ids of live layers, as of the last scan, and those given since
}

// inRange reports whether p is one of the store's layer ids.
func (pr *projects) inRange(p uint32) bool {
	return pr.base != 0 && p > pr.base && p-pr.base < projectRangeSize
}

// markerProject reads the project id of ROOT/projects: the store's range's first id
// (0: no marker, or one whose id is not a range's first, which a claim replaces).
func (s *Store) markerProject() (uint32, error) {
	p, _, err := Project(filepath.Join(s.Root, projectsMarker))
	if errors.Is(err, unix.ENOENT) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("read the store's XFS project range (%s): %w", filepath.Join(s.Root, projectsMarker), err)
	}
	if p == 0 || p%projectRangeSize != 0 {
		return 0, nil
	}
	return p, nil
}

// projectRange returns the store's range's first id, claiming one if the store has
// none. Precondition: projMu held.
// +checklocks:s.projMu
func (s *Store) projectRange() (uint32, error) {
	pr := &s.proj
	if pr.base != 0 {
		return pr.base, nil
	}
	b, err := s.markerProject()
	if err != nil || b != 0 {
		pr.base = b
		return b, err
	}
	if b, err = s.claimRange(); err != nil {
		return 0, err
	}
	pr.base = b
	return b, nil
}

// claimRange takes a range of the store's filesystem that no inode carries an id of,
// and makes ROOT/projects its marker. It picks one at random among those its last pass
// found free (none before the first: any), makes the marker, and reads every inode once
// to check it: the common case costs one bulkstat pass, at the store's first Open.
func (s *Store) claimRange() (uint32, error) {
	marker, tmp := filepath.Join(s.Root, projectsMarker), filepath.Join(s.Root, ".projects.new")
	if err := os.RemoveAll(tmp); err != nil {
		return 0, err
	}
	if err := os.RemoveAll(marker); err != nil { // one without a valid id
		return 0, err
	}
	taken := map[uint32]bool{0: true}
	for range projectClaimTry {
		var free []uint32
		for k := uint32(1); k < rangeCount; k++ {
			if !taken[k] {
				free = append(free, k)
			}
		}
		if len(free) == 0 {
			return 0, fmt.Errorf("every XFS project range of the filesystem of %s is taken (%d stores or strays): remove unused stores", s.Root, rangeCount-1)
		}
		k := free[rand.IntN(len(free))]
		base := k << projectRangeBits
		if err := os.Mkdir(tmp, 0o700); err != nil {
			return 0, err
		}
		var st unix.Stat_t
		err := SetProject(tmp, base)
		if err == nil {
			err = unix.Stat(tmp, &st)
		}
		if err != nil {
			_ = os.Remove(tmp) // a leftover marker is removed by the next claim
			return 0, err
		}
		var keep bool
		taken, keep, err = s.checkClaim(base, st.Ino)
		if err == nil && keep {
			err = os.Rename(tmp, marker)
		}
		if err == nil && keep {
			return base, syncDir(s.Root)
		}
		_ = os.Remove(tmp) // a leftover marker is removed by the next claim
		if err != nil {
			return 0, err
		}
		taken[k] = true
		time.Sleep(time.Duration(1+rand.IntN(20)) * time.Millisecond)
	}
	return 0, fmt.Errorf("claim an XFS project range for %s: %d ranges were claimed at the same time by other stores", s.Root, projectClaimTry)
}

// checkClaim reads every inode of the filesystem once: it returns the ranges some inode
// carries an id of, and whether the marker ino of range base may keep it: no other
// inode carries an id of the range.
func (s *Store) checkClaim(base uint32, ino uint64) (map[uint32]bool, bool, error) {
	var found, other bool
	taken := map[uint32]bool{0: true}
	err := s.bulkstat(func(b *xfsBulkstat) {
		k := b.Projectid >> projectRangeBits
		if b.Projectid != 0 {
			taken[k] = true
		}
		if b.Ino == ino {
			found = true
		} else if b.Projectid != 0 && k == base>>projectRangeBits {
			other = true // another claimer's marker, or a layer of a store that lost its own
		}
	})
	if err != nil {
		return nil, false, err
	}
	if !found {
		return nil, false, fmt.Errorf("bulkstat of %s did not find the project range marker it made (inode %d)", s.Root, ino)
	}
	return taken, !other, nil
}

func syncDir(p string) error {
	fd, err := openDir(p)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return unix.Fsync(fd)
}

// scanLayerProjects reads the project of every layer directory of the store into used.
// Precondition: projMu held.
// +checklocks:s.projMu
func (s *Store) scanLayerProjects() {
	pr := &s.proj
	pr.used = map[uint32]bool{}
	ents, _ := os.ReadDir(filepath.Join(s.Root, "layers"))
	for _, e := range ents {
		id, err := strconv.ParseUint(e.Name(), 10, 64)
		if err != nil {
			continue
		}
		p, _, err := Project(s.LayerDir(id))
		if err != nil {
			continue
		}
		if pr.inRange(p) {
			pr.used[p] = true
		}
	}
}

// giveProject picks a new layer's project: the next id of the range that no live layer
// holds. Precondition: projMu held.
// +checklocks:s.projMu
func (s *Store) giveProject() (uint32, error) {
	base, err := s.projectRange()
	if err != nil {
		return 0, err
	}
	pr := &s.proj
	if pr.used == nil {
		s.scanLayerProjects()
		pr.next = base + 1
		for p := range pr.used {
			if p >= pr.next {
				pr.next = p + 1
			}
		}
	}
	for wrapped := false; ; {
		if !pr.inRange(pr.next) {
			if wrapped {
				return 0, fmt.Errorf("every XFS project id of the range of store %s (%d) is held by a live layer: remove nodes", s.Root, projectRangeSize-1)
			}
			wrapped = true
			s.scanLayerProjects()
			pr.next = base + 1
			continue
		}
		p := pr.next
		pr.next++
		if !pr.used[p] {
			pr.used[p] = true
			return p, nil
		}
	}
}

// LayerProject is the XFS project id that layer id's directories carry (0 when it has
// none or is gone): one of the store's range, or, for a layer made before ranges, its
// layer id. Read from the directory (two syscalls), the one record of it.
func (s *Store) LayerProject(id uint64) uint32 {
	p, _, err := Project(s.LayerDir(id))
	if err != nil {
		return 0
	}
	return p
}
