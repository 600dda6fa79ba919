package files_test

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"deltabox/internal/errdefs"
	"deltabox/internal/files"
	"deltabox/internal/testutil"
)

// fixture is a directory standing for a sandbox's root, next to a directory standing
// for the host ("outside"), which no operation may read or change.
type fixture struct {
	base, root, outside string
	fd                  int
}

const hostSecret = "HOST-SECRET"

func newFixture(t *testing.T) *fixture {
	t.Helper()
	base := t.TempDir()
	f := &fixture{base: base, root: filepath.Join(base, "root"), outside: filepath.Join(base, "outside")}
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(f.outside, 0o755))
	must(os.WriteFile(filepath.Join(f.outside, "secret"), []byte(hostSecret), 0o600))
	for _, d := range []string{"etc", "workspace/sub/deep", "mnt", "proc", "dev/shm"} {
		must(os.MkdirAll(filepath.Join(f.root, d), 0o755))
	}
	must(os.WriteFile(filepath.Join(f.root, "etc/passwd"), []byte("SANDBOX-PASSWD"), 0o644))
	must(os.WriteFile(filepath.Join(f.root, "workspace/a.txt"), []byte("hello"), 0o640))
	must(os.WriteFile(filepath.Join(f.root, "workspace/sub/deep/z"), []byte("z"), 0o644))
	links := map[string]string{
		"up":         "../../../../../../../..",
		"abs":        "/",
		"dotdot":     "/../../../..",
		"hostsecret": filepath.Join(f.outside, "secret"), // an absolute host path
		"hostdir":    f.outside,
		"outrel":     "../../outside/secret",
		"outdir":     "../../outside",
		"loop":       "loop",
		"pself":      "/proc/self/root",
		"tofile":     "a.txt",
		"todir":      "sub",
	}
	for name, target := range links {
		must(os.Symlink(target, filepath.Join(f.root, "workspace", name)))
	}
	fd, err := unix.Open(f.root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	must(err)
	f.fd = fd
	t.Cleanup(func() { unix.Close(fd) })
	return f
}

// checkOutside fails if the host side changed: the secret is intact, and nothing new.
func (f *fixture) checkOutside(t *testing.T) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(f.outside, "secret"))
	if err != nil || string(b) != hostSecret {
		t.Fatalf("the host's secret changed: %q, %v", b, err)
	}
	ents, _ := os.ReadDir(f.outside)
	if len(ents) != 1 {
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Fatalf("something was created outside the root: %v", names)
	}
	ents, _ = os.ReadDir(f.base)
	if len(ents) != 2 {
		t.Fatalf("something was created next to the root: %d entries in %s", len(ents), f.base)
	}
}

func wantErr(t *testing.T, what string, err error, class error) {
	t.Helper()
	if err == nil {
		t.Fatalf("%s: succeeded, want an error (%v)", what, class)
	}
	if !errors.Is(err, class) {
		t.Fatalf("%s: error %q, want class %v", what, err, class)
	}
}

func TestResolve(t *testing.T) {
	for _, c := range []struct{ wd, p, want string }{
		{"/workspace", "a.py", "/workspace/a.py"},
		{"/workspace", "./sub/../b", "/workspace/b"},
		{"/workspace", "../etc/passwd", "/etc/passwd"},
		{"/workspace", "/etc//hosts/", "/etc/hosts"},
		{"/workspace", "/", "/"},
		{"/workspace", "..", "/"},
		{"/", "a/b/../../c", "/c"},
	} {
		got, err := files.Resolve(c.wd, c.p)
		if err != nil || got != c.want {
			t.Errorf("Resolve(%q, %q) = %q, %v; want %q", c.wd, c.p, got, err, c.want)
		}
	}
	for _, c := range []struct{ wd, p string }{
		{"/workspace", "../../etc/passwd"},
		{"/workspace", "/../../etc/shadow"},
		{"/workspace", "/.."},
		{"/", "a/../../b"},
		{"/workspace", "x/../../../y"},
	} {
		_, err := files.Resolve(c.wd, c.p)
		wantErr(t, "Resolve("+c.wd+", "+c.p+")", err, files.ErrEscape)
		wantErr(t, "Resolve("+c.wd+", "+c.p+")", err, errdefs.ErrInvalid)
		if !strings.Contains(err.Error(), "leaves the sandbox") {
			t.Errorf("message %q does not say the path leaves the sandbox", err)
		}
	}
	if _, err := files.Resolve("/w", ""); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("empty path: %v", err)
	}
	if _, err := files.Resolve("/w", "a\x00b"); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("NUL: %v", err)
	}
}

// TestConfinedRead: every escape through ".." or symlinks resolves inside the root
// (the sandbox's own file, or nothing), never to the host's.
func TestConfinedRead(t *testing.T) {
	f := newFixture(t)
	read := func(p string) (string, error) {
		b, _, err := files.Read(f.fd, p, 0, 0, 0)
		return string(b), err
	}
	for _, p := range []string{"/etc/passwd", "/workspace/up/etc/passwd", "/workspace/abs/etc/passwd",
		"/workspace/dotdot/etc/passwd", "/workspace/up/workspace/up/etc/passwd"} {
		got, err := read(p)
		if err != nil || got != "SANDBOX-PASSWD" {
			t.Errorf("read %s = %q, %v; want the sandbox's own /etc/passwd", p, got, err)
		}
	}
	for _, p := range []string{"/workspace/hostsecret", "/workspace/outrel", "/workspace/outdir/secret",
		"/workspace/hostdir/secret", "/workspace/up/outside/secret"} {
		got, err := read(p)
		if got == hostSecret {
			t.Fatalf("read %s returned the host's secret", p)
		}
		wantErr(t, "read "+p, err, errdefs.ErrNotFound)
	}
	_, err := read("/workspace/loop")
	wantErr(t, "read a symlink loop", err, errdefs.ErrInvalid)
	_, err = files.Stat(f.fd, "/workspace/outdir/secret")
	wantErr(t, "stat through a parent symlink", err, errdefs.ErrNotFound)
	_, err = files.List(f.fd, "/workspace/hostdir", files.ListOptions{})
	wantErr(t, "list a symlink to a host dir", err, errdefs.ErrNotFound)
	for _, p := range []string{"../etc/passwd", "/../etc/passwd", "/workspace/../../etc/passwd"} {
		_, err := read(p)
		wantErr(t, "read "+p, err, errdefs.ErrInvalid)
	}
	f.checkOutside(t)
}

// TestConfinedWrite: writes and removals through symlinks pointing outside land
// inside the root or fail; nothing outside changes.
func TestConfinedWrite(t *testing.T) {
	f := newFixture(t)
	w := func(p string, mkdir bool) error {
		_, err := files.Write(f.fd, p, strings.NewReader("PWNED"), files.WriteOptions{MkdirParents: mkdir})
		return err
	}
	// Without mkdir: the clamped target's directory does not exist in the root.
	for _, p := range []string{"/workspace/outrel", "/workspace/hostsecret", "/workspace/outdir/new", "/workspace/hostdir/new"} {
		wantErr(t, "write "+p, w(p, false), errdefs.ErrNotFound)
	}
	f.checkOutside(t)
	// With mkdir: created inside the root.
	if err := w("/workspace/outrel", true); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(f.root, "outside/secret")); err != nil || string(b) != "PWNED" {
		t.Fatalf("write through ../../outside/secret: want the root's /outside/secret, got %q, %v", b, err)
	}
	if err := w("/workspace/hostsecret", true); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(f.root, f.outside, "secret")); err != nil || string(b) != "PWNED" {
		t.Fatalf("write through an absolute host path: want it under the root, got %q, %v", b, err)
	}
	if l, err := os.Readlink(filepath.Join(f.root, "workspace/hostsecret")); err != nil || l != filepath.Join(f.outside, "secret") {
		t.Fatalf("the symlink itself changed: %q, %v", l, err)
	}
	for _, p := range []string{"/workspace/up/x", "/workspace/dotdot/y"} {
		if err := w(p, false); err != nil {
			t.Fatalf("write %s: %v", p, err)
		}
	}
	for _, n := range []string{"x", "y"} {
		if _, err := os.Stat(filepath.Join(f.root, n)); err != nil {
			t.Fatalf("write through a symlink to /..: want /%s in the root: %v", n, err)
		}
	}
	// Removing a symlink removes the link, never its target.
	if err := files.Remove(f.fd, "/workspace/hostsecret", false); err != nil {
		t.Fatal(err)
	}
	if err := files.Remove(f.fd, "/workspace/outdir", true); err != nil {
		t.Fatal(err)
	}
	// The writes above made the root's own copy of the host path: a removal through
	// the symlink to the host dir removes that copy, a mkdir lands next to it.
	if err := files.Remove(f.fd, "/workspace/hostdir/secret", false); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(f.root, f.outside, "secret")); !os.IsNotExist(err) {
		t.Fatalf("remove through a symlink to a host dir: the root's copy is still there: %v", err)
	}
	if _, err := files.Mkdir(f.fd, "/workspace/hostdir/d", 0, false); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(filepath.Join(f.root, f.outside, "d")); err != nil || !fi.IsDir() {
		t.Fatalf("mkdir through a symlink to a host dir: want it under the root: %v", err)
	}
	// mkdir -p meets a dangling symlink: EEXIST, as mkdir(1) says.
	os.Symlink("/nonexistent/dir", filepath.Join(f.root, "workspace/dangling"))
	_, err := files.Mkdir(f.fd, "/workspace/dangling/d", 0, true)
	wantErr(t, "mkdir -p through a dangling symlink", err, errdefs.ErrConflict)
	wantErr(t, "remove through a dangling symlink", files.Remove(f.fd, "/workspace/dangling/d", false), errdefs.ErrNotFound)
	for _, p := range []string{"/..", "/../x", "/workspace/../../x"} {
		wantErr(t, "write "+p, w(p, true), files.ErrEscape)
		wantErr(t, "remove "+p, files.Remove(f.fd, p, true), files.ErrEscape)
	}
	f.checkOutside(t)
}

// TestMounts: another mount inside the root (the sandbox's /proc, /dev, /dev/shm) is
// never entered, and /proc's magic links are refused.
func TestMounts(t *testing.T) {
	testutil.Require(t, os.Geteuid() == 0, "needs root to mount")
	f := newFixture(t)
	mnt, proc := filepath.Join(f.root, "mnt"), filepath.Join(f.root, "proc")
	if err := unix.Mount("tmpfs", mnt, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(mnt, unix.MNT_DETACH) })
	if err := unix.Mount("proc", proc, "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(proc, unix.MNT_DETACH) })
	if err := os.WriteFile(filepath.Join(mnt, "x"), []byte("other mount"), 0o644); err != nil {
		t.Fatal(err)
	}
	other := func(what string, err error) {
		t.Helper()
		wantErr(t, what, err, files.ErrOtherMount)
		wantErr(t, what, err, errdefs.ErrInvalid)
	}
	for _, p := range []string{"/mnt/x", "/proc/self/root/etc/passwd", "/proc/1/root/etc/passwd", "/proc/self/status",
		"/workspace/pself/etc/passwd", "/workspace/up/proc/1/root/etc/passwd"} {
		_, _, err := files.Read(f.fd, p, 0, 0, 0)
		other("read "+p, err)
	}
	_, err := files.List(f.fd, "/mnt", files.ListOptions{})
	other("list /mnt", err)
	_, err = files.List(f.fd, "/proc/1", files.ListOptions{})
	other("list /proc/1", err)
	_, err = files.Stat(f.fd, "/proc/1")
	other("stat /proc/1", err)
	_, err = files.Write(f.fd, "/mnt/y", strings.NewReader("y"), files.WriteOptions{})
	other("write /mnt/y", err)
	_, err = files.Write(f.fd, "/mnt", strings.NewReader("y"), files.WriteOptions{})
	other("write over the mount point /mnt", err)
	other("remove /mnt", files.Remove(f.fd, "/mnt", true))
	other("remove /proc/self", files.Remove(f.fd, "/proc/self", false))
	if _, err := os.Stat(filepath.Join(mnt, "y")); err == nil {
		t.Fatal("a write reached the other mount")
	}
	// Stat of a mount point says so; listings show it but do not enter it.
	in, err := files.Stat(f.fd, "/mnt")
	if err != nil || !in.MountPoint {
		t.Fatalf("stat /mnt: %+v, %v; want mount_point", in, err)
	}
	l, err := files.List(f.fd, "/", files.ListOptions{Recursive: true})
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]files.Info{}
	for _, e := range l.Entries {
		seen[e.Path] = e
		if strings.HasPrefix(e.Path, "/mnt/") || strings.HasPrefix(e.Path, "/proc/") {
			t.Fatalf("a recursive listing entered another mount: %s", e.Path)
		}
	}
	if !seen["/mnt"].MountPoint || !seen["/proc"].MountPoint || seen["/etc"].MountPoint {
		t.Fatalf("mount points in the listing: /mnt %+v, /proc %+v", seen["/mnt"], seen["/proc"])
	}
	// Removing a tree with a mount inside stops at the mount.
	if err := os.MkdirAll(filepath.Join(f.root, "tree/m"), 0o755); err != nil {
		t.Fatal(err)
	}
	tm := filepath.Join(f.root, "tree/m")
	if err := unix.Mount("tmpfs", tm, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(tm, unix.MNT_DETACH) })
	os.WriteFile(filepath.Join(tm, "keep"), nil, 0o644)
	other("remove a tree holding a mount", files.Remove(f.fd, "/tree", true))
	if _, err := os.Stat(filepath.Join(tm, "keep")); err != nil {
		t.Fatal("a recursive remove entered another mount")
	}
	f.checkOutside(t)
}

func TestReadWrite(t *testing.T) {
	f := newFixture(t)
	a := filepath.Join(f.root, "workspace/a.txt")
	var before unix.Stat_t
	unix.Stat(a, &before)
	in, err := files.Write(f.fd, "/workspace/a.txt", strings.NewReader("new content"), files.WriteOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var after unix.Stat_t
	unix.Stat(a, &after)
	if in.Mode != 0o640 || after.Mode&0o7777 != 0o640 || in.Size != 11 || in.Type != "file" || in.Path != "/workspace/a.txt" || in.Name != "a.txt" {
		t.Fatalf("overwrite: %+v (mode on disk %o); want mode 0640 kept, size 11", in, after.Mode&0o7777)
	}
	if before.Ino == after.Ino {
		t.Fatal("overwrite reused the inode: not an atomic replace")
	}
	b, got, err := files.Read(f.fd, "/workspace/a.txt", 0, 0, 0)
	if err != nil || string(b) != "new content" || got.Size != 11 {
		t.Fatalf("read back: %q %+v %v", b, got, err)
	}
	// Ranges and the cap.
	b, _, err = files.Read(f.fd, "/workspace/a.txt", 4, 3, 0)
	if err != nil || string(b) != "con" {
		t.Fatalf("range: %q %v", b, err)
	}
	b, _, err = files.Read(f.fd, "/workspace/a.txt", 100, 0, 0)
	if err != nil || len(b) != 0 {
		t.Fatalf("past the end: %q %v", b, err)
	}
	_, _, err = files.Read(f.fd, "/workspace/a.txt", 0, 0, 5)
	wantErr(t, "read over the cap", err, errdefs.ErrInvalid)
	if !strings.Contains(err.Error(), "offset and length") {
		t.Fatalf("the cap's message should say how to read in ranges: %v", err)
	}
	if b, _, err = files.Read(f.fd, "/workspace/a.txt", 5, 0, 6); err != nil || string(b) != "ontent" {
		t.Fatalf("a range under the cap: %q %v", b, err)
	}
	_, err = files.Write(f.fd, "/workspace/big", bytes.NewReader(make([]byte, 11)), files.WriteOptions{MaxBytes: 10})
	wantErr(t, "write over the cap", err, errdefs.ErrInvalid)
	if _, err := os.Stat(filepath.Join(f.root, "workspace/big")); err == nil {
		t.Fatal("a refused write left a file")
	}
	// A new file gets 0644 whatever the umask; an explicit mode wins.
	old := syscall.Umask(0o077)
	in, err = files.Write(f.fd, "/workspace/new.sh", strings.NewReader("#!/bin/sh\n"), files.WriteOptions{})
	syscall.Umask(old)
	if err != nil || in.Mode != 0o644 {
		t.Fatalf("new file: %+v %v", in, err)
	}
	in, err = files.Write(f.fd, "/workspace/new.sh", strings.NewReader("#!/bin/sh\n"), files.WriteOptions{Mode: 0o4755, HasMode: true})
	if err != nil || in.Mode != 0o4755 || in.Permissions != "-rwsr-xr-x" {
		t.Fatalf("explicit mode: %+v %v", in, err)
	}
	// Through a symlink: the target is replaced, the link stays.
	if _, err := files.Write(f.fd, "/workspace/tofile", strings.NewReader("via link"), files.WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(a); string(b) != "via link" {
		t.Fatalf("write through a symlink: target has %q", b)
	}
	if fi, err := os.Lstat(filepath.Join(f.root, "workspace/tofile")); err != nil || fi.Mode()&os.ModeSymlink == 0 {
		t.Fatal("write through a symlink replaced the link")
	}
	// Directories and special files.
	_, err = files.Write(f.fd, "/workspace/sub", strings.NewReader("x"), files.WriteOptions{})
	wantErr(t, "write over a directory", err, errdefs.ErrInvalid)
	_, err = files.Write(f.fd, "/workspace/todir", strings.NewReader("x"), files.WriteOptions{})
	wantErr(t, "write over a symlink to a directory", err, errdefs.ErrInvalid)
	_, err = files.Write(f.fd, "/", strings.NewReader("x"), files.WriteOptions{})
	wantErr(t, "write /", err, errdefs.ErrInvalid)
	_, _, err = files.Read(f.fd, "/workspace/sub", 0, 0, 0)
	wantErr(t, "read a directory", err, errdefs.ErrInvalid)
	if err := unix.Mkfifo(filepath.Join(f.root, "workspace/fifo"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, _, err = files.Read(f.fd, "/workspace/fifo", 0, 0, 0) // would block if opened
	wantErr(t, "read a FIFO", err, errdefs.ErrInvalid)
	// mkdir of parents.
	_, err = files.Write(f.fd, "/workspace/n1/n2/f", strings.NewReader("x"), files.WriteOptions{})
	wantErr(t, "write without parents", err, errdefs.ErrNotFound)
	if _, err := files.Write(f.fd, "/workspace/n1/n2/f", strings.NewReader("x"), files.WriteOptions{MkdirParents: true}); err != nil {
		t.Fatal(err)
	}
	// No temp file is left behind.
	ents, _ := os.ReadDir(filepath.Join(f.root, "workspace"))
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), ".deltabox-tmp") {
			t.Fatalf("temp file left: %s", e.Name())
		}
	}
	f.checkOutside(t)
}

func TestListStatRemoveMkdir(t *testing.T) {
	f := newFixture(t)
	l, err := files.List(f.fd, "/workspace", files.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	byName := map[string]files.Info{}
	for _, e := range l.Entries {
		byName[e.Name] = e
	}
	if a := byName["a.txt"]; a.Type != "file" || a.Size != 5 || a.Mode != 0o640 || a.Path != "/workspace/a.txt" {
		t.Fatalf("a.txt: %+v", a)
	}
	if s := byName["hostsecret"]; s.Type != "symlink" || s.LinkTarget != filepath.Join(f.outside, "secret") {
		t.Fatalf("symlink entry: %+v", s)
	}
	if byName["sub"].Type != "dir" || len(l.Entries) != 13 || l.Truncated {
		t.Fatalf("listing: %d entries, truncated %v: %+v", len(l.Entries), l.Truncated, l.Entries)
	}
	// A symlink to a directory is listed through; recursion follows no symlink.
	l, err = files.List(f.fd, "/workspace/todir", files.ListOptions{Recursive: true})
	if err != nil || len(l.Entries) != 2 || l.Entries[1].Path != "/workspace/todir/deep/z" {
		t.Fatalf("recursive via a symlink: %+v %v", l, err)
	}
	l, err = files.List(f.fd, "/", files.ListOptions{Recursive: true, MaxDepth: 1})
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range l.Entries {
		if strings.Count(e.Path, "/") > 1 {
			t.Fatalf("depth 1 listed %s", e.Path)
		}
	}
	l, err = files.List(f.fd, "/", files.ListOptions{Recursive: true, MaxEntries: 3})
	if err != nil || len(l.Entries) != 3 || !l.Truncated {
		t.Fatalf("entry cap: %d entries, truncated %v, %v", len(l.Entries), l.Truncated, err)
	}
	_, err = files.List(f.fd, "/workspace/a.txt", files.ListOptions{})
	wantErr(t, "list a file", err, errdefs.ErrInvalid)
	_, err = files.List(f.fd, "/nope", files.ListOptions{})
	wantErr(t, "list a missing dir", err, errdefs.ErrNotFound)

	in, err := files.Stat(f.fd, "/")
	if err != nil || in.Type != "dir" || in.Name != "/" || in.MountPoint {
		t.Fatalf("stat /: %+v %v", in, err)
	}
	in, err = files.Stat(f.fd, "/workspace/tofile")
	if err != nil || in.Type != "symlink" || in.LinkTarget != "a.txt" {
		t.Fatalf("stat a symlink: %+v %v", in, err)
	}
	_, err = files.Stat(f.fd, "/workspace/nope")
	wantErr(t, "stat a missing file", err, errdefs.ErrNotFound)

	created, err := files.Mkdir(f.fd, "/workspace/m1/m2", 0o700, true)
	if err != nil || !created {
		t.Fatalf("mkdir -p: %v %v", created, err)
	}
	if in, _ := files.Stat(f.fd, "/workspace/m1/m2"); in.Mode != 0o700 {
		t.Fatalf("mkdir mode: %o", in.Mode)
	}
	if _, err := files.Mkdir(f.fd, "/workspace/sticky", 0o1777, false); err != nil {
		t.Fatal(err)
	}
	if in, _ := files.Stat(f.fd, "/workspace/sticky"); in.Permissions != "drwxrwxrwt" || in.Mode != 0o1777 {
		t.Fatalf("sticky dir: %+v", in)
	}
	if created, err := files.Mkdir(f.fd, "/workspace/m1/m2", 0, true); err != nil || created {
		t.Fatalf("mkdir -p of an existing dir: %v %v", created, err)
	}
	_, err = files.Mkdir(f.fd, "/workspace/m1", 0, false)
	wantErr(t, "mkdir of an existing dir", err, errdefs.ErrConflict)
	_, err = files.Mkdir(f.fd, "/workspace/a.txt/x", 0, true)
	wantErr(t, "mkdir under a file", err, errdefs.ErrConflict)

	wantErr(t, "remove a non-empty dir", files.Remove(f.fd, "/workspace/m1", false), errdefs.ErrConflict)
	if err := files.Remove(f.fd, "/workspace/m1", true); err != nil {
		t.Fatal(err)
	}
	if err := files.Remove(f.fd, "/workspace/tofile", false); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(f.root, "workspace/a.txt")); err != nil {
		t.Fatal("removing a symlink removed its target")
	}
	wantErr(t, "remove a missing file", files.Remove(f.fd, "/workspace/m1", false), errdefs.ErrNotFound)
	wantErr(t, "remove /", files.Remove(f.fd, "/", true), errdefs.ErrInvalid)
	if err := files.Remove(f.fd, "/workspace", true); err != nil {
		t.Fatal(err)
	}
	f.checkOutside(t)
}

// TestEmptyDir: a missing or empty directory is empty; a filled one, a file and a final
// symlink (even to an empty directory) are not; a symlink earlier in the path resolves
// inside the sandbox (the host's directory, which holds a file, is missing there).
func TestEmptyDir(t *testing.T) {
	f := newFixture(t)
	if err := os.MkdirAll(filepath.Join(f.root, "workspace/empty"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("empty", filepath.Join(f.root, "workspace/toempty")); err != nil {
		t.Fatal(err)
	}
	for p, want := range map[string]bool{
		"/workspace/missing":            true,
		"/workspace/empty":              true,
		"/workspace/up/workspace/empty": true,
		"/workspace/up" + f.outside:     true,
		"/workspace/sub":                false,
		"/workspace/a.txt":              false,
		"/workspace/toempty":            false,
	} {
		if got := files.EmptyDir(f.fd, p); got != want {
			t.Errorf("EmptyDir(%s) = %v, want %v", p, got, want)
		}
	}
}
