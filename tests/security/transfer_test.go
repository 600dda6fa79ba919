package security

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"deltabox/internal/testutil"
)

// hostileArchive wraps a layer tar (entries given as tar headers and bodies) in a node
// archive whose digests and trailer are right: only the layer's content is hostile.
func hostileArchive(t *testing.T, ents []*tar.Header, bodies map[string]string) []byte {
	var layer bytes.Buffer
	tw := tar.NewWriter(&layer)
	for _, h := range append([]*tar.Header{{Name: ".", Typeflag: tar.TypeDir, Mode: 0o755}}, ents...) {
		b := bodies[h.Name]
		h.Size = int64(len(b))
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		tw.Write([]byte(b))
	}
	tw.Close()
	sum := sha256.Sum256(layer.Bytes())
	hx := hex.EncodeToString(sum[:])
	man, _ := json.Marshal(map[string]any{
		"format": "deltabox-node", "version": 1, "image": map[string]any{"name": "default"},
		"nodes": []any{map[string]any{"id": "nhostile", "layer": map[string]any{"digest": "sha256:" + hx, "size": layer.Len()}}},
	})
	msum := sha256.Sum256(man)
	var out bytes.Buffer
	aw := tar.NewWriter(&out)
	for _, e := range []struct {
		name string
		b    []byte
	}{{"manifest.json", man}, {"blobs/sha256/" + hx, layer.Bytes()}, {"manifest.sha256", []byte("sha256:" + hex.EncodeToString(msum[:]) + "\n")}} {
		aw.WriteHeader(&tar.Header{Name: e.name, Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(e.b))})
		aw.Write(e.b)
	}
	aw.Close()
	return out.Bytes()
}

// TestImportCannotEscapeTheStore: a node archive from another host is hostile input.
// Its layers are extracted by the daemon as root, so every way out of the layer is
// refused before anything is kept: a "../" name, an absolute name, a symbolic link
// followed by an entry through it, a hard link to a host file, a relative link
// climbing above the layer, a device node that is not a whiteout, a trusted.* xattr
// overlayfs would act on. Nothing is written outside (a directory the links aim at
// stays empty, /etc/shadow is the same file) and the store keeps no layer.
func TestImportCannotEscapeTheStore(t *testing.T) {
	d := testutil.StartDaemon(t)
	target := filepath.Join(testutil.MainRoot(), "tests", "escape-"+filepath.Base(d.Root))
	if err := os.MkdirAll(target, 0o755); err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(target)
	var shadow0 os.FileInfo
	shadow0, _ = os.Stat("/etc/shadow")
	file := func(name string) *tar.Header { return &tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: 0o644} }
	for _, c := range []struct {
		name string
		ents []*tar.Header
		want string
	}{
		{"dotdot", []*tar.Header{file("../../../../" + strings.TrimPrefix(target, "/") + "/pwned")}, `".." component`},
		{"absolute", []*tar.Header{file(target + "/pwned")}, "absolute path"},
		{"symlink-then-through", []*tar.Header{{Name: "evil", Typeflag: tar.TypeSymlink, Linkname: target}, file("evil/pwned")}, "goes through a symbolic link"},
		{"symlink-climbs", []*tar.Header{{Name: "w", Typeflag: tar.TypeDir, Mode: 0o755}, {Name: "w/l", Typeflag: tar.TypeSymlink, Linkname: "../../../../etc/shadow"}}, "escapes the layer"},
		{"hardlink-to-host", []*tar.Header{{Name: "h", Typeflag: tar.TypeLink, Linkname: "../../../../etc/shadow"}}, "not a file of the layer"},
		{"hardlink-absolute", []*tar.Header{{Name: "h", Typeflag: tar.TypeLink, Linkname: "/etc/shadow"}}, "not a file of the layer"},
		{"device", []*tar.Header{{Name: "mem", Typeflag: tar.TypeChar, Devmajor: 1, Devminor: 1, Mode: 0o666}}, "character device 1:1"},
		{"block-device", []*tar.Header{{Name: "sda", Typeflag: tar.TypeBlock, Devmajor: 8, Mode: 0o666}}, "block device"},
		{"trusted-xattr", []*tar.Header{{Name: "f", Typeflag: tar.TypeReg, Mode: 0o644, PAXRecords: map[string]string{"SCHILY.xattr.trusted.overlay.origin": "x"}}}, "not part of a layer"},
	} {
		_, err := d.C.ImportNode(ctx(t), bytes.NewReader(hostileArchive(t, c.ents, nil)), 0, 0)
		if err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "import refused") {
			t.Errorf("%s: got %v, want a refusal saying %q", c.name, err, c.want)
		}
		if ents, _ := os.ReadDir(target); len(ents) != 0 {
			t.Fatalf("%s: the import wrote outside the store: %v", c.name, ents)
		}
		if st, _ := os.Stat("/etc/shadow"); shadow0 != nil && st != nil && !os.SameFile(st, shadow0) {
			t.Fatalf("%s: /etc/shadow changed", c.name)
		}
	}
	tr, err := d.C.Tree(ctx(t))
	if err != nil || len(tr.Nodes) != 0 {
		t.Fatalf("nodes after refused imports: %+v %v", tr, err)
	}
	layers, _ := filepath.Glob(filepath.Join(d.Root, "layers", "*", "frozen"))
	if len(layers) != 0 {
		t.Fatalf("refused imports left layers: %v", layers)
	}
	// The same archive with a harmless layer imports: the refusals above are the
	// layers' content, not the wrapping.
	if _, err := d.C.ImportNode(ctx(t), bytes.NewReader(hostileArchive(t, []*tar.Header{file("ok")}, map[string]string{"ok": "fine"})), 0, 0); err != nil {
		t.Fatalf("a harmless archive: %v", err)
	}
}
