package image

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"crypto/sha512"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"hash"
	"io"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
)

// importSource fills t from source and says what kind of source it was.
func importSource(ctx context.Context, t *tree, staging, source string, m *meter) (string, error) {
	fi, err := os.Stat(source)
	if err != nil {
		return "", refuse("source: %v", err)
	}
	if fi.IsDir() {
		root, err := os.OpenRoot(source)
		if err != nil {
			return "", err
		}
		defer root.Close()
		a := &dirArchive{root: root}
		if layers, kind, err := imageLayers(a); err != nil {
			return "", err
		} else if layers != nil {
			return kind + " directory", applyLayers(ctx, t, a, layers, m, 0, 0)
		}
		return "directory", copyDir(ctx, t, source, m)
	}

	f, err := os.Open(source)
	if err != nil {
		return "", err
	}
	defer f.Close()
	size := fi.Size()
	magic := make([]byte, 6)
	n, _ := io.ReadFull(f, magic)
	magic = magic[:n]
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return "", err
	}
	switch {
	case bytes.HasPrefix(magic, []byte{0x1f, 0x8b}):
		return importGzip(ctx, t, staging, f, size, m)
	case bytes.HasPrefix(magic, []byte{0x28, 0xb5, 0x2f, 0xfd}):
		return "", refuse("source %s is zstd-compressed: only gzip is supported (decompress it first: zstd -d)", source)
	case bytes.HasPrefix(magic, []byte{0xfd, '7', 'z', 'X', 'Z', 0}):
		return "", refuse("source %s is xz-compressed: only gzip is supported (decompress it first: xz -d)", source)
	case bytes.HasPrefix(magic, []byte("BZh")):
		return "", refuse("source %s is bzip2-compressed: only gzip is supported (decompress it first: bunzip2)", source)
	}
	idx, err := indexTar(&countReader{r: f}, f, 0)
	if err != nil {
		return "", err
	}
	a := &tarArchive{f: f, idx: idx}
	layers, kind, err := imageLayers(a)
	if err != nil {
		return "", err
	}
	if layers != nil {
		return kind, applyLayers(ctx, t, a, layers, m, 0, size)
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return "", err
	}
	m.pass(size, 0, size, size)
	return "rootfs tar", extractTar(t, &countReader{r: f, m: m})
}

// importGzip handles a gzip'd tar: a pass reads its member names; a rootfs tar is then
// extracted in a second streaming pass, an image archive decompressed into the
// staging directory (it needs random access to its layers) and applied from there.
func importGzip(ctx context.Context, t *tree, staging string, f *os.File, size int64, m *meter) (string, error) {
	gunzip := func() (io.Reader, error) {
		if _, err := f.Seek(0, io.SeekStart); err != nil {
			return nil, err
		}
		zr, err := gzip.NewReader(bufio.NewReader(&countReader{r: f, m: m}))
		if err != nil {
			return nil, refuse("bad gzip data: %v", err)
		}
		return zr, nil
	}
	m.pass(2*size, 0, size, size)
	zr, err := gunzip()
	if err != nil {
		return "", err
	}
	idx, err := indexTar(&countReader{r: zr}, nil, t.opts.MaxBytes+1<<30)
	if err != nil {
		return "", err
	}
	if !idx.image() {
		m.pass(2*size, size, size, size)
		if zr, err = gunzip(); err != nil {
			return "", err
		}
		return "gzip'd rootfs tar", extractTar(t, zr)
	}
	// An image archive: decompress it next to the rootfs (removed with the staging dir).
	m.pass(3*size, size, size, size)
	if zr, err = gunzip(); err != nil {
		return "", err
	}
	spool, err := os.OpenFile(filepath.Join(staging, "archive.tar"), os.O_CREATE|os.O_EXCL|os.O_RDWR, 0o600)
	if err != nil {
		return "", err
	}
	defer func() {
		spool.Close()
		os.Remove(spool.Name())
	}()
	limit := t.opts.MaxBytes + 1<<30
	n, err := copyCtx(ctx, spool, io.LimitReader(zr, limit+1))
	if err != nil {
		return "", fmt.Errorf("decompress: %w", err)
	}
	if n > limit {
		return "", refuse("the archive decompresses to over %d bytes (max_bytes + 1 GiB): refused as a size bomb (raise max_bytes, deltabox image import --max-bytes)", limit)
	}
	if _, err := spool.Seek(0, io.SeekStart); err != nil {
		return "", err
	}
	if idx, err = indexTar(&countReader{r: spool}, spool, 0); err != nil {
		return "", err
	}
	a := &tarArchive{f: spool, idx: idx}
	layers, kind, err := imageLayers(a)
	if err != nil {
		return "", err
	}
	if layers == nil {
		return "", refuse("the archive changed while it was read")
	}
	return "gzip'd " + kind, applyLayers(ctx, t, a, layers, m, 2*size, size)
}

func copyCtx(ctx context.Context, dst io.Writer, src io.Reader) (int64, error) {
	var n int64
	buf := make([]byte, 1<<20)
	for {
		if err := ctx.Err(); err != nil {
			return n, err
		}
		r, err := io.ReadFull(src, buf)
		if r > 0 {
			if _, werr := dst.Write(buf[:r]); werr != nil {
				return n, werr
			}
			n += int64(r)
		}
		if err == io.EOF || err == io.ErrUnexpectedEOF {
			return n, nil
		}
		if err != nil {
			return n, err
		}
	}
}

// extractTar writes every entry of a tar stream into t.
func extractTar(t *tree, r io.Reader) error {
	tr := tar.NewReader(r)
	first := true
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			if first {
				return refuse("not a tar archive, a gzip'd one, or a directory: %v", err)
			}
			return refuse("bad tar data: %v", err)
		}
		first = false
		if err := t.apply(member{hdr: h, body: tr}); err != nil {
			return err
		}
	}
}

// countReader counts the bytes read through it and reports them to a meter.
type countReader struct {
	r io.Reader
	n int64
	m *meter
}

func (c *countReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	c.m.at(c.n)
	return n, err
}

// ---- the members of an outer tar ----

const indexMax = 10000 // an archive with more members than this is a rootfs, not an image archive

type tarMember struct {
	off, size int64
	typ       byte
	link      string // symlink target or hard-link target
}

type tarIndex struct {
	members   map[string]*tarMember
	truncated bool
}

func (x *tarIndex) image() bool {
	if x.truncated {
		return false
	}
	if m := x.members["manifest.json"]; m != nil && m.typ == tar.TypeReg {
		return true
	}
	return x.members["oci-layout"] != nil && x.members["index.json"] != nil
}

// indexTar reads the member names of a tar (and, if s is its seekable file, where the
// data of each is), up to indexMax members. Without s, the data is read to be skipped:
// once the declared sizes pass limit, the scan stops and calls the archive a rootfs tar
// (whose extraction then refuses the entry over the cap) instead of decompressing a bomb.
func indexTar(r io.Reader, s io.Seeker, limit int64) (*tarIndex, error) {
	var tr *tar.Reader
	if s != nil {
		tr = tar.NewReader(struct {
			io.Reader
			io.Seeker
		}{r, s}) // the reader skips data with Seek
	} else {
		tr = tar.NewReader(r)
	}
	x := &tarIndex{members: map[string]*tarMember{}}
	var declared int64
	for i := 0; ; i++ {
		h, err := tr.Next()
		if err == io.EOF {
			return x, nil
		}
		if err != nil {
			if i == 0 {
				return nil, refuse("not a tar archive, a gzip'd one, or a directory: %v", err)
			}
			return nil, refuse("bad tar data: %v", err)
		}
		if h.Size > 0 {
			declared += h.Size
		}
		if i >= indexMax || (s == nil && (h.Size < 0 || declared > limit)) {
			x.truncated = true
			return x, nil
		}
		name, err := cleanName(h.Name)
		if err != nil || name == "" {
			continue // only matters if a layer is looked up by it, which then fails
		}
		tm := &tarMember{size: h.Size, typ: h.Typeflag, link: h.Linkname}
		if s != nil {
			if tm.off, err = s.Seek(0, io.SeekCurrent); err != nil {
				return nil, err
			}
		}
		x.members[name] = tm
	}
}

// archive is the container of an image archive's files.
type archive interface {
	has(name string) bool
	open(name string) (io.ReadCloser, int64, error)
}

type tarArchive struct {
	f   *os.File
	idx *tarIndex
}

func (a *tarArchive) has(name string) bool { return a.idx.members[name] != nil }

func (a *tarArchive) open(name string) (io.ReadCloser, int64, error) {
	orig := name
	for hops := 0; ; hops++ {
		m := a.idx.members[name]
		if m == nil {
			return nil, 0, refuse("the archive has no file %q", orig)
		}
		if hops > 16 {
			return nil, 0, refuse("the archive's file %q: too many links", orig)
		}
		switch m.typ {
		case tar.TypeReg:
			return io.NopCloser(io.NewSectionReader(a.f, m.off, m.size)), m.size, nil
		case tar.TypeSymlink, tar.TypeLink:
			target := m.link
			if m.typ == tar.TypeSymlink {
				if strings.HasPrefix(target, "/") {
					return nil, 0, refuse("the archive's file %q is a link out of the archive", orig)
				}
				target = path.Join(parentOf(name), target)
			}
			next, err := cleanName(target)
			if err != nil || next == "" {
				return nil, 0, refuse("the archive's file %q is a link out of the archive", orig)
			}
			name = next
		default:
			return nil, 0, refuse("the archive's file %q is not a regular file", orig)
		}
	}
}

type dirArchive struct{ root *os.Root }

func (a *dirArchive) has(name string) bool {
	fi, err := a.root.Stat(name)
	return err == nil && fi.Mode().IsRegular()
}

func (a *dirArchive) open(name string) (io.ReadCloser, int64, error) {
	f, err := a.root.Open(name) // os.Root refuses names and links that leave the directory
	if err != nil {
		return nil, 0, refuse("the image directory's file %q: %v", name, err)
	}
	fi, err := f.Stat()
	if err != nil || !fi.Mode().IsRegular() {
		f.Close()
		return nil, 0, refuse("the image directory's file %q is not a regular file", name)
	}
	return f, fi.Size(), nil
}

func readJSON(a archive, name string, v any) error {
	rc, _, err := a.open(name)
	if err != nil {
		return err
	}
	defer rc.Close()
	b, err := io.ReadAll(io.LimitReader(rc, maxJSON+1))
	if err != nil {
		return err
	}
	if len(b) > maxJSON {
		return refuse("%s is over %d bytes", name, maxJSON)
	}
	if err := json.Unmarshal(b, v); err != nil {
		return refuse("%s: %v", name, err)
	}
	return nil
}

// ---- docker save and OCI layout ----

type layerRef struct {
	name   string // file in the archive
	digest string // "sha256:..." to verify, or ""
}

type descriptor struct {
	MediaType string `json:"mediaType"`
	Digest    string `json:"digest"`
	Size      int64  `json:"size"`
	Platform  *struct {
		Architecture string `json:"architecture"`
		OS           string `json:"os"`
	} `json:"platform,omitempty"`
}

var digestRE = regexp.MustCompile(`^(sha256:[a-f0-9]{64}|sha512:[a-f0-9]{128})$`)

func blobName(digest string) (string, error) {
	if !digestRE.MatchString(digest) {
		return "", refuse("bad digest %q (want sha256:<64 hex>)", digest)
	}
	alg, hexd, _ := strings.Cut(digest, ":")
	return "blobs/" + alg + "/" + hexd, nil
}

// imageLayers returns the layers of a docker-save or OCI-layout archive (nil if a is
// neither) and which it is.
func imageLayers(a archive) ([]layerRef, string, error) {
	if a.has("manifest.json") {
		var ms []struct {
			Config string
			Layers []string
		}
		if err := readJSON(a, "manifest.json", &ms); err != nil {
			return nil, "", err
		}
		if len(ms) != 1 {
			return nil, "", refuse("manifest.json lists %d images: import takes an archive of exactly one (docker save one image)", len(ms))
		}
		if len(ms[0].Layers) > maxLayers {
			return nil, "", refuse("the image has %d layers, over %d", len(ms[0].Layers), maxLayers)
		}
		out := []layerRef{}
		for _, l := range ms[0].Layers {
			name, err := cleanName(l)
			if err != nil || name == "" {
				return nil, "", refuse("manifest.json names the layer %q, which is not a file of the archive", l)
			}
			ref := layerRef{name: name}
			if alg, hexd, ok := strings.Cut(strings.TrimPrefix(name, "blobs/"), "/"); ok && strings.HasPrefix(name, "blobs/") && digestRE.MatchString(alg+":"+hexd) {
				ref.digest = alg + ":" + hexd
			}
			out = append(out, ref)
		}
		return out, "docker save", nil
	}
	if !a.has("oci-layout") || !a.has("index.json") {
		return nil, "", nil
	}
	var layout struct {
		Version string `json:"imageLayoutVersion"`
	}
	if err := readJSON(a, "oci-layout", &layout); err != nil {
		return nil, "", err
	}
	var idx struct {
		Manifests []descriptor `json:"manifests"`
	}
	if err := readJSON(a, "index.json", &idx); err != nil {
		return nil, "", err
	}
	for depth := 0; ; depth++ {
		d, err := pickManifest(idx.Manifests)
		if err != nil {
			return nil, "", err
		}
		blob, err := blobName(d.Digest)
		if err != nil {
			return nil, "", err
		}
		if strings.Contains(d.MediaType, "index") || strings.Contains(d.MediaType, "manifest.list") {
			if depth > 4 {
				return nil, "", refuse("image indexes nested too deep")
			}
			idx.Manifests = nil
			if err := readJSON(a, blob, &idx); err != nil {
				return nil, "", err
			}
			continue
		}
		var man struct {
			Layers []descriptor `json:"layers"`
		}
		if err := readJSON(a, blob, &man); err != nil {
			return nil, "", err
		}
		if len(man.Layers) > maxLayers {
			return nil, "", refuse("the image has %d layers, over %d", len(man.Layers), maxLayers)
		}
		out := []layerRef{}
		for _, l := range man.Layers {
			if strings.Contains(l.MediaType, "zstd") {
				return nil, "", refuse("layer %s is zstd-compressed: only gzip'd and plain layers are supported", l.Digest)
			}
			name, err := blobName(l.Digest)
			if err != nil {
				return nil, "", err
			}
			out = append(out, layerRef{name: name, digest: l.Digest})
		}
		return out, "OCI layout", nil
	}
}

// pickManifest chooses the image of this machine's platform from an index.
func pickManifest(ds []descriptor) (descriptor, error) {
	var cands []descriptor
	for _, d := range ds {
		if d.Platform == nil || (d.Platform.OS == "linux" && d.Platform.Architecture == runtime.GOARCH) {
			cands = append(cands, d)
		}
	}
	for _, d := range cands {
		if d.Platform != nil {
			return d, nil
		}
	}
	if len(cands) == 1 {
		return cands[0], nil
	}
	if len(cands) == 0 {
		return descriptor{}, refuse("index.json has no image for linux/%s", runtime.GOARCH)
	}
	return descriptor{}, refuse("index.json lists %d images and none says its platform: import takes an archive of one image", len(cands))
}

// applyLayers applies the layers in order; their bytes are reported as [base, base+span)
// of the progress (span 0: the layers' own total).
func applyLayers(ctx context.Context, t *tree, a archive, layers []layerRef, m *meter, base, span int64) error {
	var sizes []int64
	var sum int64
	for _, l := range layers {
		rc, size, err := a.open(l.name)
		if err != nil {
			return err
		}
		rc.Close()
		sizes = append(sizes, size)
		sum += size
	}
	if span == 0 {
		span = sum
	}
	m.pass(base+span, base, span, sum)
	var pos int64
	for i, l := range layers {
		if err := applyLayer(ctx, t, a, l, &countReader{n: pos, m: m}); err != nil {
			return fmt.Errorf("layer %d of %d (%s): %w", i+1, len(layers), l.name, err)
		}
		pos += sizes[i]
	}
	return nil
}

func applyLayer(ctx context.Context, t *tree, a archive, l layerRef, cr *countReader) error {
	rc, _, err := a.open(l.name)
	if err != nil {
		return err
	}
	defer rc.Close()
	cr.r = rc
	var r io.Reader = cr
	var h hash.Hash
	if l.digest != "" {
		if strings.HasPrefix(l.digest, "sha512:") {
			h = sha512.New()
		} else {
			h = sha256.New()
		}
		r = io.TeeReader(r, h)
	}
	br := bufio.NewReaderSize(r, 1<<16)
	magic, _ := br.Peek(4)
	var tr io.Reader = br
	switch {
	case bytes.HasPrefix(magic, []byte{0x1f, 0x8b}):
		zr, err := gzip.NewReader(br)
		if err != nil {
			return refuse("bad gzip data: %v", err)
		}
		tr = zr
	case bytes.HasPrefix(magic, []byte{0x28, 0xb5, 0x2f, 0xfd}):
		return refuse("zstd-compressed layer: only gzip'd and plain layers are supported")
	}
	t.beginLayer()
	err = extractTar(t, tr)
	t.layer = nil
	if h != nil && ctx.Err() == nil {
		// The rest of the blob, for its digest. A blob that does not match is the cause
		// of any error its content gave.
		if _, derr := copyCtx(ctx, io.Discard, br); derr != nil && err == nil {
			return derr
		}
		if got := strings.SplitN(l.digest, ":", 2)[0] + ":" + hex.EncodeToString(h.Sum(nil)); got != l.digest {
			return refuse("the blob's digest is %s, the manifest says %s: the archive is corrupt or was tampered with", got, l.digest)
		}
	}
	return err
}
