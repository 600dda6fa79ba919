package store

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/testutil/skip"
)

// xfsStore makes a test store in a directory of the main store (an XFS: project ids
// and bulkstat need one; t.TempDir is not).
func xfsStore(t *testing.T) *Store {
	t.Helper()
	root := os.Getenv("DELTABOX_ROOT")
	if root == "" {
		root = DefaultRoot
	}
	var st unix.Statfs_t
	err := unix.Statfs(root, &st)
	skip.Require(t, err == nil && st.Type == 0x58465342, "no XFS store at %s (run scripts/setup.sh): %v", root, err)
	skip.Require(t, os.Geteuid() == 0, "needs root (XFS project ids, bulkstat)")
	dir, err := os.MkdirTemp(root, "store-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	for _, d := range []string{"layers", "tmp"} {
		if err := os.Mkdir(filepath.Join(dir, d), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	return &Store{Root: dir}
}

func wantProject(t *testing.T, p string, want uint32) {
	t.Helper()
	got, _, err := Project(p)
	if err != nil {
		t.Fatal(err)
	}
	if got != want {
		t.Errorf("%s: project %d, want %d", p, got, want)
	}
}

// TestProjectInherited: a new layer's diff/ and work/ carry its project id, and so does
// everything made in them afterwards, at any depth, without quotas on the mount.
func TestProjectInherited(t *testing.T) {
	s := xfsStore(t)
	const id = 7
	if err := s.NewLayer(id); err != nil {
		t.Fatal(err)
	}
	if !s.Projects() {
		t.Fatal("NewLayer fell back to no project ids on XFS")
	}
	p := s.LayerProject(id)
	if p>>projectRangeBits == 0 {
		t.Fatalf("layer %d has project %d, not one of a range's", id, p)
	}
	for _, d := range []string{s.LayerDiff(id), s.LayerWork(id)} {
		got, inherit, err := Project(d)
		if err != nil || got != p || !inherit {
			t.Fatalf("%s: project %d inherit %v (%v), want %d inherited", d, got, inherit, err, p)
		}
	}
	deep := filepath.Join(s.LayerDiff(id), "a", "b")
	if err := os.MkdirAll(deep, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(deep, "f"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	wantProject(t, filepath.Join(deep, "f"), p)
	wantProject(t, deep, p)
	if err := s.ResetWork(id); err != nil {
		t.Fatal(err)
	}
	wantProject(t, s.LayerWork(id), p)
}

// TestFreezeKeepsProject: frozen/ (made by Freeze or ahead by PrepareFrozen) has its
// layer's project id, so that the renames into it work (see TestRenameAcrossProjectsFails)
// and the frozen files keep being counted as that layer's.
func TestFreezeKeepsProject(t *testing.T) {
	for _, prepared := range []bool{false, true} {
		s := xfsStore(t)
		const id = 9
		if err := s.NewLayer(id); err != nil {
			t.Fatal(err)
		}
		newLayer(t, s, id, 0o755, nil, "workspace", "tmp")
		if prepared {
			if err := s.PrepareFrozen(id); err != nil {
				t.Fatal(err)
			}
		}
		if err := s.Freeze(id); err != nil {
			t.Fatalf("prepared %v: %v", prepared, err)
		}
		wantProject(t, s.LayerFrozen(id), s.LayerProject(id))
		wantProject(t, filepath.Join(s.LayerFrozen(id), "workspace", "sub", "f"), s.LayerProject(id))
		if err := s.Unfreeze(id); err != nil {
			t.Fatal(err)
		}
	}
}

// TestRenameAcrossProjectsFails is the kernel fact the layout rests on: XFS refuses a
// rename into a PROJINHERIT directory of another project with EXDEV. A frozen/ of a
// different id would make every Freeze fail.
func TestRenameAcrossProjectsFails(t *testing.T) {
	s := xfsStore(t)
	a, b := filepath.Join(s.Root, "tmp", "a"), filepath.Join(s.Root, "tmp", "b")
	for i, d := range []string{a, b} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := SetProject(d, uint32(100+i)); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(a, "f"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	err := os.Rename(filepath.Join(a, "f"), filepath.Join(b, "f"))
	if !errors.Is(err, unix.EXDEV) {
		t.Fatalf("rename across projects: %v, want EXDEV", err)
	}
}

// TestProjectUsage: bulkstat finds a layer's blocks, a file unlinked but still open
// (which a walk of diff/ misses) included, and nothing of another layer. (On the main
// store, beside other tests' stores whose layers have the same ids.)
func TestProjectUsage(t *testing.T) {
	s := xfsStore(t)
	for _, id := range []uint64{11, 12} {
		if err := s.NewLayer(id); err != nil {
			t.Fatal(err)
		}
	}
	mib := make([]byte, 1<<20)
	for i := range mib {
		mib[i] = byte(i)
	}
	if err := os.WriteFile(filepath.Join(s.LayerDiff(11), "f"), mib, 0o644); err != nil {
		t.Fatal(err)
	}
	hidden := filepath.Join(s.LayerDiff(11), "hidden")
	f, err := os.Create(hidden)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	os.Remove(hidden)
	for range 3 {
		f.Write(mib)
	}
	u, err := s.ProjectUsage()
	if err != nil {
		t.Fatal(err)
	}
	got := u[s.LayerProject(11)]
	if got.Bytes < 4<<20 || got.Bytes > 5<<20 {
		t.Errorf("layer 11 holds %d bytes, want 4 MiB (1 MiB file + 3 MiB unlinked and open) and its directories", got.Bytes)
	}
	if w := DirBytes(s.LayerDir(11)); w >= 2<<20 {
		t.Errorf("a walk found %d bytes: the unlinked file was expected to be missed", w)
	}
	if o := u[s.LayerProject(12)]; o.Bytes > 64<<10 {
		t.Errorf("layer 12 holds %d bytes, want its empty directories only", o.Bytes)
	}
}

// TestBulkstatCost measures one bulkstat pass over the main store (every image and layer)
// and a walk of the same tree, for docs/API.md's figures.
func TestBulkstatCost(t *testing.T) {
	s := xfsStore(t)
	main := &Store{Root: filepath.Dir(s.Root)}
	var inodes int64
	const runs = 5
	start := time.Now()
	for range runs {
		u, err := main.ProjectUsage()
		if err != nil {
			t.Fatal(err)
		}
		_ = u
	}
	bulk := time.Since(start) / runs
	var sf unix.Statfs_t
	unix.Statfs(main.Root, &sf)
	inodes = int64(sf.Files - sf.Ffree)
	start = time.Now()
	DirBytes(main.Root)
	walk := time.Since(start)
	t.Logf("store of %d inodes: bulkstat pass %v (%.2f µs/inode), walk %v (%.2f µs/inode)",
		inodes, bulk, float64(bulk.Nanoseconds())/1e3/float64(inodes), walk, float64(walk.Nanoseconds())/1e3/float64(inodes))
}

// smallXFS loop-mounts a fresh XFS of size MiB (reflink, as scripts/setup.sh makes
// the store) and returns its mount point, unmounted at the end of the test.
func smallXFS(t *testing.T, mib int) string {
	t.Helper()
	skip.Require(t, os.Geteuid() == 0, "needs root (loop mount)")
	_, err := exec.LookPath("mkfs.xfs")
	skip.Require(t, err == nil, "no mkfs.xfs: %v", err)
	dir := t.TempDir()
	img, mnt := filepath.Join(dir, "store.img"), filepath.Join(dir, "mnt")
	run := func(name string, args ...string) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if out, err := exec.CommandContext(ctx, name, args...).CombinedOutput(); err != nil {
			t.Fatalf("%s %v: %v\n%s", name, args, err, out)
		}
	}
	f, err := os.Create(img)
	if err != nil {
		t.Fatal(err)
	}
	f.Truncate(int64(mib) << 20)
	f.Close()
	run("mkfs.xfs", "-q", "-m", "reflink=1", img)
	os.Mkdir(mnt, 0o755)
	run("mount", "-o", "loop", img, mnt)
	t.Cleanup(func() { unix.Unmount(mnt, unix.MNT_DETACH) })
	return mnt
}

// fill writes a file until the store has no room left (ENOSPC), as a disk filler in a
// sandbox would, and returns its size.
func fill(t *testing.T, dir string) int64 {
	t.Helper()
	f, err := os.Create(filepath.Join(dir, "filler"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 1<<20)
	var n int64
	for {
		w, err := f.Write(buf)
		n += int64(w)
		if errors.Is(err, unix.ENOSPC) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	f.Sync() // delayed allocations are reserved at write: nothing more to find
	return n
}

// TestIndexCommitsOnFullStore: with the store filled to its last block by a writer
// that is not the daemon, the index still commits (its headroom past the end of
// index.db, then the reserve), reports it, and a reopened index has every change.
func TestIndexCommitsOnFullStore(t *testing.T) {
	root := smallXFS(t, 320)
	s, err := Open(root)
	if err != nil {
		t.Fatal(err)
	}
	if w := s.Warning(); w != "" {
		t.Fatalf("a new store warns: %s", w)
	}
	filled := fill(t, root)
	if free, _ := s.FreeBytes(); free > 1<<20 {
		t.Fatalf("%d bytes still free after the filler wrote %d", free, filled)
	}
	// 4000 nodes of ~1 KiB each: index.db grows by several MiB past its first size.
	pad := strings.Repeat("x", 1000)
	var last uint64
	for i := range 4000 {
		last = s.Index.Apply(Op{PutNode: &Node{ID: fmt.Sprintf("n%d", i), Parent: pad, Own: true, Layer: uint64(i + 1)}})
	}
	done := make(chan error, 1)
	go func() { done <- s.Index.WaitDurable(last) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("commit on a full store: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("no commit 30 s after a full store: %v", s.Index.Err())
	}
	t.Logf("filler wrote %d MiB; index committed 4000 nodes in its headroom; warning: %q", filled>>20, s.Warning())
	// 40000 more: past the headroom, the committer releases the reserve and says so.
	for i := range 40000 {
		last = s.Index.Apply(Op{PutNode: &Node{ID: fmt.Sprintf("m%d", i), Parent: pad, Own: true, Layer: uint64(i + 1)}})
	}
	if err := s.Index.WaitDurable(last); err != nil {
		t.Fatalf("commit past the headroom: %v", err)
	}
	if s.Warning() == "" {
		t.Error("the reserve was used and Warning says nothing")
	}
	t.Logf("40000 more committed; warning: %q", s.Warning())
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	s, err = Open(root)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	nodes, _, err := s.Index.Load()
	if err != nil || len(nodes) != 44000 {
		t.Fatalf("reopened: %d nodes, %v; want 44000", len(nodes), err)
	}
	// Room back: the reserve is made again, and the warning goes.
	os.Remove(filepath.Join(root, "filler"))
	if err := s.TopUp(); err != nil || s.Warning() != "" {
		t.Fatalf("after the filler went: %v, warning %q", err, s.Warning())
	}
}

// TestProjectUsagePrealloc: what fallocate reserves past a file's end counts (a way to
// take space without writing); XFS's speculative preallocation of a file being
// appended counts too (up to as much again as its size), as a project quota charges it.
func TestProjectUsagePrealloc(t *testing.T) {
	s := xfsStore(t)
	if err := s.NewLayer(13); err != nil {
		t.Fatal(err)
	}
	mib := make([]byte, 1<<20)
	f, err := os.OpenFile(filepath.Join(s.LayerDiff(13), "appended"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for range 32 {
		f.Write(mib)
	}
	u, err := s.ProjectUsage()
	if err != nil {
		t.Fatal(err)
	}
	appended := u[s.LayerProject(13)].Bytes
	if appended < 32<<20 || appended > 65<<20 {
		t.Errorf("32 MiB appended count %d bytes, want 32 to 64 MiB", appended)
	}
	if err := fallocate(filepath.Join(s.LayerDiff(13), "reserved"), 0, 16<<20, true); err != nil {
		t.Fatal(err)
	}
	u, err = s.ProjectUsage()
	if err != nil {
		t.Fatal(err)
	}
	if got := u[s.LayerProject(13)].Bytes - appended; got < 16<<20 {
		t.Errorf("16 MiB fallocated past an empty file's end count %d bytes", got)
	}
	t.Logf("32 MiB appended (1 MiB writes) count %d MiB", appended>>20)
}

// TestSettledFreeBytesCountsADeleteAtOnce: right after a large file is deleted, the
// settled count has its blocks, whatever XFS's background workers have done yet.
func TestSettledFreeBytesCountsADeleteAtOnce(t *testing.T) {
	root := smallXFS(t, 320)
	s, err := Open(root)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for i := range 5 {
		filled := fill(t, root)
		if err := os.Remove(filepath.Join(root, "filler")); err != nil {
			t.Fatal(err)
		}
		free, err := s.settledFreeBytes()
		if err != nil {
			t.Fatal(err)
		}
		if free < filled-(4<<20) {
			t.Fatalf("round %d: %d MiB deleted, %d MiB free at once", i, filled>>20, free>>20)
		}
	}
}
