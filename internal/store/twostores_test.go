package store

import (
	"os"
	"path/filepath"
	"testing"
)

// bareStore is a store at dir (layers/ and tmp/ made), as Open's directories, without
// its index.
func bareStore(t *testing.T, dir string) *Store {
	t.Helper()
	for _, d := range []string{"layers", "tmp"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	return &Store{Root: dir}
}

// TestStoresOnOneXFSMeasuredApart: two stores on one XFS (two daemons, or a test
// daemon's store beside the host's) both have a layer 1; what is written in store A's
// layer is not counted for store B's. With the layer id as project id, B's upper was
// charged A's 4 MiB.
func TestStoresOnOneXFSMeasuredApart(t *testing.T) {
	fs := smallXFS(t, 320)
	a, b := bareStore(t, filepath.Join(fs, "a")), bareStore(t, filepath.Join(fs, "b"))
	for _, s := range []*Store{a, b} {
		if err := s.NewLayer(1); err != nil {
			t.Fatal(err)
		}
	}
	mib := make([]byte, 1<<20)
	for i := range mib {
		mib[i] = byte(i)
	}
	for i := range 4 {
		if err := os.WriteFile(filepath.Join(a.LayerDiff(1), "f"+string(rune('0'+i))), mib, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	pa, _, err := Project(a.LayerDir(1))
	if err != nil {
		t.Fatal(err)
	}
	pb, _, err := Project(b.LayerDir(1))
	if err != nil {
		t.Fatal(err)
	}
	ua, err := a.ProjectUsage()
	if err != nil {
		t.Fatal(err)
	}
	ub, err := b.ProjectUsage()
	if err != nil {
		t.Fatal(err)
	}
	if got := ua[pa].Bytes; got < 4<<20 {
		t.Errorf("store A's layer 1 (project %d) counts %d bytes, want its 4 MiB", pa, got)
	}
	if got := ub[pb].Bytes; got > 64<<10 {
		t.Errorf("store B's layer 1 (project %d; A's is %d) counts %d bytes: A's writes charged to B", pb, pa, got)
	}
}
