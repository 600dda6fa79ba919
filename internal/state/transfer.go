package state

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/durable"
	"deltabox/internal/errdefs"
	"deltabox/internal/store"
	"deltabox/internal/transfer"
)

// Nodes that travel (docs/design/transfer.md): an export writes a node's chain (its
// ancestors' and its own layers, each a content-addressed blob), its metadata and its
// durable process image into one archive (internal/transfer); an import verifies every
// byte of it, stages the layers in fresh layer directories and the process image under
// tmp/, and only then renames them into place and records the nodes. The import makes
// only the nodes the store lacks: a node whose chain key (the image, then each layer's
// digest: transfer.ChainKeys) a node here has is that node.
//
// An imported node's process image is kept under ROOT/imported/NODE, verified: a fork
// of the node restores its processes from it into new sandboxes (fork.go,
// processImageDir), whose PIDs are kept free for it; a restore of an imported node in
// an existing sandbox brings its files back and its sessions start afresh.

// digestFile caches a frozen layer's transfer digest in its layer directory (frozen
// layers never change; the file goes with the directory): "v1 DIGEST SIZE".
const digestFile = "transfer-digest"

// layerBlob is the digest of layer id's frozen tree, computed once and cached.
func (m *Manager) layerBlob(id uint64) (*transfer.Blob, error) {
	p := filepath.Join(m.st.LayerDir(id), digestFile)
	if b, ok := readDigestFile(p); ok {
		return b, nil
	}
	d, n, _, err := transfer.Digest(m.st.LayerFrozen(id))
	if err != nil {
		return nil, fmt.Errorf("layer %d: %w", id, err)
	}
	b := &transfer.Blob{Digest: d, Size: n}
	_ = writeDigestFile(p, b) // a cache: a failure costs the next export a walk
	return b, nil
}

func readDigestFile(p string) (*transfer.Blob, bool) {
	raw, err := os.ReadFile(p)
	if err != nil {
		return nil, false
	}
	f := strings.Fields(string(raw))
	if len(f) != 3 || f[0] != "v"+strconv.Itoa(transfer.Version) {
		return nil, false
	}
	n, err := strconv.ParseInt(f[2], 10, 64)
	if err != nil {
		return nil, false
	}
	return &transfer.Blob{Digest: f[1], Size: n}, true
}

func writeDigestFile(p string, b *transfer.Blob) error {
	tmp := p + ".tmp"
	if err := os.WriteFile(tmp, []byte(fmt.Sprintf("v%d %s %d\n", transfer.Version, b.Digest, b.Size)), 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, p)
}

// chain lists node id and its ancestors, the root's side first. Precondition: mu held.
// +checklocks:m.mu
func (m *Manager) chain(id string) []store.Node {
	var out []store.Node
	for id != "" {
		n := m.nodes[id]
		if n == nil {
			break
		}
		out = append([]store.Node{n.Node}, out...)
		id = n.Parent
	}
	return out
}

// ownLayer is a node's own layer (0: it shares its parent's).
func ownLayer(n store.Node) uint64 {
	if n.Own {
		return n.Layer
	}
	return 0
}

// importedDir holds an imported node's process image.
func (m *Manager) importedDir(node string) string { return filepath.Join(m.st.Root, "imported", node) }

// Export is a prepared export: its manifest is known, the blobs' digests taken.
type Export struct {
	m        *Manager
	manifest transfer.Manifest
	layers   map[string]string // digest -> directory
	procDir  string
	tmp      string
	// Warnings are what the archive does not carry, for the answer.
	Warnings []string
}

// PrepareExport takes the digests of node id's chain (cached per layer after the first
// export) and stages its durable process image, so that every refusal comes before the
// first byte of the archive. Close removes what it staged.
func (m *Manager) PrepareExport(ctx context.Context, id string) (_ *Export, err error) {
	if err := m.awaitNode(ctx, id); err != nil { // a node answered early (answer.go)
		return nil, err
	}
	m.mu.Lock()
	ch := m.chain(id)
	m.mu.Unlock()
	if len(ch) == 0 {
		return nil, fmt.Errorf("no node %q (deltabox tree lists them): %w", id, errdefs.ErrNotFound)
	}
	e := &Export{m: m, layers: map[string]string{}}
	defer func() {
		if err != nil {
			e.Close()
		}
	}()
	top := ch[len(ch)-1]
	e.manifest.Created = time.Now().UTC()
	e.manifest.Image = transfer.ImageRef{Name: top.Image}
	if ims, err := m.st.Images(); err == nil {
		for _, im := range ims {
			if im.Name == top.Image {
				e.manifest.Image.Source, e.manifest.Image.Bytes = im.Source, im.Bytes
			}
		}
	}
	for _, n := range ch {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		r := transfer.NodeRecord{ID: n.ID, Created: n.Created, Label: n.Label}
		if l := ownLayer(n); l != 0 {
			b, err := m.layerBlob(l)
			if err != nil {
				if errors.Is(err, transfer.ErrRefused) {
					return nil, fmt.Errorf("node %s cannot be exported: %w", n.ID, errors.Join(err, errdefs.ErrConflict))
				}
				return nil, fmt.Errorf("node %s: %w", n.ID, err)
			}
			if _, dup := e.layers[b.Digest]; dup {
				return nil, fmt.Errorf("node %s's layer is identical to an ancestor's (%s): the archive format names each layer once: %w", n.ID, b.Digest, errdefs.ErrConflict)
			}
			e.layers[b.Digest] = m.st.LayerFrozen(l)
			r.Layer, r.Bytes = b, n.Bytes
		}
		e.manifest.Nodes = append(e.manifest.Nodes, r)
	}
	if err := e.stageProcesses(top.ID); err != nil {
		return nil, err
	}
	return e, nil
}

// stageProcesses puts node's process image, its pages materialized from the page
// store, under tmp/, and takes its digest. No complete image: a warning.
func (e *Export) stageProcesses(node string) error {
	m := e.m
	src := ""
	materialize := false
	switch {
	case m.hasImage(node):
		src, materialize = m.imagesDir(node), true
	default:
		if _, err := os.Stat(m.importedDir(node)); err == nil {
			src = m.importedDir(node)
		}
	}
	if src == "" {
		st := "none"
		if in := m.imageInfo(node); in != nil {
			st = in.State
		}
		e.Warnings = append(e.Warnings, fmt.Sprintf("node %s has no complete durable process image (process_image: %s): the archive carries its files only", node, st))
		return nil
	}
	tmp, err := os.MkdirTemp(filepath.Join(m.st.Root, "tmp"), "export-")
	if err != nil {
		return err
	}
	e.tmp = tmp
	dst := filepath.Join(tmp, "process")
	if err := os.Mkdir(dst, 0o700); err != nil {
		return err
	}
	ents, err := os.ReadDir(src)
	if err != nil {
		return fmt.Errorf("read node %s's process image: %w", node, err)
	}
	for _, k := range ents {
		if !k.IsDir() {
			continue // "complete": the archive is complete by its digests
		}
		if err := store.CloneDir(filepath.Join(src, k.Name()), filepath.Join(dst, k.Name()), nil, 0); err != nil {
			return fmt.Errorf("copy node %s's process image: %w", node, err)
		}
		if materialize {
			d := filepath.Join(dst, k.Name())
			if err := m.img.pages.Materialize(d); err != nil {
				return fmt.Errorf("node %s's process image: its pages: %w", node, err)
			}
			refs, _ := filepath.Glob(filepath.Join(d, "pages-*.refs"))
			for _, r := range refs { // an archive's image carries its pages, never refs
				if err := os.Remove(r); err != nil {
					return fmt.Errorf("node %s's process image: %w", node, err)
				}
			}
		}
	}
	d, n, _, err := transfer.Digest(dst)
	if err != nil {
		return err
	}
	e.manifest.ProcessImage = &transfer.Blob{Digest: d, Size: n}
	e.procDir = dst
	return nil
}

// Node is the exported node's id.
func (e *Export) Node() string { return e.manifest.Nodes[len(e.manifest.Nodes)-1].ID }

// HasProcesses says whether the archive carries a process image.
func (e *Export) HasProcesses() bool { return e.manifest.ProcessImage != nil }

// Write writes the archive. A layer removed meanwhile (its node removed) ends it
// with an error: the archive is then cut short, which an import refuses.
func (e *Export) Write(w io.Writer) error {
	aw := transfer.NewWriter(w)
	if err := aw.Manifest(&e.manifest); err != nil {
		return err
	}
	for _, n := range e.manifest.Nodes {
		if n.Layer != nil {
			if err := aw.Tree(n.Layer, e.layers[n.Layer.Digest]); err != nil {
				return fmt.Errorf("node %s's layer: %w", n.ID, err)
			}
		}
	}
	if e.procDir != "" {
		if err := aw.Tree(e.manifest.ProcessImage, e.procDir); err != nil {
			return fmt.Errorf("process image: %w", err)
		}
	}
	return aw.Close()
}

// Close removes what PrepareExport staged.
func (e *Export) Close() {
	if e.tmp != "" {
		_ = store.RemoveAll(e.tmp) // under the store's tmp/: the next start sweeps it
	}
}

// Import limits unless the caller says otherwise: the image importer's.
const (
	DefaultImportMaxBytes   int64 = 4 << 30
	DefaultImportMaxEntries int64 = 4 << 20
)

// localKeys maps the chain key of every node on image whose own layers' digests are
// known (cached by an export or an import) to its id.
func (m *Manager) localKeys(image string) map[string]string {
	m.mu.Lock()
	var chains [][]store.Node
	for _, n := range m.nodes {
		if n.Image == image {
			chains = append(chains, m.chain(n.ID))
		}
	}
	m.mu.Unlock()
	out := map[string]string{}
next:
	for _, ch := range chains {
		var ds []string
		for _, n := range ch {
			d := ""
			if l := ownLayer(n); l != 0 {
				b, ok := readDigestFile(filepath.Join(m.st.LayerDir(l), digestFile))
				if !ok {
					continue next
				}
				d = b.Digest
			}
			ds = append(ds, d)
		}
		keys := transfer.ChainKeys(image, ds)
		out[keys[len(keys)-1]] = ch[len(ch)-1].ID
	}
	return out
}

// importSem admits one import at a time (a daemon-wide resource, like the store).
var importSem = make(chan struct{}, 1)

// ImportNode reads a node archive from r, verifying it whole before anything is
// committed (see the top of this file). Every refusal leaves nothing behind; a crash
// leaves unrecorded layer directories and tmp/, which the start-up sweep removes.
func (m *Manager) ImportNode(ctx context.Context, r io.Reader, lim transfer.Limits) (_ *apitypes.NodeImport, err error) {
	// One import at a time: the choice of the nodes to make (localKeys) holds until its
	// records are in.
	select {
	case importSem <- struct{}{}:
		defer func() { <-importSem }()
	case <-ctx.Done():
		return nil, fmt.Errorf("import: waited for another import: %w", ctx.Err())
	}
	if lim.MaxBytes <= 0 {
		lim.MaxBytes = DefaultImportMaxBytes
	}
	if lim.MaxEntries <= 0 {
		lim.MaxEntries = DefaultImportMaxEntries
	}
	classify := func(err error) error {
		switch {
		case err == nil:
			return nil
		case errors.Is(err, transfer.ErrIncompatible), errors.Is(err, transfer.ErrRefused):
			return fmt.Errorf("import refused: %w", errors.Join(err, errdefs.ErrInvalid))
		}
		return fmt.Errorf("import: %w", err)
	}
	lim.Used = &transfer.Used{} // one budget for all the archive's trees
	rd := transfer.NewReader(r)
	man, err := rd.Manifest()
	if err != nil {
		return nil, classify(err)
	}
	if err := m.checkImportImage(man.Image); err != nil {
		return nil, err
	}
	digests := make([]string, len(man.Nodes))
	for i, n := range man.Nodes {
		if n.Layer != nil {
			digests[i] = n.Layer.Digest
		}
	}
	keys := transfer.ChainKeys(man.Image.Name, digests)
	local := m.localKeys(man.Image.Name)
	have := -1 // the deepest node of the chain this store has
	for i := len(keys) - 1; i >= 0; i-- {
		if _, ok := local[keys[i]]; ok {
			have = i
			break
		}
	}
	need := map[string]int{} // layer digest -> index of the node that gets it
	for i := have + 1; i < len(man.Nodes); i++ {
		if d := digests[i]; d != "" {
			if _, dup := need[d]; dup {
				return nil, classify(fmt.Errorf("two nodes of the chain name the same layer %s: %w", d, transfer.ErrRefused))
			}
			need[d] = i
		}
	}
	topNew := have < len(man.Nodes)-1

	staged := map[string]uint64{} // digest -> layer id, extracted and verified
	var tmp string
	defer func() {
		if err != nil {
			var errs []error
			for _, id := range staged {
				errs = append(errs, store.RemoveAll(m.st.LayerDir(id)))
			}
			if tmp != "" {
				errs = append(errs, store.RemoveAll(tmp))
			}
			err = withUndo(err, errors.Join(errs...))
		}
	}()
	procDir := ""
	for {
		err := rd.Next(func(digest string, size int64, body io.Reader) error {
			if _, ok := need[digest]; ok {
				id, err := m.newLayer()
				if err != nil {
					return err
				}
				staged[digest] = id
				_ = store.RemoveAll(m.st.LayerWork(id)) // a frozen layer needs no work/: one that stays costs a directory
				return transfer.ExtractTree(ctx, body, m.st.LayerDiff(id), lim)
			}
			if man.ProcessImage != nil && digest == man.ProcessImage.Digest && topNew {
				var err error
				if tmp, err = os.MkdirTemp(filepath.Join(m.st.Root, "tmp"), "import-"); err != nil {
					return err
				}
				procDir = filepath.Join(tmp, "process")
				if err := os.Mkdir(procDir, 0o700); err != nil {
					return err
				}
				return transfer.ExtractTree(ctx, body, procDir, lim)
			}
			return nil // a layer this store has: read only to verify it
		})
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, classify(err)
		}
	}
	if procDir != "" {
		if err := verifyProcessImage(procDir); err != nil {
			return nil, classify(fmt.Errorf("the process image: %v: %w", err, transfer.ErrRefused))
		}
	}

	// Verified whole: commit. Layers first (each staged diff/ becomes the frozen
	// layer), then the records, then the process image; a crash before the index
	// commits leaves directories no record names, which the start-up sweep removes.
	for d, id := range staged {
		if err := os.Rename(m.st.LayerDiff(id), m.st.LayerFrozen(id)); err != nil {
			return nil, fmt.Errorf("import: %w", err)
		}
		_ = writeDigestFile(filepath.Join(m.st.LayerDir(id), digestFile), man.Nodes[need[d]].Layer) // a cache: a failure costs the next export a walk
	}
	res := &apitypes.NodeImport{Image: man.Image.Name}
	// treeMu shared: RemoveNode (exclusive) cannot take the reused parent away
	// between its check and the records.
	m.treeMu.RLock()
	m.mu.Lock()
	parent := ""
	var layer uint64
	if have >= 0 {
		parent = local[keys[have]]
		p := m.nodes[parent]
		if p == nil || p.removing {
			m.mu.Unlock()
			m.treeMu.RUnlock()
			return nil, fmt.Errorf("node %s was removed during the import; import again: %w", parent, errdefs.ErrConflict)
		}
		layer = p.Layer
		for i := 0; i <= have; i++ {
			res.Nodes = append(res.Nodes, apitypes.ImportedNode{From: man.Nodes[i].ID, ID: local[keys[i]], Reused: true})
		}
		// Ancestors of a node this store has are that node's own ancestors: the
		// deepest one names them all.
		for i := 0; i < have; i++ {
			res.Nodes[i].ID = ""
		}
	}
	var ops []store.Op
	var made []*node
	for i := have + 1; i < len(man.Nodes); i++ {
		r := man.Nodes[i]
		n := store.Node{ID: m.newNodeID(), Parent: parent, Image: man.Image.Name, Created: r.Created, Label: r.Label, Layer: layer}
		if r.Layer != nil {
			n.Layer, n.Own, n.Bytes = staged[r.Layer.Digest], true, r.Bytes
		}
		nd := &node{Node: n}
		m.addNodeLocked(nd)
		made = append(made, nd)
		ops = append(ops, store.Op{PutNode: &nd.Node})
		res.Nodes = append(res.Nodes, apitypes.ImportedNode{From: r.ID, ID: n.ID})
		parent, layer = n.ID, n.Layer
	}
	top := parent
	var seq uint64
	if len(ops) > 0 {
		seq = m.st.Index.Apply(ops...)
		for _, n := range made {
			n.seq = seq
		}
	}
	m.mu.Unlock()
	m.treeMu.RUnlock()
	if procDir != "" {
		// After the records: the image is named by the node's id (a crash before the
		// rename loses the image, not the node; the sweep empties tmp/).
		err := os.MkdirAll(filepath.Join(m.st.Root, "imported"), 0o700)
		if err == nil && m.img != nil {
			m.img.importedAny.Store(true) // before the rename: processImageDir looks from now on
		}
		if err == nil {
			err = os.Rename(procDir, m.importedDir(top))
		}
		if err != nil {
			res.Warnings = append(res.Warnings, "the process image was verified but could not be kept: "+err.Error())
		} else {
			res.ProcessImage = true
		}
	}
	if tmp != "" {
		_ = store.RemoveAll(tmp) // under the store's tmp/: the next start sweeps it
	}
	res.Node = top
	if man.ProcessImage != nil {
		res.Warnings = append(res.Warnings, "the node's processes come back on this host in a fork of it (POST /v1/nodes/ID/fork, deltabox fork), which restores them from the image into new sandboxes at their PIDs; a restore of this node in an existing sandbox brings its files back and its sessions start afresh (its PIDs are not kept free there: docs/design/fork.md)")
	} else {
		res.Warnings = append(res.Warnings, "the archive carries no process image: a restore of this node brings its files back and its sessions start afresh")
	}
	if !topNew {
		res.Warnings = append(res.Warnings, fmt.Sprintf("this store already has the node, as %s: nothing was imported", top))
	}
	if seq > 0 {
		if err := m.st.Index.WaitDurable(seq); err != nil {
			res.Warnings = append(res.Warnings, "the index has not committed the import yet: "+err.Error())
		}
	}
	return res, nil
}

// checkImportImage refuses an archive whose image this store lacks, or has with
// another size.
func (m *Manager) checkImportImage(ref transfer.ImageRef) error {
	if !idRE.MatchString(ref.Name) {
		return fmt.Errorf("import refused: image name %q: %w", ref.Name, errdefs.ErrInvalid)
	}
	ims, err := m.st.Images()
	if err != nil {
		return err
	}
	for _, im := range ims {
		if im.Name != ref.Name {
			continue
		}
		if ref.Bytes != 0 && im.Bytes != 0 && ref.Bytes != im.Bytes {
			return fmt.Errorf("import refused: the node sits on image %q of %d bytes (%s), this host's %q has %d bytes (%s): a layer is only meaningful on the image it was made on; import that image here under another name and the node with it, or the same image: %w",
				ref.Name, ref.Bytes, ref.Source, im.Name, im.Bytes, im.Source, errdefs.ErrConflict)
		}
		return nil
	}
	return fmt.Errorf("import refused: the node sits on image %q, which this host does not have (images do not travel with nodes: deltabox image import %s SOURCE, then import again): %w", ref.Name, ref.Name, errdefs.ErrNotFound)
}

// verifyProcessImage checks each template's image of a process image: directories of
// regular files only (no link, device or setuid bit: it is read, never run), each a
// CRIU image durable.VerifyImage accepts.
func verifyProcessImage(dir string) error {
	if err := filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		if !fi.IsDir() && !fi.Mode().IsRegular() || fi.Mode()&(os.ModeSetuid|os.ModeSetgid) != 0 {
			return fmt.Errorf("%s is not a plain file (%s)", strings.TrimPrefix(p, dir+"/"), fi.Mode())
		}
		return nil
	}); err != nil {
		return err
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	n := 0
	for _, e := range ents {
		if !e.IsDir() {
			return fmt.Errorf("unexpected %s", e.Name())
		}
		if err := durable.VerifyImage(filepath.Join(dir, e.Name())); err != nil {
			return fmt.Errorf("template %s: %w", e.Name(), err)
		}
		n++
	}
	if n == 0 {
		return errors.New("it holds no template's image")
	}
	return nil
}
