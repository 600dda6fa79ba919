package image_test

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"deltabox/internal/errdefs"
	"deltabox/internal/image"
	"deltabox/internal/mountns"
	"deltabox/internal/store"
	"deltabox/internal/testutil"
)

// ---- building archives ----

// ent is one tar entry; zero values pick sensible defaults.
type ent struct {
	name   string
	typ    byte // default: tar.TypeReg (tar.TypeDir if name ends in "/")
	body   string
	size   int64 // declared size of a body of zeros (size bombs)
	mode   int64
	link   string
	uid    int
	gid    int
	xattrs map[string]string
}

var mtime = time.Date(2024, 5, 6, 7, 8, 9, 0, time.UTC)

func mkTar(t *testing.T, ents []ent) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range ents {
		h := &tar.Header{Name: e.name, Typeflag: e.typ, Mode: e.mode, Linkname: e.link, Uid: e.uid, Gid: e.gid, ModTime: mtime, Format: tar.FormatPAX}
		if h.Typeflag == 0 {
			h.Typeflag = tar.TypeReg
			if strings.HasSuffix(e.name, "/") {
				h.Typeflag = tar.TypeDir
			}
		}
		if h.Mode == 0 {
			h.Mode = 0o644
			if h.Typeflag == tar.TypeDir {
				h.Mode = 0o755
			}
		}
		if h.Typeflag == tar.TypeChar {
			h.Devmajor, h.Devminor = 1, 3
		}
		body := []byte(e.body)
		if e.size > 0 {
			body = make([]byte, e.size)
		}
		if h.Typeflag == tar.TypeReg {
			h.Size = int64(len(body))
		}
		for k, v := range e.xattrs {
			if h.PAXRecords == nil {
				h.PAXRecords = map[string]string{}
			}
			h.PAXRecords["SCHILY.xattr."+k] = v
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatalf("tar header %s: %v", e.name, err)
		}
		if h.Typeflag == tar.TypeReg {
			tw.Write(body)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func gz(b []byte) []byte {
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	zw.Write(b)
	zw.Close()
	return buf.Bytes()
}

func digest(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

func mustJSON(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

// dockerSave builds a `docker save` tarball: legacy <id>/layer.tar members, the
// second layer (if any) stored as blobs/sha256/... with <id>/layer.tar a symlink to it
// (as Docker 25+ writes), manifest.json last.
func dockerSave(t *testing.T, layers ...[]byte) []byte {
	var ents []ent
	var names []string
	for i, l := range layers {
		id := digest(append([]byte(fmt.Sprint(i)), l...))
		ents = append(ents, ent{name: id + "/"}, ent{name: id + "/VERSION", body: "1.0"}, ent{name: id + "/json", body: `{"id":"` + id + `"}`})
		if i == 1 {
			blob := "blobs/sha256/" + digest(l)
			ents = append(ents, ent{name: "blobs/"}, ent{name: "blobs/sha256/"}, ent{name: blob, body: string(l)},
				ent{name: id + "/layer.tar", typ: tar.TypeSymlink, link: "../" + blob})
		} else {
			ents = append(ents, ent{name: id + "/layer.tar", body: string(l)})
		}
		names = append(names, id+"/layer.tar")
	}
	cfg := `{"architecture":"amd64","os":"linux","rootfs":{"type":"layers"}}`
	ents = append(ents, ent{name: digest([]byte(cfg)) + ".json", body: cfg},
		ent{name: "manifest.json", body: mustJSON([]map[string]any{{"Config": digest([]byte(cfg)) + ".json", "RepoTags": []string{"test:latest"}, "Layers": names}})},
		ent{name: "repositories", body: `{"test":{"latest":"x"}}`})
	return mkTar(t, ents)
}

// ociFiles builds the files of an OCI image layout: an index with this machine's image
// (layers, gzip'd when the bytes are) and, first, one for another platform whose
// layers must not be applied.
func ociFiles(layers [][]byte, other []byte) map[string][]byte {
	files := map[string][]byte{"oci-layout": []byte(`{"imageLayoutVersion":"1.0.0"}`)}
	blob := func(b []byte) map[string]any {
		files["blobs/sha256/"+digest(b)] = b
		mt := "application/vnd.oci.image.layer.v1.tar"
		if bytes.HasPrefix(b, []byte{0x1f, 0x8b}) {
			mt += "+gzip"
		}
		return map[string]any{"mediaType": mt, "digest": "sha256:" + digest(b), "size": len(b)}
	}
	manifest := func(ls [][]byte) map[string]any {
		cfg := []byte(`{"architecture":"` + runtime.GOARCH + `","os":"linux"}`)
		files["blobs/sha256/"+digest(cfg)] = cfg
		var lds []any
		for _, l := range ls {
			lds = append(lds, blob(l))
		}
		m := []byte(mustJSON(map[string]any{"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
			"config": map[string]any{"mediaType": "application/vnd.oci.image.config.v1+json", "digest": "sha256:" + digest(cfg), "size": len(cfg)},
			"layers": lds}))
		files["blobs/sha256/"+digest(m)] = m
		return map[string]any{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": "sha256:" + digest(m), "size": len(m)}
	}
	otherArch := "s390x"
	if runtime.GOARCH == "s390x" {
		otherArch = "arm64"
	}
	d1 := manifest([][]byte{other})
	d1["platform"] = map[string]string{"os": "linux", "architecture": otherArch}
	d2 := manifest(layers)
	d2["platform"] = map[string]string{"os": "linux", "architecture": runtime.GOARCH}
	files["index.json"] = []byte(mustJSON(map[string]any{"schemaVersion": 2, "manifests": []any{d1, d2}}))
	return files
}

func filesTar(t *testing.T, files map[string][]byte) []byte {
	names := make([]string, 0, len(files))
	for n := range files {
		names = append(names, n)
	}
	slices.Sort(names)
	ents := []ent{{name: "blobs/"}, {name: "blobs/sha256/"}}
	for _, n := range names {
		ents = append(ents, ent{name: n, body: string(files[n])})
	}
	return mkTar(t, ents)
}

// ---- the store and the tree ----

func requireRoot(t *testing.T) {
	testutil.Require(t, os.Geteuid() == 0, "needs root (the importer sets owners)")
}

// newStore returns an empty store root. onStore: under the reflink store when there
// is one (so FICLONE works), else a temp dir.
func newStore(t *testing.T, onStore bool) (root string, reflink bool) {
	t.Helper()
	requireRoot(t)
	if onStore && store.CheckFS(testutil.MainRoot()) == nil {
		tests := filepath.Join(testutil.MainRoot(), "tests")
		if err := os.MkdirAll(tests, 0o700); err != nil {
			t.Fatal(err)
		}
		root, err := os.MkdirTemp(tests, "image-"+strings.ReplaceAll(t.Name(), "/", "_")+"-")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.RemoveAll(root) })
		return root, true
	}
	return t.TempDir(), false
}

func writeSource(t *testing.T, name string, b []byte) string {
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// snapshot describes every entry under rootfs: "d MODE UID:GID", "f MODE UID:GID CONTENT", "l TARGET".
func snapshot(t *testing.T, rootfs string) map[string]string {
	t.Helper()
	out := map[string]string{}
	err := filepath.WalkDir(rootfs, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(rootfs, p)
		if rel == "." {
			return nil
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		own := fmt.Sprintf("%d:%d", st.Uid, st.Gid)
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFDIR:
			out[rel] = fmt.Sprintf("d %04o %s", st.Mode&0o7777, own)
		case unix.S_IFREG:
			b, _ := os.ReadFile(p)
			out[rel] = fmt.Sprintf("f %04o %s %s", st.Mode&0o7777, own, b)
		case unix.S_IFLNK:
			l, _ := os.Readlink(p)
			out[rel] = "l " + l
		default:
			out[rel] = fmt.Sprintf("? %o", st.Mode)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// withMountPoints adds what every import makes when the image lacks it.
func withMountPoints(m map[string]string) map[string]string {
	for k, v := range map[string]string{"dev": "d 0755 0:0", "dev/shm": "d 1777 0:0", "proc": "d 0555 0:0", "sys": "d 0555 0:0",
		"run": "d 0755 0:0", "tmp": "d 1777 0:0", "var": "d 0755 0:0", "var/tmp": "d 1777 0:0", "workspace": "d 0755 0:0"} {
		if _, ok := m[k]; !ok {
			m[k] = v
		}
	}
	return m
}

func diffTrees(t *testing.T, got, want map[string]string) {
	t.Helper()
	var keys []string
	for k := range got {
		keys = append(keys, k)
	}
	for k := range want {
		if _, ok := got[k]; !ok {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	for _, k := range keys {
		if got[k] != want[k] {
			t.Errorf("%-24s got %-28q want %q", k, got[k], want[k])
		}
	}
}

func importOK(t *testing.T, root, name, src string, o image.Options) (*store.Image, string) {
	t.Helper()
	var last [2]int64
	im, err := image.Import(context.Background(), root, name, src, o, func(done, total int64) { last = [2]int64{done, total} })
	if err != nil {
		t.Fatalf("import %s: %v", src, err)
	}
	if last[0] != last[1] || last[1] <= 0 && im.Bytes > 0 {
		t.Errorf("last progress %d/%d, want done == total > 0", last[0], last[1])
	}
	rootfs := filepath.Join(root, "images", name, "rootfs")
	if err := mountns.CheckImage(rootfs); err != nil {
		t.Errorf("imported image fails mountns.CheckImage: %v", err)
	}
	var got store.Image
	b, err := os.ReadFile(filepath.Join(root, "images", name, "image.json"))
	if err != nil || json.Unmarshal(b, &got) != nil || got.Name != name {
		t.Errorf("image.json: %v %s", err, b)
	}
	ents, _ := os.ReadDir(filepath.Join(root, "images"))
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), ".") {
			t.Errorf("images/%s left after an import", e.Name())
		}
	}
	return im, rootfs
}

func sameInode(t *testing.T, a, b string) bool {
	var sa, sb unix.Stat_t
	if unix.Lstat(a, &sa) != nil || unix.Lstat(b, &sb) != nil {
		return false
	}
	return sa.Ino == sb.Ino && sa.Dev == sb.Dev
}

// ---- the checks ----

// TestDockerSaveWhiteouts: a docker save tarball of three layers with whiteouts, an
// opaque directory, replaced entries and a whiteout in the same layer as the entry
// it names imports to exactly the expected tree.
func TestDockerSaveWhiteouts(t *testing.T) {
	root, _ := newStore(t, false)
	l1 := mkTar(t, []ent{
		{name: "etc/"}, {name: "etc/a", body: "a1"}, {name: "etc/b", body: "b1"},
		{name: "etc/a-hard", typ: tar.TypeLink, link: "etc/a"},
		{name: "opt/x/"}, {name: "opt/x/1", body: "1"}, {name: "opt/x/sub/"}, {name: "opt/x/sub/deep", body: "deep"},
		{name: "usr/bin/tool", body: "t1", mode: 0o755}, {name: "usr/share/doc/readme", body: "r"},
		{name: "lnk", typ: tar.TypeSymlink, link: "etc/a"}, {name: "abslnk", typ: tar.TypeSymlink, link: "/etc/b"},
		{name: "bin", typ: tar.TypeSymlink, link: "usr/bin"},
		{name: "var/lib/keep/"}, {name: "var/lib/keep/f", body: "kf"},
		{name: "dev/"}, {name: "dev/null", typ: tar.TypeChar, mode: 0o666},
		{name: "home/user/", mode: 0o700, uid: 1000, gid: 1000}, {name: "home/user/.profile", body: "p", uid: 1000, gid: 1000},
	})
	l2 := mkTar(t, []ent{
		{name: "etc/.wh.b"},
		{name: "opt/x/.wh..wh..opq"}, {name: "opt/x/3", body: "3"}, {name: "opt/x/sub/"}, {name: "opt/x/sub/new", body: "n"},
		{name: "etc/c", body: "c2"},
		{name: "usr/bin/tool", body: "t2", mode: 0o700},
		{name: "var/lib/keep", body: "now a file"},
	})
	l3 := mkTar(t, []ent{
		{name: "usr/local/y", body: "y"}, {name: ".wh.usr"}, // whiteout after the layer's own entries: only the lower usr goes
		{name: "etc/d", body: "d3"}, {name: "etc/.wh.d"}, // a whiteout does not hide its own layer's entry
		{name: "home/user/.wh..profile"},
	})
	src := writeSource(t, "save.tar", dockerSave(t, l1, l2, l3))
	im, rootfs := importOK(t, root, "saved", src, image.Options{})
	if !strings.Contains(im.Source, "docker save") {
		t.Errorf("source %q does not say docker save", im.Source)
	}
	want := withMountPoints(map[string]string{
		"etc": "d 0755 0:0", "etc/a": "f 0644 0:0 a1", "etc/a-hard": "f 0644 0:0 a1", "etc/c": "f 0644 0:0 c2", "etc/d": "f 0644 0:0 d3",
		"opt": "d 0755 0:0", "opt/x": "d 0755 0:0", "opt/x/3": "f 0644 0:0 3", "opt/x/sub": "d 0755 0:0", "opt/x/sub/new": "f 0644 0:0 n",
		"usr": "d 0755 0:0", "usr/local": "d 0755 0:0", "usr/local/y": "f 0644 0:0 y",
		"lnk": "l etc/a", "abslnk": "l /etc/b", "bin": "l usr/bin",
		"var": "d 0755 0:0", "var/lib": "d 0755 0:0", "var/lib/keep": "f 0644 0:0 now a file",
		"home": "d 0755 0:0", "home/user": "d 0700 1000:1000",
	})
	diffTrees(t, snapshot(t, rootfs), want)
	if !sameInode(t, filepath.Join(rootfs, "etc/a"), filepath.Join(rootfs, "etc/a-hard")) {
		t.Error("etc/a-hard is not a hard link of etc/a")
	}
	var st unix.Stat_t
	unix.Lstat(filepath.Join(rootfs, "etc/a"), &st)
	if got := time.Unix(st.Mtim.Unix()); !got.Equal(mtime) {
		t.Errorf("etc/a mtime %v, want %v", got, mtime)
	}
	unix.Lstat(filepath.Join(rootfs, "etc"), &st)
	if got := time.Unix(st.Mtim.Unix()); !got.Equal(mtime) {
		t.Errorf("etc (a directory written into later) mtime %v, want %v", got, mtime)
	}
}

// TestOCILayout: an OCI layout, as a tarball and as a directory, with a gzip'd and a
// plain layer; the index's other-platform image is ignored.
func TestOCILayout(t *testing.T) {
	l1 := gz(mkTar(t, []ent{{name: "./"}, {name: "./bin/"}, {name: "./bin/sh", body: "#!", mode: 0o755}, {name: "./etc/"}, {name: "./etc/gone", body: "x"}, {name: "./etc/os-release", body: "v1"}}))
	l2 := mkTar(t, []ent{{name: "etc/.wh.gone"}, {name: "etc/os-release", body: "v2"}})
	other := mkTar(t, []ent{{name: "WRONG-PLATFORM", body: "x"}})
	files := ociFiles([][]byte{l1, l2}, other)
	want := withMountPoints(map[string]string{"bin": "d 0755 0:0", "bin/sh": "f 0755 0:0 #!", "etc": "d 0755 0:0", "etc/os-release": "f 0644 0:0 v2"})

	t.Run("Tarball", func(t *testing.T) {
		root, _ := newStore(t, false)
		im, rootfs := importOK(t, root, "oci", writeSource(t, "oci.tar", filesTar(t, files)), image.Options{})
		diffTrees(t, snapshot(t, rootfs), want)
		if !strings.Contains(im.Source, "OCI layout") {
			t.Errorf("source %q", im.Source)
		}
	})
	t.Run("GzipTarball", func(t *testing.T) {
		root, _ := newStore(t, false)
		_, rootfs := importOK(t, root, "oci", writeSource(t, "oci.tar.gz", gz(filesTar(t, files))), image.Options{})
		diffTrees(t, snapshot(t, rootfs), want)
	})
	t.Run("Directory", func(t *testing.T) {
		root, _ := newStore(t, false)
		dir := t.TempDir()
		for n, b := range files {
			os.MkdirAll(filepath.Join(dir, filepath.Dir(n)), 0o755)
			os.WriteFile(filepath.Join(dir, n), b, 0o644)
		}
		_, rootfs := importOK(t, root, "oci", dir, image.Options{})
		diffTrees(t, snapshot(t, rootfs), want)
	})
}

// TestRootfsTar: a plain rootfs tar, and gzip'd, keeps modes, owners, times, user
// xattrs, links; .wh.* names are ordinary names outside layered images.
func TestRootfsTar(t *testing.T) {
	tb := mkTar(t, []ent{
		{name: "./", mode: 0o755}, {name: "./tmp/", mode: 0o1777}, {name: "./var/", mode: 0o755}, {name: "./var/mail/", mode: 0o2775, gid: 8},
		{name: "./home/", mode: 0o755}, {name: "./home/u/", mode: 0o750, uid: 1000, gid: 1000},
		{name: "./home/u/f", body: "hello", mode: 0o600, uid: 1000, gid: 1000, xattrs: map[string]string{"user.k": "v", "trusted.overlay.opaque": "y"}},
		{name: "./home/u/g", typ: tar.TypeLink, link: "./home/u/f"},
		{name: "./bin", typ: tar.TypeSymlink, link: "usr/bin"}, {name: "./usr/bin/x", body: "x", mode: 0o755},
		{name: "./etc/.wh.keep", body: "literal"},
		{name: "./dev/", mode: 0o755}, {name: "./dev/null", typ: tar.TypeChar, mode: 0o666}, {name: "./dev/fd", typ: tar.TypeSymlink, link: "/proc/self/fd"},
	})
	want := withMountPoints(map[string]string{
		"tmp": "d 1777 0:0", "var": "d 0755 0:0", "var/mail": "d 2775 0:8", "home": "d 0755 0:0", "home/u": "d 0750 1000:1000",
		"home/u/f": "f 0600 1000:1000 hello", "home/u/g": "f 0600 1000:1000 hello", "bin": "l usr/bin", "usr": "d 0755 0:0",
		"usr/bin": "d 0755 0:0", "usr/bin/x": "f 0755 0:0 x", "etc": "d 0755 0:0", "etc/.wh.keep": "f 0644 0:0 literal",
		"dev": "d 0755 0:0", "dev/fd": "l /proc/self/fd",
	})
	for _, c := range []struct{ name, file string }{{"Plain", "rootfs.tar"}, {"Gzip", "rootfs.tar.gz"}} {
		t.Run(c.name, func(t *testing.T) {
			root, _ := newStore(t, false)
			b := tb
			if c.name == "Gzip" {
				b = gz(tb)
			}
			_, rootfs := importOK(t, root, "plain", writeSource(t, c.file, b), image.Options{})
			diffTrees(t, snapshot(t, rootfs), want)
			f := filepath.Join(rootfs, "home/u/f")
			if !sameInode(t, f, filepath.Join(rootfs, "home/u/g")) {
				t.Error("home/u/g is not a hard link of home/u/f")
			}
			v := make([]byte, 16)
			if n, err := unix.Lgetxattr(f, "user.k", v); err != nil || string(v[:n]) != "v" {
				t.Errorf("user.k xattr: %q %v", v[:max(n, 0)], err)
			}
			if _, err := unix.Lgetxattr(f, "trusted.overlay.opaque", v); err == nil {
				t.Error("a trusted.* xattr was kept (overlayfs would interpret it)")
			}
		})
	}
}

// TestDirectorySource: a directory is copied with the same rules, hard links kept;
// on the reflink store, file data is shared with the source (FICLONE).
func TestDirectorySource(t *testing.T) {
	root, reflink := newStore(t, true)
	src := filepath.Join(root, "src")
	big := bytes.Repeat([]byte("0123456789abcdef"), 1<<16) // 1 MiB
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(src, "etc"), 0o755))
	must(os.MkdirAll(filepath.Join(src, "bin"), 0o755))
	must(os.MkdirAll(filepath.Join(src, "dev"), 0o755))
	must(os.WriteFile(filepath.Join(src, "etc/big"), big, 0o640))
	must(os.Chown(filepath.Join(src, "etc/big"), 7, 8))
	must(os.Link(filepath.Join(src, "etc/big"), filepath.Join(src, "etc/big2")))
	must(os.Symlink("../etc/big", filepath.Join(src, "etc/rel")))
	must(unix.Mknod(filepath.Join(src, "dev/null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
	must(os.Mkdir(filepath.Join(src, "tmp"), 0o755))
	must(unix.Chmod(filepath.Join(src, "tmp"), 0o1777))

	im, rootfs := importOK(t, root, "fromdir", src, image.Options{})
	if !strings.Contains(im.Source, "directory") {
		t.Errorf("source %q", im.Source)
	}
	bigDesc := "f 0640 7:8 " + string(big)
	want := withMountPoints(map[string]string{"bin": "d 0755 0:0", "etc": "d 0755 0:0", "etc/big": bigDesc, "etc/big2": bigDesc, "etc/rel": "l ../etc/big", "dev": "d 0755 0:0", "tmp": "d 1777 0:0"})
	got := snapshot(t, rootfs)
	diffTrees(t, got, want)
	if !sameInode(t, filepath.Join(rootfs, "etc/big"), filepath.Join(rootfs, "etc/big2")) {
		t.Error("etc/big2 is not a hard link of etc/big")
	}
	if reflink {
		shared, total, err := sharedExtents(filepath.Join(rootfs, "etc/big"))
		if err != nil || total == 0 || shared != total {
			t.Errorf("etc/big: %d of %d extents shared with the source (err %v): not a reflink copy", shared, total, err)
		}
	} else {
		t.Log("no reflink store: data copied, reflink not checked")
	}

	t.Run("RefusedFifo", func(t *testing.T) {
		must(unix.Mkfifo(filepath.Join(src, "etc/pipe"), 0o644))
		defer os.Remove(filepath.Join(src, "etc/pipe"))
		importRefused(t, root, src, image.Options{}, `"etc/pipe" is a fifo`)
	})
	t.Run("RefusedSetuid", func(t *testing.T) {
		p := filepath.Join(src, "etc/su")
		must(os.WriteFile(p, []byte("x"), 0o755))
		must(unix.Chmod(p, 0o4755))
		defer os.Remove(p)
		importRefused(t, root, src, image.Options{}, `"etc/su" is a setuid file`)
		_, rootfs := importOK(t, root, "withsetuid", src, image.Options{AllowSetuid: true})
		if fi, err := os.Stat(filepath.Join(rootfs, "etc/su")); err != nil || fi.Mode()&os.ModeSetuid == 0 {
			t.Errorf("allow_setuid: etc/su %v %v, want setuid kept", fi.Mode(), err)
		}
		os.RemoveAll(filepath.Join(root, "images", "withsetuid"))
	})
	t.Run("RefusedStoreParent", func(t *testing.T) {
		_, err := image.Import(context.Background(), root, "x", filepath.Dir(root), image.Options{}, nil)
		if !errors.Is(err, errdefs.ErrInvalid) || !strings.Contains(err.Error(), "contains the store") {
			t.Errorf("importing a parent of the store: %v", err)
		}
	})
}

// importRefused imports src into root (which holds only image "fromdir", if anything)
// and checks the error and that no trace is left.
func importRefused(t *testing.T, root, src string, o image.Options, want string) {
	t.Helper()
	before, _ := os.ReadDir(filepath.Join(root, "images"))
	_, err := image.Import(context.Background(), root, "hostile", src, o, nil)
	if err == nil {
		t.Fatalf("import succeeded, want an error containing %q", want)
	}
	if !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("error %v is not errdefs.ErrInvalid (400)", err)
	}
	if !strings.Contains(err.Error(), want) {
		t.Errorf("error %q does not contain %q", err, want)
	}
	after, _ := os.ReadDir(filepath.Join(root, "images"))
	if len(after) != len(before) {
		var names []string
		for _, e := range after {
			names = append(names, e.Name())
		}
		t.Errorf("images/ holds %v after a refused import: a trace was left", names)
	}
}

// TestHostileArchives: each hostile archive fails with its own error, leaves no trace
// in the store, and never touches anything outside it.
func TestHostileArchives(t *testing.T) {
	root, _ := newStore(t, false)
	canary := t.TempDir()
	if err := os.WriteFile(filepath.Join(canary, "secret"), []byte("untouched"), 0o600); err != nil {
		t.Fatal(err)
	}
	docker := func(layers ...[]ent) []byte {
		var bs [][]byte
		for _, l := range layers {
			bs = append(bs, mkTar(t, l))
		}
		return dockerSave(t, bs...)
	}
	files := ociFiles([][]byte{mkTar(t, []ent{{name: "a", body: "a"}})}, nil)
	for n, b := range files {
		if strings.HasPrefix(n, "blobs/") && bytes.HasPrefix(b, mkTar(t, []ent{{name: "a", body: "a"}})[:100]) {
			b[len(b)-1] ^= 1 // a tampered layer blob
		}
	}
	tampered := filesTar(t, files)
	mib := int64(1 << 20)
	cases := []struct {
		name    string
		archive []byte
		opts    image.Options
		want    string
	}{
		{"AbsolutePath", mkTar(t, []ent{{name: "/etc/passwd", body: "x"}}), image.Options{}, `"/etc/passwd": absolute path`},
		{"DotDot", mkTar(t, []ent{{name: "a/../../escape", body: "x"}}), image.Options{}, `"a/../../escape": ".." component`},
		{"DotDotLeading", mkTar(t, []ent{{name: "../escape", body: "x"}}), image.Options{}, `"../escape": ".." component`},
		{"SymlinkEscapes", mkTar(t, []ent{{name: "a/"}, {name: "a/l", typ: tar.TypeSymlink, link: "../../etc/shadow"}}), image.Options{}, `"a/l": symbolic link target "../../etc/shadow" escapes the image root`},
		{"HardlinkAbsolute", mkTar(t, []ent{{name: "h", typ: tar.TypeLink, link: "/etc/shadow"}}), image.Options{}, `"h": hard link to "/etc/shadow": absolute link target`},
		{"HardlinkDotDot", mkTar(t, []ent{{name: "h", typ: tar.TypeLink, link: "a/../../etc/shadow"}}), image.Options{}, `"h": hard link to "a/../../etc/shadow": target escapes`},
		{"HardlinkMissing", mkTar(t, []ent{{name: "h", typ: tar.TypeLink, link: "nothing"}}), image.Options{}, `hard link to "nothing", which does not exist`},
		{"WriteThroughSymlink", mkTar(t, []ent{{name: "evil", typ: tar.TypeSymlink, link: canary}, {name: "evil/pwned", body: "x"}}), image.Options{}, `"evil/pwned": the path "evil" goes through a symbolic link`},
		{"HardlinkThroughSymlink", mkTar(t, []ent{{name: "evil", typ: tar.TypeSymlink, link: canary}, {name: "h", typ: tar.TypeLink, link: "evil/secret"}}), image.Options{}, `"h": the path "evil" goes through a symbolic link`},
		{"CharDevice", mkTar(t, []ent{{name: "usr/kmem", typ: tar.TypeChar}}), image.Options{}, `"usr/kmem" is a character device`},
		{"BlockDevice", mkTar(t, []ent{{name: "sda", typ: tar.TypeBlock}}), image.Options{}, `"sda" is a block device`},
		{"Fifo", mkTar(t, []ent{{name: "run/pipe", typ: tar.TypeFifo}}), image.Options{}, `"run/pipe" is a fifo`},
		{"Setuid", mkTar(t, []ent{{name: "bin/su", body: "x", mode: 0o4755}}), image.Options{}, `"bin/su" is a setuid file (mode 4755)`},
		{"Setgid", mkTar(t, []ent{{name: "bin/wall", body: "x", mode: 0o2755}}), image.Options{}, `"bin/wall" is a setgid file (mode 2755)`},
		{"Capability", mkTar(t, []ent{{name: "bin/ping", body: "x", mode: 0o755, xattrs: map[string]string{"security.capability": "\x01\x00\x00\x02"}}}), image.Options{}, `"bin/ping" has file capabilities`},
		{"SizeBombEntry", gz(mkTar(t, []ent{{name: "zeros", size: 2 * mib}})), image.Options{MaxBytes: mib}, `"zeros" declares 2097152 bytes, over the import's cap of 1048576`},
		{"SizeBombTotal", mkTar(t, []ent{{name: "z1", size: mib / 2}, {name: "z2", size: mib / 2}, {name: "z3", size: mib / 2}}), image.Options{MaxBytes: mib}, `"z3" (524288 bytes) brings the extracted total over the import's cap`},
		{"EntryBomb", mkTar(t, func() []ent {
			var es []ent
			for i := range 101 {
				es = append(es, ent{name: fmt.Sprint("f", i)})
			}
			return es
		}()), image.Options{MaxEntries: 100}, "over 100 entries: refused as an archive bomb"},
		{"GzipBombTruncated", func() []byte { // 1 TiB declared, 1 MiB present: refused on the header, never decompressed
			var buf bytes.Buffer
			tw := tar.NewWriter(&buf)
			tw.WriteHeader(&tar.Header{Name: "bomb", Typeflag: tar.TypeReg, Mode: 0o644, Size: 1 << 40})
			tw.Write(make([]byte, mib))
			return gz(buf.Bytes())
		}(), image.Options{}, `"bomb" declares 1099511627776 bytes`},
		{"NotATar", bytes.Repeat([]byte("not a tar "), 100), image.Options{}, "not a tar archive"},
		{"Zstd", []byte{0x28, 0xb5, 0x2f, 0xfd, 0, 0, 0, 0}, image.Options{}, "zstd-compressed"},
		{"DockerLayerPathEscapes", mkTar(t, []ent{{name: "manifest.json", body: `[{"Config":"c.json","Layers":["../../etc/passwd"]}]`}}), image.Options{}, `names the layer "../../etc/passwd", which is not a file of the archive`},
		{"DockerTwoImages", mkTar(t, []ent{{name: "manifest.json", body: `[{"Layers":[]},{"Layers":[]}]`}}), image.Options{}, "manifest.json lists 2 images"},
		{"DockerHostileLayer", docker([]ent{{name: "ok", body: "fine"}}, []ent{{name: "/abs", body: "x"}}), image.Options{}, `layer 2 of 2`},
		{"WhiteoutDotDot", docker([]ent{{name: "etc/"}}, []ent{{name: "etc/.wh..."}}), image.Options{}, `"etc/.wh...": whiteout of ".."`},
		{"WhiteoutThroughSymlink", docker([]ent{{name: "evil", typ: tar.TypeSymlink, link: canary}}, []ent{{name: "evil/.wh.secret"}}), image.Options{}, `"evil/.wh.secret": the path "evil" goes through a symbolic link`},
		{"OpaqueThroughSymlink", docker([]ent{{name: "evil", typ: tar.TypeSymlink, link: canary}}, []ent{{name: "evil/.wh..wh..opq"}}), image.Options{}, `"evil/.wh..wh..opq": the path "evil" goes through a symbolic link`},
		{"OCIDigestMismatch", tampered, image.Options{}, "the blob's digest is sha256:"},
	}
	seen := map[string]string{}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			importRefused(t, root, writeSource(t, "hostile.tar", c.archive), c.opts, c.want)
			if other, ok := seen[c.want]; ok {
				t.Errorf("same expected error as %s: each case must have its own", other)
			}
			seen[c.want] = c.name
		})
	}
	if b, err := os.ReadFile(filepath.Join(canary, "secret")); err != nil || string(b) != "untouched" {
		t.Errorf("the canary outside the store was touched: %q %v", b, err)
	}
	if ents, _ := os.ReadDir(canary); len(ents) != 1 {
		t.Errorf("the canary directory outside the store holds %d entries, want 1", len(ents))
	}
}

// TestNamesAndConflicts: bad names and sources are refused (400), a taken name is a
// conflict (409), a crashed import's leftover staging directory is replaced.
func TestNamesAndConflicts(t *testing.T) {
	root, _ := newStore(t, false)
	src := writeSource(t, "r.tar", mkTar(t, []ent{{name: "bin/"}, {name: "f", body: "x"}}))
	ctx := context.Background()
	for _, bad := range []string{"", "UPPER", "../x", "a/b", ".hidden", strings.Repeat("a", 64)} {
		if _, err := image.Import(ctx, root, bad, src, image.Options{}, nil); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("name %q: %v, want ErrInvalid", bad, err)
		}
	}
	if _, err := image.Import(ctx, root, "x", "relative.tar", image.Options{}, nil); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("relative source: %v", err)
	}
	if _, err := image.Import(ctx, root, "x", "/nonexistent/src.tar", image.Options{}, nil); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("missing source: %v", err)
	}
	leftover := filepath.Join(root, "images", ".new-one", "rootfs", "stale")
	os.MkdirAll(leftover, 0o755)
	_, rootfs := importOK(t, root, "one", src, image.Options{})
	if _, err := os.Stat(filepath.Join(rootfs, "stale")); err == nil {
		t.Error("the leftover staging directory's content got into the image")
	}
	_, err := image.Import(ctx, root, "one", src, image.Options{}, nil)
	if !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "already exists") {
		t.Errorf("second import of the same name: %v, want ErrConflict", err)
	}
	if ents, _ := os.ReadDir(filepath.Join(root, "images")); len(ents) != 1 {
		t.Errorf("images/ holds %d entries, want 1", len(ents))
	}
}

// TestCancel: a cancelled import fails and leaves nothing.
func TestCancel(t *testing.T) {
	root, _ := newStore(t, false)
	var ents []ent
	for i := range 200 {
		ents = append(ents, ent{name: fmt.Sprint("d/f", i), size: 64 << 10})
	}
	src := writeSource(t, "big.tar", mkTar(t, ents))
	ctx, cancel := context.WithCancel(context.Background())
	n := 0
	_, err := image.Import(ctx, root, "cancelled", src, image.Options{}, func(done, total int64) {
		if n++; n == 2 {
			cancel()
		}
	})
	if !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled import: %v, want context.Canceled", err)
	}
	if ents, _ := os.ReadDir(filepath.Join(root, "images")); len(ents) != 0 {
		t.Errorf("images/ holds %d entries after a cancelled import", len(ents))
	}
}

// sharedExtents counts the extents of path that share blocks (FIEMAP_EXTENT_SHARED).
func sharedExtents(path string) (shared, total int, err error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	const max, header, extent = 64, 32, 56
	buf := make([]byte, header+extent*max)
	binary.LittleEndian.PutUint64(buf[8:], ^uint64(0))
	binary.LittleEndian.PutUint32(buf[24:], max)
	if _, _, e := syscall.Syscall(syscall.SYS_IOCTL, f.Fd(), 0xC020660B, uintptr(unsafe.Pointer(&buf[0]))); e != 0 {
		return 0, 0, e
	}
	n := int(binary.LittleEndian.Uint32(buf[20:]))
	for i := 0; i < n && i < max; i++ {
		if binary.LittleEndian.Uint32(buf[header+extent*i+40:])&0x2000 != 0 {
			shared++
		}
	}
	return shared, n, nil
}

// TestNoBinRefused: an archive that would make an image without /bin (nothing could
// run in its sandboxes) is refused with an error that says so, and leaves nothing in
// the store: an empty tarball, a docker save and an OCI layout whose image has no
// layers, an empty directory, a rootfs tar with files but no /bin.
func TestNoBinRefused(t *testing.T) {
	root, _ := newStore(t, false)
	emptyDir := t.TempDir()
	for _, c := range []struct{ name, src string }{
		{"ZeroBytes", writeSource(t, "zero.tar", nil)},
		{"EmptyTar", writeSource(t, "empty.tar", mkTar(t, nil))},
		{"EmptyGzipTar", writeSource(t, "empty.tar.gz", gz(mkTar(t, nil)))},
		{"DockerSaveNoLayers", writeSource(t, "save.tar", dockerSave(t))},
		{"OCINoLayers", writeSource(t, "oci.tar", filesTar(t, ociFiles(nil, mkTar(t, []ent{{name: "bin/"}}))))},
		{"EmptyDirectory", emptyDir},
		{"NoBin", writeSource(t, "nobin.tar", mkTar(t, []ent{{name: "etc/"}, {name: "etc/hostname", body: "x"}}))},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := image.Import(context.Background(), root, "nobin", c.src, image.Options{}, nil)
			if !errors.Is(err, errdefs.ErrInvalid) || !strings.Contains(err.Error(), "no /bin") {
				t.Fatalf("import: %v, want refused (ErrInvalid) for having no /bin", err)
			}
			if ents, _ := os.ReadDir(filepath.Join(root, "images")); len(ents) != 0 {
				t.Fatalf("images/ holds %v after the refusal, want nothing", ents)
			}
		})
	}
}
