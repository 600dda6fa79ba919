package squash

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"deltabox/internal/overlay"
	"deltabox/internal/testutil"
)

// TestSquashShowsTheSameTree: a chain of layers, each made through a real overlay the
// way a sandbox's checkpoints make them (new files, an image file deleted, one
// rewritten, a directory of the image renamed (a redirect), one replaced by a file, a
// file replaced by a directory, an opaque directory, chmod and chown, xattrs, hard
// links, symlinks, a fifo, a removed file re-created), squashed into one layer: the
// squashed layer over the image shows exactly the tree the whole stack shows (types,
// modes, owners, sizes, bytes, link targets, xattrs, non-directory mtimes), and it is
// smaller than the stack would be as a copy: the image's unchanged files are not in it.
func TestSquashShowsTheSameTree(t *testing.T) {
	testutil.RequireStore(t)
	dir, err := os.MkdirTemp(filepath.Join(testutil.MainRoot(), "tmp"), "squash-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	base := filepath.Join(dir, "base")
	must(t, os.MkdirAll(filepath.Join(base, "etc/conf.d"), 0o755))
	must(t, os.MkdirAll(filepath.Join(base, "usr/lib/py"), 0o755))
	must(t, os.MkdirAll(filepath.Join(base, "old/sub"), 0o755))
	must(t, os.MkdirAll(filepath.Join(base, "gone"), 0o755))
	must(t, os.MkdirAll(filepath.Join(base, "opaque"), 0o755))
	for _, f := range []string{"etc/passwd", "etc/conf.d/a", "usr/lib/py/x.py", "usr/lib/py/y.py", "old/sub/f", "old/g", "gone/h", "opaque/o1", "file-to-dir", "keep"} {
		must(t, os.WriteFile(filepath.Join(base, f), []byte("image:"+f), 0o644))
	}
	must(t, os.Link(filepath.Join(base, "keep"), filepath.Join(base, "keep-link")))
	must(t, os.Symlink("etc/passwd", filepath.Join(base, "pw")))

	// Each step runs in a fresh upper over the stack so far, like a checkpoint.
	steps := []func(r string){
		func(r string) {
			must(t, os.WriteFile(r+"/workspace-a", []byte("a1"), 0o644))
			must(t, os.Remove(r+"/etc/conf.d/a"))
			must(t, os.WriteFile(r+"/usr/lib/py/x.py", []byte("rewritten"), 0o644))
			must(t, os.Rename(r+"/old", r+"/new")) // a merged directory renamed: redirect_dir
		},
		func(r string) {
			must(t, os.RemoveAll(r+"/gone"))
			must(t, os.WriteFile(r+"/gone", []byte("now a file"), 0o600))
			must(t, os.Remove(r+"/file-to-dir"))
			must(t, os.Mkdir(r+"/file-to-dir", 0o750))
			must(t, os.WriteFile(r+"/file-to-dir/inside", []byte("in"), 0o640))
			must(t, os.Chmod(r+"/usr/lib/py/y.py", 0o600))
			must(t, os.Chown(r+"/etc/passwd", 1000, 1000))
			must(t, unix.Setxattr(r+"/workspace-a", "user.note", []byte("hello"), 0))
		},
		func(r string) {
			must(t, os.RemoveAll(r+"/opaque"))
			must(t, os.Mkdir(r+"/opaque", 0o700)) // re-created: overlayfs makes it opaque
			must(t, os.WriteFile(r+"/opaque/o2", []byte("o2"), 0o644))
			must(t, os.Link(r+"/workspace-a", r+"/workspace-a-link"))
			must(t, os.WriteFile(r+"/workspace-b", []byte("b"), 0o644))
			must(t, os.Link(r+"/workspace-b", r+"/workspace-b-link"))
			must(t, unix.Mkfifo(r+"/fifo", 0o644))
			must(t, os.Symlink("/nowhere", r+"/dangling"))
			must(t, os.Remove(r+"/workspace-a"))
			must(t, os.WriteFile(r+"/workspace-a", []byte("a2 after removal"), 0o644))
			must(t, os.WriteFile(r+"/new/sub/f", []byte("changed in the renamed dir"), 0o644))
			must(t, os.Chmod(r+"/usr/lib", 0o711))
		},
	}
	var layers []string // top first
	for i, step := range steps {
		up, work := filepath.Join(dir, fmt.Sprint("up", i)), filepath.Join(dir, fmt.Sprint("work", i))
		must(t, os.Mkdir(up, 0o755))
		must(t, os.Mkdir(work, 0o700))
		fd, err := overlay.Mount(overlay.Spec{Lowers: append(append([]string{}, layers...), base), Upper: up, Work: work})
		if err != nil {
			t.Fatal(err)
		}
		step(fmt.Sprintf("/proc/self/fd/%d", fd))
		unix.Close(fd)
		layers = append([]string{up}, layers...)
	}

	view, err := overlay.Mount(overlay.Spec{Lowers: append(append([]string{}, layers...), base)})
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(view)
	out := filepath.Join(dir, "squashed")
	must(t, os.Mkdir(out, 0o755))
	st, err := Build(view, base, layers, out)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("squash: %+v", *st)
	sq, err := overlay.Mount(overlay.Spec{Lowers: []string{out, base}})
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(sq)

	want := describe(t, fmt.Sprintf("/proc/self/fd/%d/", view))
	got := describe(t, fmt.Sprintf("/proc/self/fd/%d/", sq))
	if w, g := strings.Join(want, "\n"), strings.Join(got, "\n"); w != g {
		t.Errorf("the squashed layer shows another tree:\nwant\n%s\ngot\n%s", w, g)
	}
	for _, p := range []string{"keep", "etc/conf.d", "usr/lib/py/x.py"} {
		// Unchanged image entries stay out (x.py was rewritten: it is in; conf.d lost a
		// file: it is in, as a directory holding a whiteout).
		_, err := os.Lstat(filepath.Join(out, p))
		if in := err == nil; in != (p != "keep") {
			t.Errorf("%s in the squashed layer: %v", p, in)
		}
	}
	if st.Copied != 0 {
		t.Errorf("%d files copied byte by byte: every file has a real source to reflink", st.Copied)
	}
	if st.Whiteouts == 0 || st.Links == 0 {
		t.Errorf("no whiteout or no hard link written: %+v", *st)
	}
}

// describe lists a tree: one line per entry with what an overlay's user can see of it.
func describe(t *testing.T, root string) []string {
	var out []string
	inodes := map[uint64]string{}
	err := filepath.Walk(root, func(p string, fi os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		rel := strings.TrimPrefix(p, root)
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		line := fmt.Sprintf("%s mode=%o uid=%d gid=%d", rel, st.Mode, st.Uid, st.Gid)
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFREG:
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			h := sha256.Sum256(b)
			line += fmt.Sprintf(" size=%d sha=%s mtime=%d nlink=%d", st.Size, hex.EncodeToString(h[:6]), st.Mtim.Nano(), st.Nlink)
			if first, ok := inodes[st.Ino]; ok {
				line += " same-inode-as=" + first
			} else {
				inodes[st.Ino] = rel
			}
		case unix.S_IFLNK:
			target, _ := os.Readlink(p)
			line += " -> " + target
		case unix.S_IFDIR:
		default:
			line += fmt.Sprintf(" rdev=%d mtime=%d", st.Rdev, st.Mtim.Nano())
		}
		buf := make([]byte, 4096)
		if n, err := unix.Llistxattr(p, buf); err == nil && n > 0 {
			names := strings.Split(strings.TrimRight(string(buf[:n]), "\x00"), "\x00")
			sort.Strings(names)
			for _, k := range names {
				v := make([]byte, 4096)
				m, _ := unix.Lgetxattr(p, k, v)
				line += fmt.Sprintf(" %s=%q", k, v[:max(m, 0)])
			}
		}
		out = append(out, line)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
