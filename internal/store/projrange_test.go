package store

import (
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
)

func layerRange(t *testing.T, s *Store, id uint64) uint32 {
	t.Helper()
	if err := s.NewLayer(id); err != nil {
		t.Fatal(err)
	}
	p := s.LayerProject(id)
	if p == 0 {
		t.Fatalf("%s: layer %d has no project", s.Root, id)
	}
	return p >> projectRangeBits
}

// TestProjectRangeClaim: stores on one XFS take different ranges, never range 0 (bare
// layer ids, stores made before ranges); a store opened again keeps its range and
// gives no live layer's id again; a layer made before ranges keeps its bare id and is
// measured by it; a store that lost its marker takes another range and still measures
// its layers; a deleted store's range is free again; a marker left by a crash
// before its rename is removed and holds no range.
func TestProjectRangeClaim(t *testing.T) {
	fs := smallXFS(t, 320)
	a := bareStore(t, filepath.Join(fs, "a"))
	ka := layerRange(t, a, 1)
	p1 := a.LayerProject(1)
	// An old store: its layer 5 tagged with its bare id, no marker.
	old := bareStore(t, filepath.Join(fs, "old"))
	if err := os.MkdirAll(filepath.Join(old.LayerDiff(5)), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := SetProject(old.LayerDir(5), 5); err != nil {
		t.Fatal(err)
	}
	if err := SetProject(old.LayerDiff(5), 5); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(old.LayerDiff(5), "f"), make([]byte, 1<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	kold := layerRange(t, old, 6)
	u, err := old.ProjectUsage()
	if err != nil {
		t.Fatal(err)
	}
	if p := old.LayerProject(5); p != 5 || u[5].Bytes < 1<<20 {
		t.Errorf("the old layer 5: project %d, %d bytes counted; want 5 and its 1 MiB", p, u[5].Bytes)
	}
	b := bareStore(t, filepath.Join(fs, "b"))
	kb := layerRange(t, b, 1)
	if ka == 0 || kb == 0 || kold == 0 || ka == kb || ka == kold || kb == kold {
		t.Fatalf("ranges: a %d, old store %d, b %d; want distinct and not 0", ka, kold, kb)
	}
	// Opened again (a new Store, as after a restart): same range, a new id.
	a2 := &Store{Root: a.Root}
	if k := layerRange(t, a2, 2); k != ka || a2.LayerProject(2) == p1 {
		t.Errorf("store a reopened: layer 2 has project %d (range %d), layer 1 %d (range %d)", a2.LayerProject(2), k, p1, ka)
	}
	// b's marker lost: b opened again claims another range (its layer 1 still holds
	// kb), and layer 1 keeps its id and is measured by it.
	if err := os.WriteFile(filepath.Join(b.LayerDiff(1), "f"), make([]byte, 1<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(b.Root, projectsMarker)); err != nil {
		t.Fatal(err)
	}
	b2 := &Store{Root: b.Root}
	if k := layerRange(t, b2, 2); k == kb || k == ka || k == kold {
		t.Errorf("store b without its marker took range %d (b had %d, a %d, old %d)", k, kb, ka, kold)
	}
	u, err = b2.ProjectUsage()
	if err != nil {
		t.Fatal(err)
	}
	if p := b2.LayerProject(1); p>>projectRangeBits != kb || u[p].Bytes < 1<<20 {
		t.Errorf("store b's layer 1 after its marker was lost: project %d, %d bytes counted", p, u[p].Bytes)
	}
	// a deleted: no inode holds its range any more. A crash's leftover marker (in store
	// c, of a's old range) does not hold it either once c has claimed.
	if err := os.RemoveAll(a.Root); err != nil {
		t.Fatal(err)
	}
	if takenRanges(t, b)[ka] {
		t.Errorf("store a was deleted and its range %d is still taken", ka)
	}
	c := bareStore(t, filepath.Join(fs, "c"))
	if err := os.Mkdir(filepath.Join(c.Root, ".projects.new"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := SetProject(filepath.Join(c.Root, ".projects.new"), ka<<projectRangeBits); err != nil {
		t.Fatal(err)
	}
	if kc := layerRange(t, c, 1); kc != ka && takenRanges(t, c)[ka] {
		t.Errorf("store c took range %d, and a's old range %d is still held by the leftover", kc, ka)
	}
	if _, err := os.Stat(filepath.Join(c.Root, ".projects.new")); !os.IsNotExist(err) {
		t.Errorf("the leftover marker is still there: %v", err)
	}
}

// takenRanges are the ranges some inode of s's filesystem carries an id of.
func takenRanges(t *testing.T, s *Store) map[uint32]bool {
	t.Helper()
	taken := map[uint32]bool{}
	if err := s.bulkstat(func(b *xfsBulkstat) {
		if b.Projectid != 0 {
			taken[b.Projectid>>projectRangeBits] = true
		}
	}); err != nil {
		t.Fatal(err)
	}
	return taken
}

// TestProjectRangeClaimsAtOnce: stores claiming at the same time take different
// ranges. Eight stores for sixteen ranges, so that claims meet.
func TestProjectRangeClaimsAtOnce(t *testing.T) {
	const n = 8
	saved := rangeCount
	rangeCount = 2*n + 1
	t.Cleanup(func() { rangeCount = saved })
	fs := smallXFS(t, 320)
	ks := make([]uint32, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		s := bareStore(t, filepath.Join(fs, fmt.Sprint(i)))
		wg.Add(1)
		go func() {
			defer wg.Done()
			if errs[i] = s.NewLayer(1); errs[i] == nil {
				ks[i] = s.LayerProject(1) >> projectRangeBits
			}
		}()
	}
	wg.Wait()
	seen := map[uint32]int{}
	for i, k := range ks {
		if errs[i] != nil {
			t.Fatalf("store %d: %v", i, errs[i])
		}
		if j, ok := seen[k]; ok || k == 0 {
			t.Errorf("stores %d and %d both took range %d", j, i, k)
		}
		seen[k] = i
	}
}
