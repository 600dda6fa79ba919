package e2e

import (
	"archive/tar"
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"deltabox/internal/api"
	"deltabox/internal/errdefs"
	"deltabox/internal/state"
	"deltabox/internal/testutil"
)

func imgCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// imgStoreEntries lists ROOT/images of a test store (shared images are symlinks).
func imgStoreEntries(t *testing.T, root string) map[string]bool {
	t.Helper()
	ents, err := os.ReadDir(filepath.Join(root, "images"))
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]bool{}
	for _, e := range ents {
		out[e.Name()] = true
	}
	return out
}

func imgSameEntries(t *testing.T, what string, got, want map[string]bool) {
	t.Helper()
	if len(got) != len(want) {
		t.Errorf("%s: images/ holds %v, want %v (a trace was left)", what, got, want)
		return
	}
	for k := range want {
		if !got[k] {
			t.Errorf("%s: images/ holds %v, want %v", what, got, want)
		}
	}
}

// imgShared counts the extents of path that share blocks with another file (FIEMAP).
func imgShared(path string) (shared, total int, err error) {
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

// TestImageImportDirectoryAndRemove: the default image's rootfs imported as a new
// image (a directory on the store: reflinked), a sandbox runs on it, and `image rm`
// is refused while a sandbox, then a node, uses it.
func TestImageImportDirectoryAndRemove(t *testing.T) {
	d := testutil.StartDaemon(t)
	ctx := imgCtx(t)
	src := filepath.Join(testutil.MainRoot(), "images", "default", "rootfs")
	before := imgStoreEntries(t, d.Root)

	// The default image has setuid binaries (su, passwd...): refused unless allowed.
	_, err := d.C.ImportImage(ctx, api.ImportRequest{Name: "copy", Source: src}, nil)
	if !errors.Is(err, errdefs.ErrInvalid) || !strings.Contains(err.Error(), "usr/bin/") || !strings.Contains(err.Error(), "allow_setuid") ||
		!strings.Contains(err.Error(), "is a setuid file") && !strings.Contains(err.Error(), "is a setgid file") {
		t.Fatalf("import of a tree with setuid files: %v, want a 400 naming the file and allow_setuid", err)
	}
	imgSameEntries(t, "refused import", imgStoreEntries(t, d.Root), before)

	start := time.Now()
	var calls int
	var last [2]int64
	im, err := d.C.ImportImage(ctx, api.ImportRequest{Name: "copy", Source: src, AllowSetuid: true}, func(done, total int64) {
		calls++
		last = [2]int64{done, total}
	})
	if err != nil {
		t.Fatalf("import: %v\n%s", err, d.Log())
	}
	t.Logf("imported %d bytes in %v (%d progress lines, last %d/%d)", im.Bytes, time.Since(start), calls, last[0], last[1])
	if calls < 2 || last[0] != last[1] || last[1] <= 0 {
		t.Errorf("progress: %d lines, last %d/%d; want a stream ending at done == total", calls, last[0], last[1])
	}
	rootfs := filepath.Join(d.Root, "images", "copy", "rootfs")
	shared, total, err := imgShared(filepath.Join(rootfs, "usr/bin/bash"))
	if err != nil || total == 0 || shared != total {
		t.Errorf("usr/bin/bash: %d of %d extents shared with the source (%v): not a reflink copy", shared, total, err)
	}
	ims, err := d.C.Images(ctx)
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, i := range ims {
		found = found || i.Name == "copy"
	}
	if !found {
		t.Errorf("image ls does not list the imported image: %+v", ims)
	}
	if _, err := d.C.ImportImage(ctx, api.ImportRequest{Name: "copy", Source: src, AllowSetuid: true}, nil); !errors.Is(err, errdefs.ErrConflict) {
		t.Errorf("second import under the same name: %v, want 409", err)
	}

	sb, err := d.C.Create(ctx, state.CreateOptions{ID: "on-copy", Image: "copy"})
	if err != nil {
		t.Fatalf("create on the imported image: %v", err)
	}
	r, err := d.C.Exec(ctx, sb.ID, api.ExecRequest{Argv: []string{"cat", "/etc/debian_version"}})
	want, _ := os.ReadFile(filepath.Join(src, "etc/debian_version"))
	if err != nil || r.ExitCode != 0 || r.Stdout != string(want) {
		t.Fatalf("cat /etc/debian_version in the sandbox: %+v %v, want %q", r, err, want)
	}

	err = d.C.RemoveImage(ctx, "copy")
	if !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "on-copy") {
		t.Errorf("image rm while a sandbox uses it: %v, want 409 naming the sandbox", err)
	}
	cp, err := d.C.Checkpoint(ctx, sb.ID, "")
	if err != nil {
		t.Fatal(err)
	}
	if err := d.C.Remove(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	err = d.C.RemoveImage(ctx, "copy")
	if !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), cp.Node.ID) {
		t.Errorf("image rm while a node uses it: %v, want 409 naming node %s", err, cp.Node.ID)
	}
	if _, err := d.C.RemoveNode(ctx, cp.Node.ID); err != nil {
		t.Fatal(err)
	}
	if err := d.C.RemoveImage(ctx, "copy"); err != nil {
		t.Fatalf("image rm once unused: %v", err)
	}
	imgSameEntries(t, "after image rm", imgStoreEntries(t, d.Root), before)
	if err := d.C.RemoveImage(ctx, "copy"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("image rm of a removed image: %v, want 404", err)
	}
	if _, err := d.C.Create(ctx, state.CreateOptions{Image: "copy"}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("create on a removed image: %v, want 404", err)
	}
	if _, err := os.Stat(filepath.Join(src, "etc/debian_version")); err != nil {
		t.Errorf("the source image was damaged: %v", err)
	}
}

// imgTarFile adds a member with the content of file path to tw.
func imgTarFile(t *testing.T, tw *tar.Writer, name, path string) {
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fi, _ := f.Stat()
	if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: fi.Size(), ModTime: time.Now(), Typeflag: tar.TypeReg}); err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(tw, f); err != nil {
		t.Fatal(err)
	}
}

func imgTarBytes(t *testing.T, tw *tar.Writer, name string, b []byte) {
	if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(b)), ModTime: time.Now(), Typeflag: tar.TypeReg}); err != nil {
		t.Fatal(err)
	}
	tw.Write(b)
}

// TestImageImportDockerSave: a `docker save` tarball made here (layer 1: the default
// rootfs as tar(1) writes it; layer 2: whiteouts, an opaque directory, new files)
// imported with the CLI; a sandbox on it sees layer 2's changes. Hostile archives
// are refused through the API, streamed or not, without a trace.
func TestImageImportDockerSave(t *testing.T) {
	d := testutil.StartDaemon(t)
	ctx := imgCtx(t)
	work := filepath.Join(d.Root, "work")
	os.MkdirAll(work, 0o700)
	src := filepath.Join(testutil.MainRoot(), "images", "default", "rootfs")

	l1 := filepath.Join(work, "layer1.tar")
	if out, err := testutil.Command(t, 5*time.Minute, "tar", "-C", src, "--xattrs", "-cf", l1, ".").CombinedOutput(); err != nil {
		t.Fatalf("tar: %v\n%s", err, out)
	}
	var l2 bytes.Buffer
	tw := tar.NewWriter(&l2)
	for _, h := range []tar.Header{
		{Name: "usr/share/doc/.wh..wh..opq", Typeflag: tar.TypeReg},
		{Name: "usr/share/doc/only", Typeflag: tar.TypeReg},
		{Name: "etc/.wh.debian_version", Typeflag: tar.TypeReg},
		{Name: "etc/dbx-layer", Typeflag: tar.TypeReg, Size: 2},
	} {
		h.Mode, h.ModTime = 0o644, time.Now()
		tw.WriteHeader(&h)
		if h.Size > 0 {
			tw.Write([]byte("2\n"))
		}
	}
	tw.Close()

	save := filepath.Join(work, "save.tar")
	f, err := os.Create(save)
	if err != nil {
		t.Fatal(err)
	}
	otw := tar.NewWriter(f)
	imgTarFile(t, otw, "aaaa/layer.tar", l1)
	imgTarBytes(t, otw, "bbbb/layer.tar", l2.Bytes())
	imgTarBytes(t, otw, "cfg.json", []byte(`{"os":"linux"}`))
	imgTarBytes(t, otw, "manifest.json", []byte(`[{"Config":"cfg.json","RepoTags":["t:1"],"Layers":["aaaa/layer.tar","bbbb/layer.tar"]}]`))
	if err := otw.Close(); err != nil {
		t.Fatal(err)
	}
	f.Close()
	os.Remove(l1)
	before := imgStoreEntries(t, d.Root)

	// Through the CLI (stdout is not a terminal here: no bar, the name alone).
	start := time.Now()
	out, err := testutil.Command(t, 5*time.Minute, testutil.Binary(t), "--socket", d.Socket, "image", "import", "dsave", save, "--allow-setuid").CombinedOutput()
	if err != nil || strings.TrimSpace(string(out)) != "dsave" {
		t.Fatalf("deltabox image import: %v\n%s\n%s", err, out, d.Log())
	}
	t.Logf("docker save tarball imported in %v", time.Since(start))
	os.Remove(save)
	out, err = testutil.Command(t, 5*time.Minute, testutil.Binary(t), "--socket", d.Socket, "image", "ls").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "dsave") || !strings.Contains(string(out), "docker save") {
		t.Errorf("deltabox image ls: %v\n%s", err, out)
	}

	sb, err := d.C.Create(ctx, state.CreateOptions{ID: "on-dsave", Image: "dsave"})
	if err != nil {
		t.Fatalf("create on the docker save image: %v", err)
	}
	r, err := d.C.Exec(ctx, sb.ID, api.ExecRequest{Argv: []string{"bash", "-c",
		"cat /etc/dbx-layer; ls /usr/share/doc; test -e /etc/debian_version && echo debian_version-still-there; test -x /bin/bash && echo bash-ok; stat -c %a /tmp"}})
	if err != nil || r.ExitCode != 0 || r.Stdout != "2\nonly\nbash-ok\n1777\n" {
		t.Errorf("in the sandbox: %+v %v, want layer 2's file, /usr/share/doc opaque, debian_version whited out", r, err)
	}
	out, err = testutil.Command(t, 5*time.Minute, testutil.Binary(t), "--socket", d.Socket, "image", "rm", "dsave").CombinedOutput()
	if err == nil || !strings.Contains(string(out), "on-dsave") {
		t.Errorf("deltabox image rm while a sandbox uses it: %v %s, want a refusal naming on-dsave", err, out)
	}
	if err := d.C.Remove(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	if out, err := testutil.Command(t, 5*time.Minute, testutil.Binary(t), "--socket", d.Socket, "image", "rm", "dsave").CombinedOutput(); err != nil {
		t.Errorf("deltabox image rm: %v %s", err, out)
	}
	imgSameEntries(t, "after image rm", imgStoreEntries(t, d.Root), before)

	// Hostile: a layer with an absolute path, a symlink out of the root then a file
	// through it. Refused with a 400 (plain) or an in-band error (streamed).
	hostile := func(name string, hs []tar.Header) string {
		var lb bytes.Buffer
		tw := tar.NewWriter(&lb)
		for _, h := range hs {
			h.Mode, h.ModTime = 0o644, time.Now()
			tw.WriteHeader(&h)
			if h.Size > 0 {
				tw.Write(bytes.Repeat([]byte("x"), int(h.Size)))
			}
		}
		tw.Close()
		p := filepath.Join(work, name)
		f, _ := os.Create(p)
		otw := tar.NewWriter(f)
		imgTarBytes(t, otw, "l/layer.tar", lb.Bytes())
		imgTarBytes(t, otw, "manifest.json", []byte(`[{"Config":"c.json","Layers":["l/layer.tar"]}]`))
		otw.Close()
		f.Close()
		return p
	}
	abs := hostile("abs.tar", []tar.Header{{Name: "/etc/cron.d/evil", Typeflag: tar.TypeReg, Size: 1}})
	through := hostile("through.tar", []tar.Header{{Name: "x", Typeflag: tar.TypeSymlink, Linkname: "/"}, {Name: "x/etc/evil", Typeflag: tar.TypeReg, Size: 1}})

	status, body := imgRaw(t, d, "/images", api.ImportRequest{Name: "evil", Source: abs})
	var eb api.ErrorBody
	if status != 400 || json.Unmarshal(body, &eb) != nil || eb.Error.Code != "invalid" || !strings.Contains(eb.Error.Message, "absolute path") {
		t.Errorf("hostile import: %d %s, want 400 invalid naming the absolute path", status, body)
	}
	status, body = imgRaw(t, d, "/images?progress=1", api.ImportRequest{Name: "evil", Source: through})
	lines := strings.Split(strings.TrimSpace(string(body)), "\n")
	var lastEv api.ImportEvent
	if status != 200 || json.Unmarshal([]byte(lines[len(lines)-1]), &lastEv) != nil || lastEv.Error == nil ||
		lastEv.Error.Code != "invalid" || !strings.Contains(lastEv.Error.Message, "goes through a symbolic link") {
		t.Errorf("hostile streamed import: %d %s, want 200 and a last line with an invalid error", status, body)
	}
	for _, l := range lines[:len(lines)-1] {
		var ev api.ImportEvent
		if json.Unmarshal([]byte(l), &ev) != nil || ev.Done == nil || ev.Total == nil {
			t.Errorf("stream line %q is not progress", l)
		}
	}
	if _, err := os.Stat("/etc/evil"); err == nil {
		t.Error("/etc/evil exists on the host")
	}
	if _, err := os.Stat("/etc/cron.d/evil"); err == nil {
		t.Error("/etc/cron.d/evil exists on the host")
	}
	imgSameEntries(t, "after hostile imports", imgStoreEntries(t, d.Root), before)
}

func imgRaw(t *testing.T, d *testutil.Daemon, path string, body any) (int, []byte) {
	t.Helper()
	hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var nd net.Dialer
		return nd.DialContext(ctx, "unix", d.Socket)
	}}}
	b, _ := json.Marshal(body)
	req, _ := http.NewRequestWithContext(imgCtx(t), "POST", "http://deltabox/"+api.Version+path, bytes.NewReader(b))
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out bytes.Buffer
	io.Copy(&out, bufio.NewReader(resp.Body))
	return resp.StatusCode, out.Bytes()
}
