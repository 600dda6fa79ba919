package transfer

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"deltabox/internal/testutil"
)

func requireRoot(t *testing.T) {
	testutil.Require(t, os.Geteuid() == 0, "needs root: owners, whiteouts (mknod) and trusted.* xattrs")
}

// scratch is a directory on the store's filesystem when there is one (XFS: trusted
// xattrs, holes), else a temporary one.
func scratch(t *testing.T) string {
	base := filepath.Join(testutil.MainRoot(), "tmp")
	if _, err := os.Stat(base); err != nil {
		return t.TempDir()
	}
	d, err := os.MkdirTemp(base, "transfer-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// makeLayer builds a tree with what a layer holds: owners, modes, xattrs, whiteouts, an
// opaque directory, links, a fifo, a socket, a sparse file.
func makeLayer(t *testing.T, d string) {
	must(t, os.Chmod(d, 0o755))
	must(t, os.MkdirAll(filepath.Join(d, "workspace/sub"), 0o750))
	must(t, os.Chown(filepath.Join(d, "workspace/sub"), 1000, 1001))
	must(t, os.Mkdir(filepath.Join(d, "tmp"), 0o777))
	must(t, os.Chmod(filepath.Join(d, "tmp"), 0o1777))
	must(t, os.WriteFile(filepath.Join(d, "workspace/a.txt"), []byte("hello\n"), 0o644))
	must(t, os.WriteFile(filepath.Join(d, "workspace/sub/suid"), []byte("#!/bin/sh\n"), 0o755))
	must(t, os.Chown(filepath.Join(d, "workspace/sub/suid"), 0, 0))
	must(t, os.Chmod(filepath.Join(d, "workspace/sub/suid"), 0o4755))
	must(t, os.WriteFile(filepath.Join(d, "workspace/empty"), nil, 0o600))
	must(t, unix.Setxattr(filepath.Join(d, "workspace/a.txt"), "user.note", []byte("v1"), 0))
	must(t, unix.Setxattr(filepath.Join(d, "workspace/a.txt"), "trusted.overlay.overlay.mine", []byte("escaped"), 0))
	must(t, unix.Setxattr(filepath.Join(d, "workspace/a.txt"), "trusted.overlay.origin", []byte{0, 1, 2}, 0))
	// A deleted file (whiteout) and an opaque directory, as overlayfs writes them.
	must(t, unix.Mknod(filepath.Join(d, "workspace/gone"), unix.S_IFCHR|0o000, 0))
	must(t, os.Chown(filepath.Join(d, "workspace/gone"), 1000, 1000))
	must(t, os.Mkdir(filepath.Join(d, "opq"), 0o755))
	must(t, unix.Setxattr(filepath.Join(d, "opq"), "trusted.overlay.opaque", []byte("y"), 0))
	must(t, os.Symlink("/usr/bin/python3", filepath.Join(d, "workspace/abs")))
	must(t, os.Symlink("../a.txt", filepath.Join(d, "workspace/sub/rel")))
	must(t, os.Lchown(filepath.Join(d, "workspace/sub/rel"), 1000, 1001))
	must(t, unix.Lsetxattr(filepath.Join(d, "workspace/sub/rel"), "trusted.overlay.overlay.l", []byte("on a link"), 0))
	must(t, os.Link(filepath.Join(d, "workspace/a.txt"), filepath.Join(d, "workspace/hard")))
	must(t, unix.Mkfifo(filepath.Join(d, "workspace/fifo"), 0o640))
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM, 0)
	must(t, err)
	must(t, unix.Bind(fd, &unix.SockaddrUnix{Name: filepath.Join(d, "workspace/sock")}))
	unix.Close(fd)
	f, err := os.Create(filepath.Join(d, "workspace/sparse"))
	must(t, err)
	must(t, f.Truncate(64<<20))
	_, err = f.WriteAt(bytes.Repeat([]byte("x"), 8192), 32<<20)
	must(t, err)
	f.Close()
}

// snapshot describes every entry of a tree: type, mode, owner, size, content digest,
// device, link target, xattrs, mtime, and which names share an inode.
func snapshot(t *testing.T, root string) map[string]string {
	out := map[string]string{}
	inodes := map[uint64]string{}
	filepath.Walk(root, func(p string, _ os.FileInfo, err error) error {
		must(t, err)
		rel, _ := filepath.Rel(root, p)
		var st unix.Stat_t
		must(t, unix.Lstat(p, &st))
		s := fmt.Sprintf("mode=%o uid=%d gid=%d rdev=%d mtime=%d.%09d", st.Mode, st.Uid, st.Gid, st.Rdev, st.Mtim.Sec, st.Mtim.Nsec)
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFREG:
			b, err := os.ReadFile(p)
			must(t, err)
			s += fmt.Sprintf(" size=%d sha=%x", len(b), sha256.Sum256(b))
			if st.Nlink > 1 {
				if first, ok := inodes[st.Ino]; ok {
					s += " link=" + first
				} else {
					inodes[st.Ino] = rel
				}
			}
		case unix.S_IFLNK:
			l, _ := os.Readlink(p)
			s += " -> " + l
		}
		xs, err := readXattrs(p)
		must(t, err)
		var ks []string
		for k, v := range xs {
			ks = append(ks, k+"="+v)
		}
		sort.Strings(ks)
		out[rel] = s + " xattrs=" + strings.Join(ks, ",")
		return nil
	})
	return out
}

func extract(t *testing.T, r io.Reader) (string, error) {
	dst := filepath.Join(scratch(t), "out")
	must(t, os.Mkdir(dst, 0o700))
	return dst, ExtractTree(context.Background(), r, dst, Limits{MaxBytes: 1 << 30, MaxEntries: 1 << 20})
}

// TestTreeRoundTrip: a layer written by WriteTree and read by ExtractTree comes back
// identical (owners, modes with setuid, xattrs, whiteouts, an opaque directory, links,
// a fifo, times), the sparse file's holes stay out of the archive and out of the
// copy, a socket is skipped and counted, the host's file handles (overlay origin) are
// left out, and the digest of the copy is the digest of the original.
func TestTreeRoundTrip(t *testing.T) {
	requireRoot(t)
	src := filepath.Join(scratch(t), "src")
	must(t, os.Mkdir(src, 0o755))
	makeLayer(t, src)
	var buf bytes.Buffer
	st, err := WriteTree(&buf, src)
	must(t, err)
	if st.Sockets != 1 {
		t.Errorf("sockets skipped: %d, want 1", st.Sockets)
	}
	if st.Holes < 60<<20 || buf.Len() > 1<<20 {
		t.Errorf("the sparse file's holes: %d bytes left out, archive %d bytes; want its 64 MiB of holes out", st.Holes, buf.Len())
	}
	dst, err := extract(t, bytes.NewReader(buf.Bytes()))
	must(t, err)
	want, got := snapshot(t, src), snapshot(t, dst)
	delete(want, "workspace/sock")
	for k := range want {
		want[k] = strings.Replace(want[k], "trusted.overlay.origin=\x00\x01\x02,", "", 1)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s:\n got  %q\n want %q", k, got[k], v)
		}
	}
	for k := range got {
		if _, ok := want[k]; !ok {
			t.Errorf("%s: extra entry", k)
		}
	}
	var sst unix.Stat_t
	must(t, unix.Stat(filepath.Join(dst, "workspace/sparse"), &sst))
	if sst.Blocks*512 > 1<<20 {
		t.Errorf("the sparse file takes %d bytes on disk after extraction, want its 8 KiB of data", sst.Blocks*512)
	}
	d1, n1, _, err := Digest(src)
	must(t, err)
	d2, n2, _, err := Digest(dst)
	must(t, err)
	if d1 != d2 || n1 != n2 {
		t.Errorf("digest of the copy %s (%d) differs from the original's %s (%d)", d2, n2, d1, n1)
	}
}

type ent struct {
	name, link string
	typ        byte
	body       string
	major      int64
	pax        map[string]string
}

func mkTar(t *testing.T, ents ...ent) []byte {
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	for _, e := range append([]ent{{name: ".", typ: tar.TypeDir}}, ents...) {
		h := &tar.Header{Name: e.name, Typeflag: e.typ, Linkname: e.link, Mode: 0o755, Size: int64(len(e.body)), Devmajor: e.major, PAXRecords: e.pax, Format: tar.FormatPAX}
		if e.typ != tar.TypeReg {
			h.Size = 0
		}
		must(t, tw.WriteHeader(h))
		io.WriteString(tw, e.body)
	}
	must(t, tw.Close())
	return b.Bytes()
}

// TestHostileTrees: every way out of the layer, and every entry a layer does not
// hold, is refused with a message naming it.
func TestHostileTrees(t *testing.T) {
	requireRoot(t)
	outside := filepath.Join(scratch(t), "outside")
	must(t, os.Mkdir(outside, 0o755))
	for _, c := range []struct {
		name string
		ents []ent
		want string
	}{
		{"dotdot", []ent{{name: "../x", typ: tar.TypeReg, body: "x"}}, `".." component`},
		{"dotdot-deep", []ent{{name: "a", typ: tar.TypeDir}, {name: "a/../../x", typ: tar.TypeReg, body: "x"}}, `".." component`},
		{"absolute", []ent{{name: "/etc/x", typ: tar.TypeReg, body: "x"}}, "absolute path"},
		{"through-symlink", []ent{{name: "evil", typ: tar.TypeSymlink, link: outside}, {name: "evil/x", typ: tar.TypeReg, body: "x"}}, "goes through a symbolic link"},
		{"through-dotdot-symlink", []ent{{name: "evil", typ: tar.TypeSymlink, link: "/"}, {name: "evil/tmp", typ: tar.TypeDir}}, "goes through a symbolic link"},
		{"symlink-climbs", []ent{{name: "a", typ: tar.TypeDir}, {name: "a/l", typ: tar.TypeSymlink, link: "../../etc/passwd"}}, "escapes the layer"},
		{"hardlink-out", []ent{{name: "h", typ: tar.TypeLink, link: "../../etc/passwd"}}, "not a file of the layer"},
		{"hardlink-abs", []ent{{name: "h", typ: tar.TypeLink, link: "/etc/passwd"}}, "not a file of the layer"},
		{"hardlink-missing", []ent{{name: "h", typ: tar.TypeLink, link: "nope"}}, "not earlier in the archive"},
		{"hardlink-via-symlink", []ent{{name: "evil", typ: tar.TypeSymlink, link: "/etc"}, {name: "h", typ: tar.TypeLink, link: "evil/passwd"}}, "goes through a symbolic link"},
		{"char-device", []ent{{name: "null", typ: tar.TypeChar, major: 1}}, "character device 1:0"},
		{"block-device", []ent{{name: "sda", typ: tar.TypeBlock, major: 8}}, "block device"},
		{"trusted-xattr", []ent{{name: "f", typ: tar.TypeReg, pax: map[string]string{"SCHILY.xattr.trusted.evil": "1"}}}, `"trusted.evil" is not part of a layer`},
		{"overlay-origin", []ent{{name: "f", typ: tar.TypeReg, pax: map[string]string{"SCHILY.xattr.trusted.overlay.origin": "1"}}}, "not part of a layer"},
		{"orphan", []ent{{name: "no/dir/f", typ: tar.TypeReg}}, "is not earlier in the archive"},
		{"twice", []ent{{name: "f", typ: tar.TypeReg}, {name: "f", typ: tar.TypeReg}}, "written twice"},
		{"sparse-lies", []ent{{name: "f", typ: tar.TypeReg, body: "abc", pax: map[string]string{paxSparse: "10 8:5"}}}, "bad sparse map"},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := extract(t, bytes.NewReader(mkTar(t, c.ents...)))
			if err == nil || !strings.Contains(err.Error(), c.want) || !errors.Is(err, ErrRefused) {
				t.Fatalf("got %v, want a refusal saying %q", err, c.want)
			}
			if ents, _ := os.ReadDir(outside); len(ents) != 0 {
				t.Fatalf("something was written outside: %v", ents)
			}
		})
	}
	// The root must come first.
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	tw.WriteHeader(&tar.Header{Name: "x", Typeflag: tar.TypeDir, Mode: 0o755})
	tw.Close()
	if _, err := extract(t, &b); err == nil || !strings.Contains(err.Error(), "root directory must come first") {
		t.Fatalf("a tree without its root first: %v", err)
	}
}

// archiveOf writes an archive of one node whose layer is src.
func archiveOf(t *testing.T, src string, version int) []byte {
	d, n, _, err := Digest(src)
	must(t, err)
	b := &Blob{Digest: d, Size: n}
	var out bytes.Buffer
	w := NewWriter(&out)
	m := &Manifest{Image: ImageRef{Name: "default"}, Nodes: []NodeRecord{{ID: "n1", Layer: b}}}
	must(t, w.Manifest(m))
	if version != Version { // rewrite the manifest as another version would
		out.Reset()
		w = NewWriter(&out)
		mb := bytes.Replace(w.mustJSON(t, m), []byte(`"version": 1`), []byte(fmt.Sprintf(`"version": %d`, version)), 1)
		w.manifest = mb
		must(t, w.entry(manifestName, int64(len(mb))))
		w.tw.Write(mb)
	}
	must(t, w.Tree(b, src))
	must(t, w.Close())
	return out.Bytes()
}

func (w *Writer) mustJSON(t *testing.T, m *Manifest) []byte {
	var b bytes.Buffer
	nw := NewWriter(&b)
	must(t, nw.Manifest(m))
	return nw.manifest
}

// readArchive reads a whole archive as an import does, extracting its blobs.
func readArchive(t *testing.T, b []byte) error {
	r := NewReader(bytes.NewReader(b))
	if _, err := r.Manifest(); err != nil {
		return err
	}
	for {
		err := r.Next(func(digest string, size int64, body io.Reader) error {
			_, err := extract(t, body)
			return err
		})
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

// TestArchiveCorruption: every flipped byte of an archive's content, every truncation
// and another version are refused. (A flip in a tar header's padding or in the unused
// bytes of a header block changes nothing the import reads.)
func TestArchiveCorruption(t *testing.T) {
	requireRoot(t)
	src := filepath.Join(scratch(t), "src")
	must(t, os.Mkdir(src, 0o755))
	must(t, os.WriteFile(filepath.Join(src, "f"), bytes.Repeat([]byte("data "), 300), 0o644))
	must(t, os.Mkdir(filepath.Join(src, "d"), 0o755))
	must(t, os.WriteFile(filepath.Join(src, "d/g"), []byte("more"), 0o600))
	good := archiveOf(t, src, Version)
	must(t, readArchive(t, good))

	// Flip one byte of each entry's data: the manifest, the layer (its headers and its
	// files) and the trailer.
	refused, tried := 0, 0
	for off := 0; off < len(good); off += 97 {
		bad := bytes.Clone(good)
		bad[off] ^= 0x20
		tried++
		if err := readArchive(t, bad); err != nil {
			refused++
		}
	}
	// A flip that lands in a header's padding or a tar block's zero fill is harmless;
	// at least every content byte sampled must be refused. Check the content ones.
	for _, needle := range []string{`"nodes"`, "data data", "more", "sha256:"} {
		i := bytes.LastIndex(good, []byte(needle))
		if i < 0 {
			t.Fatalf("no %q in the archive", needle)
		}
		bad := bytes.Clone(good)
		bad[i+2] ^= 0x01
		if err := readArchive(t, bad); err == nil || !errors.Is(err, ErrRefused) {
			t.Errorf("a flipped byte in %q was not refused: %v", needle, err)
		}
	}
	t.Logf("%d of %d sampled flips refused", refused, tried)
	// Cut in the trailer, in the layer, in the manifest, in the first header. (A cut in
	// the end-of-archive blocks loses nothing: every byte before them was verified.)
	for _, n := range []int{bytes.LastIndex(good, []byte("sha256:")) + 10, len(good) / 2, 700, 10} {
		if err := readArchive(t, good[:n]); err == nil {
			t.Errorf("an archive cut at %d of %d bytes was accepted", n, len(good))
		}
	}
	if err := readArchive(t, archiveOf(t, src, 2)); !errors.Is(err, ErrIncompatible) || !strings.Contains(err.Error(), "version 2") {
		t.Errorf("an archive of version 2: %v, want a refusal naming the version", err)
	}
}

// TestLimitsSpanTrees: the trees of one archive share one budget: two layers of 600
// bytes each pass a cap of 1000 alone, not together.
func TestLimitsSpanTrees(t *testing.T) {
	requireRoot(t)
	tr := mkTar(t, ent{name: "f", typ: tar.TypeReg, body: strings.Repeat("x", 600)})
	lim := Limits{MaxBytes: 1000, MaxEntries: 100, Used: &Used{}}
	for i, want := range []bool{true, false} {
		dst := filepath.Join(scratch(t), "out")
		must(t, os.Mkdir(dst, 0o700))
		err := ExtractTree(context.Background(), bytes.NewReader(tr), dst, lim)
		if (err == nil) != want {
			t.Fatalf("tree %d: %v", i, err)
		}
		if err != nil && !strings.Contains(err.Error(), "over the import's cap of 1000 bytes") {
			t.Fatalf("tree %d: %v", i, err)
		}
	}
}
