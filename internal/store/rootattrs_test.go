package store

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

func setTimes(t *testing.T, p string, sec int64) {
	t.Helper()
	ts := unix.NsecToTimespec(sec*1e9 + 123)
	if err := unix.UtimesNanoAt(unix.AT_FDCWD, p, []unix.Timespec{ts, ts}, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		t.Fatal(err)
	}
}

func mtime(t *testing.T, p string) int64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Lstat(p, &st); err != nil {
		t.Fatal(err)
	}
	return st.Mtim.Nano()
}

// A new upper's root gets "/"'s attributes: mode, owner, times and the sandbox's xattrs
// (an escaped trusted.overlay.overlay.* among them), never overlayfs's bookkeeping of
// either side; the sandbox's xattrs it had and the source has not are removed.
func TestCopyRootAttrs(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("trusted xattrs need root")
	}
	d := t.TempDir()
	from, to := filepath.Join(d, "from"), filepath.Join(d, "to")
	for _, p := range []string{from, to} {
		if err := os.Mkdir(p, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for k, v := range map[string]string{"user.a": "1", "trusted.b": "2", "trusted.overlay.overlay.c": "3", "trusted.overlay.impure": "y", "trusted.overlay.uuid": "u1"} {
		if err := unix.Lsetxattr(from, k, []byte(v), 0); err != nil {
			t.Skipf("xattr %s: %v", k, err)
		}
	}
	for k, v := range map[string]string{"user.stale": "s", "trusted.overlay.uuid": "u2", "user.a": "old"} {
		if err := unix.Lsetxattr(to, k, []byte(v), 0); err != nil {
			t.Fatal(err)
		}
	}
	if err := unix.Chmod(from, 0o1770); err != nil {
		t.Fatal(err)
	}
	if err := unix.Chown(from, 12, 34); err != nil {
		t.Fatal(err)
	}
	setTimes(t, from, 978307200)
	a, err := ReadRootAttrs(from)
	if err != nil {
		t.Fatal(err)
	}
	if len(a.Xattrs) != 3 || a.Xattrs[0].Name != "trusted.b" || a.Xattrs[1].Name != "trusted.overlay.overlay.c" || a.Xattrs[2].Name != "user.a" {
		t.Fatalf("the sandbox's xattrs of from: %+v", a.Xattrs)
	}
	b, _ := ReadRootAttrs(to)
	if a.Equal(b) {
		t.Fatal("Equal of different roots")
	}
	if err := CopyRootAttrs(from, to); err != nil {
		t.Fatal(err)
	}
	b, err = ReadRootAttrs(to)
	if err != nil {
		t.Fatal(err)
	}
	if !a.Equal(b) || b.Atime != a.Atime {
		t.Fatalf("after the copy:\n from %+v\n   to %+v", a, b)
	}
	if v, ok := xattr(t, to, "trusted.overlay.uuid"); !ok || v != "u2" {
		t.Fatalf("the target's own overlay uuid: %q, %v (want it kept)", v, ok)
	}
	if _, ok := xattr(t, to, "trusted.overlay.impure"); ok {
		t.Fatal("overlayfs's impure mark was copied")
	}
	if _, ok := xattr(t, to, "user.stale"); ok {
		t.Fatal("a stale xattr survived the copy")
	}
	// Atime aside: reading / moves it.
	ts := unix.NsecToTimespec(5e9)
	unix.UtimesNanoAt(unix.AT_FDCWD, to, []unix.Timespec{ts, {Nsec: unix.UTIME_OMIT}}, 0)
	if b, _ := ReadRootAttrs(to); !a.Equal(b) {
		t.Fatal("an atime change made the roots differ")
	}
	for name, change := range map[string]func(){
		"mtime":  func() { setTimes(t, to, 1) },
		"xattr":  func() { unix.Lsetxattr(to, "user.a", []byte("2"), 0) },
		"mode":   func() { unix.Chmod(to, 0o700) },
		"escape": func() { unix.Lremovexattr(to, "trusted.overlay.overlay.c") },
	} {
		if err := CopyRootAttrs(from, to); err != nil {
			t.Fatal(err)
		}
		change()
		if b, _ := ReadRootAttrs(to); a.Equal(b) {
			t.Errorf("a change of %s left the roots equal", name)
		}
	}
}

// Freeze gives frozen/ the upper root's times, after the renames that moved them; a
// failed freeze and an unfreeze give diff/ its times back.
func TestFreezeCarriesRootTimes(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root for the root attributes")
	}
	s := &Store{Root: t.TempDir()}
	newLayer(t, s, 9, 0o755, nil, "a", "b")
	setTimes(t, s.LayerDiff(9), 978307200)
	want := mtime(t, s.LayerDiff(9))
	if err := s.Freeze(9); err != nil {
		t.Fatal(err)
	}
	if got := mtime(t, s.LayerFrozen(9)); got != want {
		t.Fatalf("frozen/ mtime %d, want diff/'s %d", got, want)
	}
	if err := s.Unfreeze(9); err != nil {
		t.Fatal(err)
	}
	if got := mtime(t, s.LayerDiff(9)); got != want {
		t.Fatalf("diff/ mtime after unfreeze %d, want %d", got, want)
	}
	// A freeze that fails half-way (a name on both sides) puts the times back too.
	if err := os.MkdirAll(filepath.Join(s.LayerFrozen(9), "b"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := s.Freeze(9); err == nil {
		t.Fatal("freeze over a frozen/ holding the same name succeeded")
	}
	if got := mtime(t, s.LayerDiff(9)); got != want {
		t.Fatalf("diff/ mtime after a failed freeze %d, want %d", got, want)
	}
}
