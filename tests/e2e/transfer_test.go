package e2e

// Nodes that travel: export on one daemon, import on a second with its own store.

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/client"
	"deltabox/internal/durable"
	"deltabox/internal/state"
	"deltabox/internal/testutil"
)

// xferHashScript lists every entry of the sandbox's root filesystem (not /proc, /dev
// and the other mounts): path, mode, owner, size, content digest, mtime and links of
// files, link targets, xattrs. It prints the lines under /workspace and /etc/skel
// (for a readable diff), then TOTAL, the digest of all lines.
const xferHashScript = `
import os, hashlib, stat
dev = os.lstat('/').st_dev
lines = []
for dp, dns, fns in os.walk('/'):
    dns[:] = sorted(d for d in dns if os.lstat(os.path.join(dp, d)).st_dev == dev)
    for n in sorted(dns + fns):
        p = os.path.join(dp, n)
        st = os.lstat(p)
        if st.st_dev != dev:
            continue
        s = '%s %o %d:%d' % (p, st.st_mode, st.st_uid, st.st_gid)
        if stat.S_ISREG(st.st_mode):
            h = hashlib.sha256()
            with open(p, 'rb') as f:
                for b in iter(lambda: f.read(1 << 20), b''):
                    h.update(b)
            s += ' %d %s %d n%d' % (st.st_size, h.hexdigest(), st.st_mtime_ns, st.st_nlink)
        elif stat.S_ISLNK(st.st_mode):
            s += ' -> ' + os.readlink(p)
        try:
            xs = sorted(os.listxattr(p, follow_symlinks=False))
        except OSError:
            xs = []
        s += ' ' + ','.join(x + '=' + os.getxattr(p, x, follow_symlinks=False).hex() for x in xs)
        lines.append(s)
groups = {}
for l in lines:
    if l.startswith('/workspace') or l.startswith('/etc/skel') or l.startswith('/etc/issue'):
        print(l)
    g = '/'.join(l.split(' ')[0].split('/')[:3])
    groups.setdefault(g, []).append(l)
for g in sorted(groups):
    print('GROUP', g, hashlib.sha256('\n'.join(groups[g]).encode()).hexdigest()[:16], len(groups[g]))
print('TOTAL', hashlib.sha256('\n'.join(lines).encode()).hexdigest(), len(lines))
`

func xferHash(t *testing.T, d *testutil.Daemon, id string) string {
	t.Helper()
	r := dbxExec(t, d, id, apitypes.ExecRequest{Argv: []string{"python3", "-"}, Stdin: xferHashScript, TimeoutMS: 120_000})
	if r.ExitCode != 0 {
		t.Fatalf("hash the files: exit %d: %s", r.ExitCode, r.Stderr)
	}
	return r.Stdout
}

// xferStore lists the files of a store (not its index, log and socket, which a daemon
// writes by itself): what an import may leave behind.
func xferStore(t *testing.T, root string) []string {
	var out []string
	filepath.Walk(root, func(p string, fi os.FileInfo, err error) error {
		if err != nil {
			return nil
		}
		rel, _ := filepath.Rel(root, p)
		switch {
		case rel == "index.db", rel == "daemon.log", rel == "deltabox.sock", rel == "reserve",
			strings.HasPrefix(rel, "durable/pages"), strings.HasPrefix(rel, "images"):
			return nil
		case rel == "sandboxes" || strings.HasPrefix(rel, "sandboxes/"):
			return filepath.SkipDir // the sandboxes' own files (init's root mount)
		}
		out = append(out, rel)
		return nil
	})
	sort.Strings(out)
	return out
}

// xferFiles makes what a layer holds: owners, modes, setuid, xattrs, symbolic and hard
// links, a fifo, a sparse file, a deleted image file (a whiteout) and a directory of
// the image replaced (opaque).
const xferFiles = `set -e
cd /workspace
echo hi > a; chown 1000:1001 a; chmod 640 a
mkdir -p d/e; chmod 711 d; chown 12:34 d/e
cp /bin/true suid; chmod 4755 suid
ln -s /etc/passwd abs; ln -s ../a d/rel
ln a hard
mkfifo fifo
truncate -s 256M sparse; printf x | dd of=sparse bs=1 seek=100000000 conv=notrunc status=none
python3 -c "import os; os.setxattr('a', 'user.k', b'v')"
rm /etc/issue
rm -rf /etc/skel; mkdir /etc/skel; echo new > /etc/skel/x
`

// TestExportImportAcrossStores: a chain of two nodes with a python session, exported by
// one daemon (deltabox export) and imported by another with its own store (deltabox
// import), restores there to identical files (every file's digest, owners, modes,
// xattrs, links, the whiteout of a deleted file, an opaque directory), with its durable
// process image carried and verified, and its session started afresh (the warning
// says so). A second import makes no node; the imported node exports again.
func TestExportImportAcrossStores(t *testing.T) {
	d1 := testutil.StartDaemon(t)
	const id = "xfer"
	dbxCreate(t, d1, id)
	if _, err := d1.C.StartSession(dbxCtx(t), id, state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	dbxSh(t, d1, id, xferFiles)
	n1 := dbxCheckpoint(t, d1, id, "one").Node.ID
	sessRun(t, d1, id, "py", "x = 42")
	dbxSh(t, d1, id, "cd /workspace && echo two > b && rm d/rel && chmod 600 hard")
	n2 := dbxCheckpoint(t, d1, id, "two").Node.ID
	want := xferHash(t, d1, id)
	if !strings.Contains(want, "/workspace/sparse") || strings.Contains(want, "/etc/issue ") {
		t.Fatalf("the source sandbox's files are not what the test made:\n%s", want)
	}
	durWaitImage(t, d1, n2)

	file := filepath.Join(t.TempDir(), "n2.dbx")
	bin := testutil.Binary(t)
	out, err := testutil.Command(t, 2*time.Minute, bin, "--socket", d1.Socket, "export", n2, file).CombinedOutput()
	if err != nil {
		t.Fatalf("deltabox export: %v\n%s", err, out)
	}
	fi, err := os.Stat(file)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Size() > 64<<20 {
		t.Errorf("the archive is %d bytes: the 256 MiB sparse file's holes were written", fi.Size())
	}
	t.Logf("archive %d bytes", fi.Size())

	d2 := testutil.StartDaemon(t)
	out, err = testutil.Command(t, 2*time.Minute, bin, "--socket", d2.Socket, "--json", "import", file).CombinedOutput()
	if err != nil {
		t.Fatalf("deltabox import: %v\n%s", err, out)
	}
	var res apitypes.NodeImport
	if err := jsonUnmarshal(out, &res); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if len(res.Nodes) != 2 || res.Nodes[0].From != n1 || res.Nodes[1].From != n2 || res.Nodes[0].Reused || res.Node != res.Nodes[1].ID {
		t.Fatalf("import answer: %+v", res)
	}
	if !res.ProcessImage || len(res.Warnings) == 0 || !strings.Contains(res.Warnings[0], "sessions start afresh") {
		t.Fatalf("import answer: process image %v, warnings %q; want the image carried and the warning that processes do not come back", res.ProcessImage, res.Warnings)
	}
	img := filepath.Join(d2.Root, "imported", res.Node, "0")
	if err := durable.VerifyImage(img); err != nil {
		t.Errorf("the imported process image is not kept whole: %v", err)
	} else {
		// What the import checks of it: a copy missing a page is refused.
		bad := filepath.Join(t.TempDir(), "0")
		if out, err := exec.Command("cp", "-a", img, bad).CombinedOutput(); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
		pages, _ := filepath.Glob(filepath.Join(bad, "pages-*.img"))
		if len(pages) == 0 {
			t.Fatalf("no pages in the imported image %s", img)
		}
		fi, _ := os.Stat(pages[0])
		os.Truncate(pages[0], fi.Size()-4096)
		if err := durable.VerifyImage(bad); err == nil || !strings.Contains(err.Error(), "its pagemap lists") {
			t.Errorf("an image missing a page: %v, want refused", err)
		}
	}
	nd, err := d2.C.Node(dbxCtx(t), res.Node)
	if err != nil || nd.Parent != res.Nodes[0].ID || nd.Label != "two" {
		t.Fatalf("imported node: %+v, %v", nd, err)
	}

	const id2 = "xfer2"
	dbxCreate(t, d2, id2)
	dbxRestore(t, d2, id2, res.Node)
	if got := xferHash(t, d2, id2); got != want {
		t.Fatalf("the imported node's files differ:\n%s", xferDiff(got, want))
	}
	sess, err := d2.C.Sessions(dbxCtx(t), id2)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range sess {
		if s.Name == "py" {
			t.Fatalf("a python session came back on the importing host: %+v", s)
		}
	}
	// A session there starts afresh.
	if _, err := d2.C.StartSession(dbxCtx(t), id2, state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	if got := strings.TrimSpace(sessRun(t, d2, id2, "py", "print('x' in globals())")); got != "False" {
		t.Fatalf("a new session on the imported node: %q", got)
	}
	// The parent restores too.
	dbxRestore(t, d2, id2, res.Nodes[0].ID)
	if got := dbxSh(t, d2, id2, "cat /workspace/d/rel; test -e /workspace/b && echo b; true"); got != "hi\n" {
		t.Fatalf("the imported parent: %q", got)
	}

	// Again: every node is there already.
	f, _ := os.Open(file)
	again, err := d2.C.ImportNode(dbxCtx(t), f, 0, 0)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	if again.Node != res.Node || !again.Nodes[1].Reused {
		t.Fatalf("a second import of the same archive: %+v, want node %s reused", again, res.Node)
	}
	// And back: the imported node exports with its process image, to the same digests.
	var buf bytes.Buffer
	if _, err := d2.C.ExportNode(dbxCtx(t), res.Node, &buf); err != nil {
		t.Fatal(err)
	}
	back, err := d1.C.ImportNode(dbxCtx(t), &buf, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	if back.Node != n2 || !back.Nodes[1].Reused {
		t.Fatalf("the node exported back to its first host: %+v, want %s reused", back, n2)
	}
}

// TestImportRefusals: a flipped byte, a truncated archive, another version, an image the
// host lacks, and a layer holding a device are refused with a clear error, and the
// store holds afterwards exactly what it held before.
func TestImportRefusals(t *testing.T) {
	d1 := testutil.StartDaemon(t)
	const id = "xr"
	dbxCreate(t, d1, id)
	dbxSh(t, d1, id, "head -c 300000 /dev/urandom > /workspace/blob; echo hi > /workspace/f")
	n := dbxCheckpoint(t, d1, id, "one").Node.ID
	var good bytes.Buffer
	if _, err := d1.C.ExportNode(dbxCtx(t), n, &good); err != nil {
		t.Fatal(err)
	}
	d2 := testutil.StartDaemon(t)
	// The daemon makes a few empty uppers ahead of time, after its start: wait for them.
	before := xferStore(t, d2.Root)
	for i := 0; i < 50; i++ {
		time.Sleep(200 * time.Millisecond)
		now := xferStore(t, d2.Root)
		if strings.Join(now, "\n") == strings.Join(before, "\n") {
			break
		}
		before = now
	}
	g := good.Bytes()
	flip := func(at int) []byte {
		b := bytes.Clone(g)
		b[at] ^= 0x04
		return b
	}
	blob := bytes.Index(g, []byte("blobs/sha256/"))
	cases := []struct {
		name string
		b    []byte
		want string
	}{
		{"flip-in-layer-data", flip(len(g) / 2), "damaged"},
		{"flip-in-layer-header", flip(blob + 512 + 600), "damaged"},
		{"flip-in-manifest", flip(bytes.Index(g, []byte(`"label"`)) + 3), "damaged"},
		{"truncated", g[:len(g)/2], "truncated"},
		{"truncated-before-trailer", g[:bytes.LastIndex(g, []byte("manifest.sha256"))-10], "truncated"},
		{"version", xferRewrite(t, g, `"version": 1`, `"version": 9`), "version 9"},
		{"unknown-image", xferRewrite(t, g, `"name": "default"`, `"name": "nosuch"`), `image "nosuch"`},
		{"not-an-archive", []byte("hello"), "damaged"},
	}
	for _, c := range cases {
		_, err := d2.C.ImportNode(dbxCtx(t), bytes.NewReader(c.b), 0, 0)
		var ce *client.Error
		if err == nil || !errors.As(err, &ce) || ce.Status/100 != 4 || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: got %v, want a 4xx saying %q", c.name, err, c.want)
		}
		if after := xferStore(t, d2.Root); strings.Join(after, "\n") != strings.Join(before, "\n") {
			t.Fatalf("%s: the store changed:\nbefore %q\nafter  %q", c.name, before, after)
		}
	}
	tr, _ := d2.C.Tree(dbxCtx(t))
	if len(tr.Nodes) != 0 {
		t.Fatalf("refused imports left nodes: %+v", tr.Nodes)
	}
	// The good archive still imports.
	if _, err := d2.C.ImportNode(dbxCtx(t), bytes.NewReader(g), 0, 0); err != nil {
		t.Fatal(err)
	}
}

// xferRewrite rewrites the manifest of an archive (and its trailer, so that only the
// changed field is wrong).
func xferRewrite(t *testing.T, g []byte, from, to string) []byte {
	tr := tar.NewReader(bytes.NewReader(g))
	var out bytes.Buffer
	tw := tar.NewWriter(&out)
	var man []byte
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(tr)
		switch h.Name {
		case "manifest.json":
			b = bytes.Replace(b, []byte(from), []byte(to), 1)
			man = b
		case "manifest.sha256":
			b = []byte(sha256Hex(man) + "\n")
		}
		h.Size = int64(len(b))
		tw.WriteHeader(h)
		tw.Write(b)
	}
	tw.Close()
	return out.Bytes()
}

func sha256Hex(b []byte) string {
	s := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(s[:])
}

// jsonUnmarshal decodes the last JSON document of a command's output (warnings go
// before it on stderr).
func jsonUnmarshal(out []byte, v any) error {
	i := bytes.IndexByte(out, '{')
	if i < 0 {
		return errors.New("no JSON in the output")
	}
	return json.Unmarshal(out[i:], v)
}

// xferDiff lists the lines of two listings that differ.
func xferDiff(got, want string) string {
	g, w := map[string]bool{}, map[string]bool{}
	for _, l := range strings.Split(got, "\n") {
		g[l] = true
	}
	for _, l := range strings.Split(want, "\n") {
		w[l] = true
	}
	var out []string
	for l := range g {
		if !w[l] {
			out = append(out, "+ "+l)
		}
	}
	for l := range w {
		if !g[l] {
			out = append(out, "- "+l)
		}
	}
	sort.Strings(out)
	return strings.Join(out, "\n")
}

// TestImportLeftoversSwept: what an import cut by a crash leaves (a staged layer with
// no record, a process image in tmp/, an imported process image whose node the index
// never got) is removed at the next start; the imported node and its image stay.
func TestImportLeftoversSwept(t *testing.T) {
	d1 := testutil.StartDaemon(t)
	dbxCreate(t, d1, "xs")
	dbxSh(t, d1, "xs", "echo x > /workspace/x")
	n := dbxCheckpoint(t, d1, "xs", "x").Node.ID
	var arch bytes.Buffer
	if _, err := d1.C.ExportNode(dbxCtx(t), n, &arch); err != nil {
		t.Fatal(err)
	}
	root := testutil.NewStore(t)
	d2 := testutil.StartDaemonOn(t, root)
	res, err := d2.C.ImportNode(dbxCtx(t), &arch, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := d2.C.Sync(dbxCtx(t)); err != nil {
		t.Fatal(err)
	}
	d2.Kill()
	planted := []string{
		filepath.Join(root, "layers", "9999", "diff", "workspace"),
		filepath.Join(root, "tmp", "import-1234", "process", "0"),
		filepath.Join(root, "imported", "nghost00", "0"),
	}
	for _, p := range planted {
		if err := os.MkdirAll(p, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	d2 = testutil.StartDaemonOn(t, root)
	for _, p := range planted {
		if _, err := os.Stat(p); err == nil {
			t.Errorf("%s survived the restart", p)
		}
	}
	nd, err := d2.C.Node(dbxCtx(t), res.Node)
	if err != nil || nd.Label != "x" {
		t.Fatalf("the imported node after the restart: %+v %v", nd, err)
	}
	dbxCreate(t, d2, "xs2")
	dbxRestore(t, d2, "xs2", res.Node)
	if got := dbxSh(t, d2, "xs2", "cat /workspace/x"); got != "x\n" {
		t.Fatalf("the imported node's file after the restart: %q", got)
	}
}
