package store

import (
	"os"
	"path/filepath"
	"slices"
	"testing"

	"golang.org/x/sys/unix"
)

// newLayer makes layer id's diff/ with entries and root attributes as an overlay upper
// would have them.
func newLayer(t *testing.T, s *Store, id uint64, mode uint32, xattrs map[string]string, entries ...string) {
	t.Helper()
	diff := s.LayerDiff(id)
	if err := os.MkdirAll(diff, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Chmod(diff, mode); err != nil {
		t.Fatal(err)
	}
	for k, v := range xattrs {
		if err := unix.Lsetxattr(diff, k, []byte(v), 0); err != nil {
			t.Skipf("no %s xattrs on %s: %v", k, diff, err)
		}
	}
	for _, e := range entries {
		if err := os.MkdirAll(filepath.Join(diff, e, "sub"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(diff, e, "sub", "f"), []byte(e), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func names(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}

func xattr(t *testing.T, p, name string) (string, bool) {
	t.Helper()
	buf := make([]byte, 256)
	n, err := unix.Lgetxattr(p, name, buf)
	if err != nil {
		return "", false
	}
	return string(buf[:n]), true
}

func TestFreezeMovesEntriesAndRootAttrs(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("trusted xattrs need root")
	}
	s := &Store{Root: t.TempDir()}
	newLayer(t, s, 7, 0o1777, map[string]string{"trusted.overlay.impure": "y", "user.a": "1"}, "workspace", "tmp")

	empty, err := IsEmptyDir(s.LayerDiff(7))
	if err != nil || empty {
		t.Fatalf("IsEmptyDir(diff with entries) = %v, %v", empty, err)
	}
	if err := s.Freeze(7); err != nil {
		t.Fatal(err)
	}
	if got := names(t, s.LayerDiff(7)); len(got) != 0 {
		t.Fatalf("diff/ after freeze has %v", got)
	}
	if got := names(t, s.LayerFrozen(7)); !slices.Equal(got, []string{"tmp", "workspace"}) {
		t.Fatalf("frozen/ has %v, want tmp workspace", got)
	}
	b, err := os.ReadFile(filepath.Join(s.LayerFrozen(7), "workspace", "sub", "f"))
	if err != nil || string(b) != "workspace" {
		t.Fatalf("moved file: %q, %v", b, err)
	}
	fi, err := os.Lstat(s.LayerFrozen(7))
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode()&os.ModePerm != 0o777 || fi.Mode()&os.ModeSticky == 0 {
		t.Fatalf("frozen/ mode %v, want the upper root's drwxrwxrwt", fi.Mode())
	}
	for k, want := range map[string]string{"trusted.overlay.impure": "y", "user.a": "1"} {
		if got, ok := xattr(t, s.LayerFrozen(7), k); !ok || got != want {
			t.Fatalf("frozen/ xattr %s = %q (present %v), want %q", k, got, ok, want)
		}
	}
	empty, err = IsEmptyDir(s.LayerDiff(7))
	if err != nil || !empty {
		t.Fatalf("IsEmptyDir(emptied diff) = %v, %v", empty, err)
	}

	if err := s.Unfreeze(7); err != nil {
		t.Fatal(err)
	}
	if got := names(t, s.LayerDiff(7)); !slices.Equal(got, []string{"tmp", "workspace"}) {
		t.Fatalf("diff/ after unfreeze has %v", got)
	}
	if _, err := os.Lstat(s.LayerFrozen(7)); !os.IsNotExist(err) {
		t.Fatalf("frozen/ still there after unfreeze: %v", err)
	}
}

// A frozen/ prepared from an earlier state of the root gets the root's attributes as
// they are at the freeze: new xattrs copied, stale ones dropped, mode updated.
func TestFreezeOverPreparedFrozen(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("trusted xattrs need root")
	}
	s := &Store{Root: t.TempDir()}
	newLayer(t, s, 3, 0o755, map[string]string{"user.stale": "x"})
	if err := s.PrepareFrozen(3); err != nil {
		t.Fatal(err)
	}
	if _, ok := xattr(t, s.LayerFrozen(3), "user.stale"); !ok {
		t.Fatal("PrepareFrozen did not copy the root's xattr")
	}
	// The sandbox changes its root after the preparation.
	diff := s.LayerDiff(3)
	unix.Lremovexattr(diff, "user.stale")
	if err := unix.Lsetxattr(diff, "trusted.overlay.impure", []byte("y"), 0); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(diff, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(diff, "new"), []byte("n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := s.Freeze(3); err != nil {
		t.Fatal(err)
	}
	frozen := s.LayerFrozen(3)
	if _, ok := xattr(t, frozen, "user.stale"); ok {
		t.Fatal("a stale xattr of the prepared frozen/ survived the freeze")
	}
	if v, ok := xattr(t, frozen, "trusted.overlay.impure"); !ok || v != "y" {
		t.Fatalf("impure xattr = %q, %v", v, ok)
	}
	fi, _ := os.Lstat(frozen)
	if fi.Mode().Perm() != 0o700 {
		t.Fatalf("frozen/ mode %v, want 0700", fi.Mode())
	}
	if got := names(t, frozen); !slices.Equal(got, []string{"new"}) {
		t.Fatalf("frozen/ has %v", got)
	}
}

// A name on both sides is never clobbered: the freeze fails and puts back what it moved.
func TestFreezeNeverClobbers(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root for the root attributes")
	}
	s := &Store{Root: t.TempDir()}
	newLayer(t, s, 5, 0o755, nil, "a", "b", "c")
	if err := os.MkdirAll(filepath.Join(s.LayerFrozen(5), "b"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := s.Freeze(5); err == nil {
		t.Fatal("freeze over a frozen/ holding the same name succeeded")
	}
	got := names(t, s.LayerDiff(5))
	if !slices.Equal(got, []string{"a", "b", "c"}) {
		t.Fatalf("diff/ after a failed freeze has %v, want a b c back", got)
	}
	if b, err := os.ReadFile(filepath.Join(s.LayerDiff(5), "b", "sub", "f")); err != nil || string(b) != "b" {
		t.Fatalf("diff/b after a failed freeze: %q, %v", b, err)
	}
}

func TestIsEmptyDirErrors(t *testing.T) {
	if _, err := IsEmptyDir(filepath.Join(t.TempDir(), "missing")); !os.IsNotExist(err) {
		t.Fatalf("IsEmptyDir(missing) err = %v, want not-exist", err)
	}
	d := t.TempDir()
	if err := os.Symlink("/", filepath.Join(d, "link")); err != nil {
		t.Fatal(err)
	}
	if _, err := IsEmptyDir(filepath.Join(d, "link")); err == nil {
		t.Fatal("IsEmptyDir followed a symlink")
	}
}
