package store

import (
	"os"
	"path/filepath"
	"testing"
)

// TestCloneDir: the regular files of a directory are copied (by reflink where the
// filesystem can, by bytes elsewhere: the test's temporary directory may be either),
// a symlink is left out, and an existing destination is refused.
func TestCloneDir(t *testing.T) {
	src, dst := filepath.Join(t.TempDir(), "src"), filepath.Join(t.TempDir(), "dst")
	if err := os.Mkdir(src, 0o700); err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"a": "alpha", "b": string(make([]byte, 1<<20))}
	for n, c := range want {
		if err := os.WriteFile(filepath.Join(src, n), []byte(c), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink("a", filepath.Join(src, "link")); err != nil {
		t.Fatal(err)
	}
	if err := CloneDir(src, dst, nil, 0); err != nil {
		t.Fatal(err)
	}
	ents, err := os.ReadDir(dst)
	if err != nil {
		t.Fatal(err)
	}
	if len(ents) != len(want) {
		t.Errorf("%d entries copied, want %d", len(ents), len(want))
	}
	for n, c := range want {
		b, err := os.ReadFile(filepath.Join(dst, n))
		if err != nil || string(b) != c {
			t.Errorf("%s: %d bytes, %v; want %d bytes", n, len(b), err, len(c))
		}
	}
	if err := CloneFile(filepath.Join(src, "a"), filepath.Join(dst, "a")); !os.IsExist(err) {
		t.Errorf("clone onto an existing file: %v, want EEXIST", err)
	}
	if err := CloneFile(filepath.Join(src, "link"), filepath.Join(dst, "link")); err == nil {
		t.Error("clone of a symlink: no error, want ELOOP")
	}
}
