package transfer

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"strings"
	"time"
)

// The archive's entries, in this order (see doc.go).
const (
	manifestName = "manifest.json"
	blobPrefix   = "blobs/sha256/"
	trailerName  = "manifest.sha256"

	// Format and Version name the archive's form; an importer refuses any other.
	Format  = "deltabox-node"
	Version = 1

	maxManifest = 4 << 20
)

// Manifest is the archive's first entry: the node, its ancestors and what they need.
type Manifest struct {
	Format  string    `json:"format"`
	Version int       `json:"version"`
	Created time.Time `json:"created"`
	// Image is the image the chain sits on; it does not travel: the importer must have
	// one of that name (and size, when both know it).
	Image ImageRef `json:"image"`
	// Nodes is the chain, the root's side first; the last is the exported node.
	Nodes []NodeRecord `json:"nodes"`
	// ProcessImage is the node's durable process image, if it had a complete one.
	ProcessImage *Blob `json:"process_image,omitempty"`
}

// ImageRef names the image a chain sits on.
type ImageRef struct {
	Name   string `json:"name"`
	Source string `json:"source,omitempty"`
	Bytes  int64  `json:"bytes,omitempty"`
}

// NodeRecord is one node of the chain.
type NodeRecord struct {
	ID      string    `json:"id"` // on the exporting host
	Created time.Time `json:"created"`
	Label   string    `json:"label,omitempty"`
	// Layer is the node's own layer, nil when the node changed nothing (it shares its
	// parent's stack).
	Layer *Blob `json:"layer,omitempty"`
	Bytes int64 `json:"layer_bytes,omitempty"`
}

// Blob is a content-addressed entry: the sha256 of WriteTree's bytes, and their length.
type Blob struct {
	Digest string `json:"digest"`
	Size   int64  `json:"size"`
}

// ChainKeys names each node of m by its content: the image's name, then, node after
// node, the digest of its own layer ("" for none). A node anywhere with the same key
// has the same files.
func ChainKeys(image string, layers []string) []string {
	out := make([]string, len(layers))
	k := "image:" + image
	for i, l := range layers {
		sum := sha256.Sum256([]byte(k + "\n" + l))
		k = "sha256:" + hex.EncodeToString(sum[:])
		out[i] = k
	}
	return out
}

// Writer writes an archive.
type Writer struct {
	tw       *tar.Writer
	manifest []byte
}

func NewWriter(w io.Writer) *Writer { return &Writer{tw: tar.NewWriter(w)} }

func (w *Writer) entry(name string, size int64) error {
	return w.tw.WriteHeader(&tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: 0o644, Size: size, Format: tar.FormatPAX})
}

// Manifest writes the manifest, first.
func (w *Writer) Manifest(m *Manifest) error {
	m.Format, m.Version = Format, Version
	b, err := json.MarshalIndent(m, "", " ")
	if err != nil {
		return err
	}
	w.manifest = b
	if err := w.entry(manifestName, int64(len(b))); err != nil {
		return err
	}
	_, err = w.tw.Write(b)
	return err
}

// Tree writes the blob b: WriteTree of dir, which must give the bytes b names (a tree
// that changed since its digest was taken is an error, and the archive is cut short).
func (w *Writer) Tree(b *Blob, dir string) error {
	hex, ok := strings.CutPrefix(b.Digest, "sha256:")
	if !ok {
		return fmt.Errorf("blob digest %q is not sha256", b.Digest)
	}
	if err := w.entry(blobPrefix+hex, b.Size); err != nil {
		return err
	}
	h := sha256.New()
	cw := &countWriter{w: io.MultiWriter(w.tw, h)}
	if _, err := WriteTree(cw, dir); err != nil {
		return err
	}
	if got := "sha256:" + fmt.Sprintf("%x", h.Sum(nil)); got != b.Digest || cw.n != b.Size {
		return fmt.Errorf("%s changed while it was exported (digest %s, %d bytes; it was %s, %d bytes): export again", dir, got, cw.n, b.Digest, b.Size)
	}
	return nil
}

// Close writes the trailer (the manifest's digest) and ends the archive.
func (w *Writer) Close() error {
	sum := sha256.Sum256(w.manifest)
	t := []byte("sha256:" + hex.EncodeToString(sum[:]) + "\n")
	if err := w.entry(trailerName, int64(len(t))); err != nil {
		return err
	}
	if _, err := w.tw.Write(t); err != nil {
		return err
	}
	return w.tw.Close()
}

// Reader reads an archive, verifying every byte it hands out against a digest.
type Reader struct {
	tr       *tar.Reader
	m        *Manifest
	manifest []byte
	want     map[string]bool // blobs the manifest names, not yet read
}

func NewReader(r io.Reader) *Reader { return &Reader{tr: tar.NewReader(r)} }

func damaged(format string, args ...any) error {
	return refuse("the archive is damaged or truncated: "+format+" (export it again)", args...)
}

func (r *Reader) next() (*tar.Header, error) {
	h, err := r.tr.Next()
	if err == io.EOF {
		return nil, damaged("it ends before its trailer")
	}
	if err != nil {
		return nil, damaged("%v", err)
	}
	if h.Typeflag != tar.TypeReg {
		return nil, damaged("entry %q is not a regular file", h.Name)
	}
	return h, nil
}

// Manifest reads and checks the first entry. The manifest is trusted only once the
// trailer has confirmed it (Next's io.EOF); nothing is committed before.
func (r *Reader) Manifest() (*Manifest, error) {
	h, err := r.next()
	if err != nil {
		return nil, err
	}
	if h.Name != manifestName {
		return nil, refuse("not a node archive (deltabox export makes them): its first entry is %q, not %s", h.Name, manifestName)
	}
	if h.Size > maxManifest {
		return nil, refuse("the manifest is %d bytes, over %d", h.Size, maxManifest)
	}
	b, err := io.ReadAll(r.tr)
	if err != nil {
		return nil, damaged("manifest: %v", err)
	}
	var m Manifest
	dec := json.NewDecoder(bytes.NewReader(b))
	if err := dec.Decode(&m); err != nil {
		return nil, damaged("manifest: %v", err)
	}
	if m.Format != Format {
		return nil, refuse("not a node archive: format %q, not %q", m.Format, Format)
	}
	if m.Version != Version {
		return nil, fmt.Errorf("the archive is version %d of the node format; this daemon reads version %d only (export it with the same DeltaBox version as this one): %w", m.Version, Version, ErrIncompatible)
	}
	if len(m.Nodes) == 0 {
		return nil, damaged("the manifest names no node")
	}
	r.want = map[string]bool{}
	for _, n := range m.Nodes {
		if n.Layer != nil {
			r.want[n.Layer.Digest] = true
		}
	}
	if m.ProcessImage != nil {
		r.want[m.ProcessImage.Digest] = true
	}
	r.m, r.manifest = &m, b
	return &m, nil
}

// ErrIncompatible marks an archive of another version.
var ErrIncompatible = errors.New("incompatible")

// Next reads the next blob, handing fn its digest and its bytes, and checks them
// against the digest once fn returns (what fn leaves unread is read and hashed too): fn's
// work must be undone by the caller if Next fails. At the trailer it checks that every
// blob the manifest names was there and that the trailer names the manifest's bytes,
// and returns io.EOF.
func (r *Reader) Next(fn func(digest string, size int64, body io.Reader) error) error {
	h, err := r.next()
	if err != nil {
		return err
	}
	if h.Name == trailerName {
		return r.trailer()
	}
	hx, ok := strings.CutPrefix(h.Name, blobPrefix)
	if !ok || len(hx) != 64 {
		return damaged("unexpected entry %q", h.Name)
	}
	digest := "sha256:" + hx
	if !r.want[digest] {
		return damaged("blob %s is not named by the manifest, or comes twice", digest)
	}
	delete(r.want, digest)
	hs := sha256.New()
	body := &hashReader{r: r.tr, h: hs}
	if err := fn(digest, h.Size, body); err != nil {
		return err // the caller undoes its work; the rest is not worth reading
	}
	if _, err := io.Copy(io.Discard, body); err != nil {
		return damaged("blob %s: %v", digest, err)
	}
	if got := "sha256:" + hex.EncodeToString(hs.Sum(nil)); got != digest || body.n != h.Size {
		return damaged("blob %s holds content of digest %s", digest, got)
	}
	return nil
}

func (r *Reader) trailer() error {
	b, err := io.ReadAll(io.LimitReader(r.tr, 128))
	if err != nil {
		return damaged("trailer: %v", err)
	}
	sum := sha256.Sum256(r.manifest)
	if strings.TrimSpace(string(b)) != "sha256:"+hex.EncodeToString(sum[:]) {
		return damaged("the manifest does not match the trailer's digest")
	}
	for d := range r.want {
		return damaged("blob %s, which the manifest names, is missing", d)
	}
	if _, err := r.tr.Next(); err != io.EOF {
		return damaged("entries after the trailer")
	}
	return io.EOF
}

type hashReader struct {
	r io.Reader
	h hash.Hash
	n int64
}

func (h *hashReader) Read(p []byte) (int, error) {
	n, err := h.r.Read(p)
	h.h.Write(p[:n])
	h.n += int64(n)
	return n, err
}
