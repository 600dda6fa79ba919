package state

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/apitypes"
	"deltabox/internal/criu"
	"deltabox/internal/durable"
	"deltabox/internal/errdefs"
	"deltabox/internal/fastpath"
	"deltabox/internal/overlay"
	"deltabox/internal/procfs"
	"deltabox/internal/proctree"
	"deltabox/internal/remote"
	"deltabox/internal/sandbox"
	"deltabox/internal/store"
)

// Durable images of templates. Every node's templates are written, in the background,
// to CRIU images (internal/durable) whose pages go into one page store, each distinct
// page once (durable.PageStore): the store grows with what changed between checkpoints,
// not with the processes' size. A node whose image is complete can lose its templates
// (evicted over the template budget, budget.go; killed from inside; evicted by the
// client) and still restore its processes: the image is restored into the sandbox as a
// stopped copy of the template (fastpath.AdoptStopped), which becomes the node's
// template again, and the restore forks from it as from any template.
//
// What is dumped is a copy of each template (fastpath.CopyTemplate: a fork, copy-on-write,
// a few ms under the sandbox's tmplMu), never the template itself: CRIU must seize what it
// dumps, and a restore to the node must not wait for a dump. The copy is made when the
// template is parked, just before: CRIU finds the mount of each file a process maps in
// that process's mount namespace, and a parked template's mappings (its executable, its
// libraries) stay on the state it was forked on, which the copy still stands in. The
// copy waits stopped, sharing the template's pages, until CRIU dumps it, at the lowest
// CPU and I/O priority, and ends it. One worker dumps at a time, in
// the order checkpoints are made; the queue is bounded (maxImageQueue): past it the
// oldest job is dropped (that node stays without an image) and counted.
//
// On disk, under ROOT/durable (the store's filesystem: pages are copied by reflink):
//
//	pages/              the page store
//	nodes/NODE/K/       template K's image: CRIU's files, its pages as references
//	                    into the store, template.json (its record), durable.json
//	nodes/NODE/complete written (and synced) last, once every template's image is in
//
// A node's directory goes after its record (RemoveNode), and start-up removes those of
// nodes the index does not have; an incomplete one is removed and dumped again if its
// templates are there.

// maxImageQueue bounds the nodes waiting for their images.
const maxImageQueue = 256

// imageState is what the API shows of a node's durable image.
type imageState struct {
	state   string // "pending", "complete", "failed"
	err     string
	bytes   int64 // bytes the store took for it (new pages and CRIU's other files)
	full    int64 // what a full dump's pages would be
	dumped  time.Time
	queued  time.Time
	dumpDur time.Duration
}

// images is the durable images' state (Manager.img). mu guards everything but runner,
// which is set once by probe.
type images struct {
	root   string
	pages  *durable.PageStore
	runner *criu.Runner // nil until probed; not usable: no images
	ready  chan struct{}

	mu sync.Mutex
	// +checklocks:mu
	nodes map[string]*imageState
	// trees: what each node's CRIU trees hold on disk, once measured (diskquota.go).
	// +checklocks:mu
	trees map[string]int64
	// +checklocks:mu
	queue []string
	// +checklocks:mu
	copies map[string][]imageCopy // per queued node, its templates' copies, in order
	// +checklocks:mu
	dropped int
	wake    chan struct{}
	// importedAny: ROOT/imported may hold an imported node's process image (found at
	// start, or kept by an import since: set before its rename). False, processImageDir
	// need not read that directory: a restore of a node with no templates (files only)
	// would pay for its lookup on the answer's path to find nothing (with it, and the
	// walk before the spare check, the restores' first step took 41-58 µs at p50
	// against 35-41 without: docs/research/filesonly).
	importedAny atomic.Bool
	// collect: images were removed (their nodes went) since the page store was last
	// collected; the worker collects when no dump is queued.
	// +checklocks:mu
	collect bool
}

// imagesRemoved asks the worker to free the pages that removed images alone named
// (durable.PageStore.Collect), once no dump is queued. Called after their directories
// are gone.
func (m *Manager) imagesRemoved() {
	if m.img == nil || m.img.pages == nil {
		return
	}
	m.img.mu.Lock()
	m.img.collect = true
	m.img.mu.Unlock()
	select {
	case m.img.wake <- struct{}{}:
	default:
	}
}

// collectPages runs the page store's collection over every image's refs.
func (m *Manager) collectPages() {
	start := time.Now()
	st, err := m.img.pages.Collect(filepath.Join(m.img.root, "nodes", "*", "*", "pages-*.refs"))
	if err != nil {
		m.log.Warn("page store collection", "err", err)
		return
	}
	if st.Freed > 0 {
		m.log.Info("page store collected", "freed_pages", st.Freed, "live_pages", st.Live, "images", st.RefsFiles,
			"pack_mb_before", st.PackBytesBefore>>20, "pack_mb_after", st.PackBytesAfter>>20, "took", time.Since(start))
	}
}

// imageCopy is a template's copy waiting for its dump (nil cp: the copy failed, and the
// image fails saying so), ended by cp.Kill (a pidfd: fastpath.Copy says why not by PID).
type imageCopy struct {
	cp      *fastpath.Copy
	sandbox string // the sandbox it is in
}

func (c imageCopy) kill() {
	if c.cp != nil {
		c.cp.Kill()
	}
}

// copyForImage makes the copy of t that node's image is dumped from (see above), if
// images are on. Called by park, before it parks t, with park's tracer: park runs
// without opMu, and m.tracer(s) there would make a new tracer for a sandbox whose
// Remove has just closed its own (a template seized by a tracer no one closes keeps
// the sandbox's init from exiting: a traced zombie waits for its tracer).
// Precondition: s.tmplMu held.
// +checklocks:s.tmplMu
func (m *Manager) copyForImage(s *sb, tr *remote.Tracer, node string, t *procTemplate) {
	if m.img == nil || m.img.pages == nil {
		return
	}
	s.copyMu.Lock()
	defer s.copyMu.Unlock()
	cp, err := fastpath.CopyTemplate(tr, t.tmpl)
	if err != nil {
		m.log.Debug("copy a template for its image", "node", node, "err", err)
	}
	m.img.mu.Lock()
	m.img.copies[node] = append(m.img.copies[node], imageCopy{cp: cp, sandbox: s.rec.ID})
	m.img.mu.Unlock()
}

// sandboxCopies lists the copies waiting in s (host and sandbox PIDs): a checkpoint
// neither takes nor refuses them, a restore does not end them (processes.go).
func (m *Manager) sandboxCopies(s *sb) (hosts, selfs []int) {
	if m.img == nil {
		return nil, nil
	}
	m.img.mu.Lock()
	defer m.img.mu.Unlock()
	for _, cs := range m.img.copies {
		for _, c := range cs {
			if c.sandbox == s.rec.ID && c.cp != nil {
				hosts, selfs = append(hosts, c.cp.Pid), append(selfs, c.cp.Self)
			}
		}
	}
	return hosts, selfs
}

// killCopies ends the copies made for node's image. Precondition: img.mu held.
// +checklocks:m.img.mu
func (m *Manager) killCopiesLocked(node string) {
	for _, c := range m.img.copies[node] {
		c.kill()
	}
	delete(m.img.copies, node)
}

func (m *Manager) imagesDir(node string) string {
	return filepath.Join(m.img.root, "nodes", node)
}

// startImages opens the page store, reads which nodes have complete images (removing
// what no node names), and starts the CRIU probe and the worker. Called by New.
func (m *Manager) startImages() {
	m.img = &images{root: filepath.Join(m.st.Root, "durable"), nodes: map[string]*imageState{}, trees: map[string]int64{}, copies: map[string][]imageCopy{},
		wake: make(chan struct{}, 1), ready: make(chan struct{})}
	if !m.cfg.Durable || !m.cfg.FastPath {
		m.img.runner = &criu.Runner{Mode: criu.Unusable, Reason: "durable images are off (DELTABOX_DURABLE=0)"}
		close(m.img.ready)
		return
	}
	var err error
	if err = os.MkdirAll(filepath.Join(m.img.root, "nodes"), 0o700); err == nil {
		err = os.MkdirAll(criuRunsDir(m.st.Root), 0o700)
	}
	if err == nil {
		m.img.pages, err = durable.OpenPageStore(filepath.Join(m.img.root, "pages"))
	}
	if err != nil {
		m.log.Warn("durable images are off", "err", err)
		m.img.runner = &criu.Runner{Mode: criu.Unusable, Reason: err.Error()}
		close(m.img.ready)
		return
	}
	m.cleanCRIUTrees()
	if ents, err := os.ReadDir(filepath.Join(m.st.Root, "imported")); len(ents) > 0 || (err != nil && !errors.Is(err, os.ErrNotExist)) {
		m.img.importedAny.Store(true) // (unreadable: read it each time, as before)
	}
	// Copies of images made for restores (privateImage) that a crash left.
	restores := filepath.Join(m.img.root, "restores")
	if err := store.RemoveAll(restores); err != nil {
		m.log.Warn("durable images: remove the restores' copies a crash left", "err", err)
	}
	if err := os.MkdirAll(restores, 0o700); err != nil {
		m.log.Warn("durable images: the directory of restores' copies", "err", err)
	}
	ents, _ := os.ReadDir(filepath.Join(m.img.root, "nodes"))
	for _, e := range ents {
		node := e.Name()
		_, known := m.nodes[node] // +checklocksignore: start-up: New has not shared the manager yet
		_, err := os.Stat(filepath.Join(m.imagesDir(node), "complete"))
		if !known || err != nil {
			_ = store.RemoveAll(m.imagesDir(node)) // what stays, the next start tries again
			continue
		}
		st := &imageState{state: "complete"}
		var mark imageMark
		if b, err := os.ReadFile(filepath.Join(m.imagesDir(node), "complete")); err == nil && json.Unmarshal(b, &mark) == nil {
			st.bytes = mark.Bytes // counted in its sandbox's disk quota (diskquota.go)
		}
		m.img.nodes[node] = st // +checklocksignore: start-up: New has not shared the manager yet
	}
	// Pages of images removed before a crash, or just above.
	m.img.collect = true // +checklocksignore: start-up: New has not shared the manager yet
	m.imageDone = m.hasImage
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		ctx, cancel := context.WithCancel(context.Background())
		go func() { <-m.stop; cancel() }()
		r := criu.Probe(ctx, "")
		r.Runs = criuRunsDir(m.st.Root)
		m.img.mu.Lock()
		m.img.runner = r
		m.img.mu.Unlock()
		close(m.img.ready)
		if !r.Usable() {
			m.log.Warn("durable images are off: CRIU is unusable here", "why", r.Reason)
			return
		}
		m.log.Info("durable images on", "criu", r.String())
		m.imageWorker()
	}()
}

// hasImage reports whether node's durable image is complete (Manager.imageDone, which
// budget.go's eviction asks through imageComplete; the restore's fallback).
func (m *Manager) hasImage(node string) bool {
	if m.img == nil {
		return false
	}
	m.img.mu.Lock()
	defer m.img.mu.Unlock()
	st := m.img.nodes[node]
	return st != nil && st.state == "complete"
}

// processImageDir is where node's durable process image is: its own, complete
// (imagesDir), else the one an import brought (importedDir, imported: its pages in
// full, no refs into the page store), else "".
func (m *Manager) processImageDir(node string) (dir string, imported bool) {
	if m.hasImage(node) {
		return m.imagesDir(node), false
	}
	if m.img == nil || m.img.pages == nil || !m.img.importedAny.Load() {
		return "", false
	}
	ents, err := os.ReadDir(m.importedDir(node))
	if err != nil {
		return "", false
	}
	for _, e := range ents {
		if e.IsDir() {
			return m.importedDir(node), true
		}
	}
	return "", false
}

// hasProcessImage reports whether node has a process image to restore from
// (processImageDir).
func (m *Manager) hasProcessImage(node string) bool {
	dir, _ := m.processImageDir(node)
	return dir != ""
}

// imageInfo is NodeInfo's process_image (nil when none is known).
func (m *Manager) imageInfo(node string) *apitypes.ImageInfo {
	if m.img == nil {
		return nil
	}
	m.img.mu.Lock()
	defer m.img.mu.Unlock()
	st := m.img.nodes[node]
	if st == nil {
		return nil
	}
	in := &apitypes.ImageInfo{State: st.state, Error: st.err, StoredBytes: st.bytes, FullBytes: st.full, DumpMS: st.dumpDur.Milliseconds()}
	switch {
	case st.state == "pending" && !st.queued.IsZero():
		in.LagMS = time.Since(st.queued).Milliseconds()
	case !st.dumped.IsZero() && !st.queued.IsZero():
		in.LagMS = st.dumped.Sub(st.queued).Milliseconds()
	}
	return in
}

// EvictNode drops a node's templates (in every sandbox), which its durable image can
// bring back at its next restore: a client's hint that it will not restore the node
// soon (the budget evicts least recently restored nodes by itself). 409 without a
// complete image.
func (m *Manager) EvictNode(id string) (*NodeInfo, error) {
	if err := m.awaitNode(context.Background(), id); err != nil { // a node answered early (answer.go)
		return nil, err
	}
	m.mu.Lock()
	n := m.nodes[id]
	var sbs []*sb
	for _, t := range m.templates[id] {
		if s := m.sandboxes[t.sandbox]; s != nil {
			sbs = append(sbs, s)
		}
	}
	m.mu.Unlock()
	if n == nil {
		return nil, fmt.Errorf("no node %q (deltabox tree lists them): %w", id, errdefs.ErrNotFound)
	}
	if !m.hasImage(id) {
		return nil, fmt.Errorf("node %s has no complete durable image (GET /v1/nodes/%s: process_image): its templates are its only process state: %w", id, id, errdefs.ErrConflict)
	}
	for _, s := range sbs {
		s.tmplMu.Lock()
		m.dropNodeTemplates(s, id)
		s.tmplMu.Unlock()
		m.afterOpMeasure(s)
	}
	return m.nodeInfo(id), nil
}

// forgetImage drops what is known of node's image (its node is removed; its directory
// goes after the record).
func (m *Manager) forgetImage(node string) {
	m.img.mu.Lock()
	defer m.img.mu.Unlock()
	delete(m.img.nodes, node)
	m.killCopiesLocked(node)
	for i, n := range m.img.queue {
		if n == node {
			m.img.queue = append(m.img.queue[:i], m.img.queue[i+1:]...)
			break
		}
	}
}

// queueImage asks for node's image (after its templates are parked and recorded).
func (m *Manager) queueImage(node string) {
	if m.img == nil || m.img.pages == nil {
		return
	}
	m.img.mu.Lock()
	if st := m.img.nodes[node]; st != nil && (st.state == "complete" || st.state == "pending") || len(m.img.copies[node]) == 0 {
		m.img.mu.Unlock()
		return
	}
	if r := m.img.runner; r != nil && !r.Usable() {
		m.killCopiesLocked(node)
		m.img.nodes[node] = &imageState{state: "failed", err: "CRIU is unusable here: " + r.Reason}
		m.img.mu.Unlock()
		return
	}
	if len(m.img.queue) >= maxImageQueue {
		old := m.img.queue[0]
		m.img.queue = m.img.queue[1:]
		m.killCopiesLocked(old)
		m.img.dropped++
		m.img.nodes[old] = &imageState{state: "failed", err: "dropped: too many nodes were waiting for their images"}
	}
	m.img.queue = append(m.img.queue, node)
	m.img.nodes[node] = &imageState{state: "pending", queued: time.Now()}
	m.img.mu.Unlock()
	select {
	case m.img.wake <- struct{}{}:
	default:
	}
}

// imageFirst moves node to the head of the image queue, if it waits there: a fork
// waits for its image, and the worker dumps in checkpoint order otherwise.
func (m *Manager) imageFirst(node string) {
	m.img.mu.Lock()
	defer m.img.mu.Unlock()
	if i := slices.Index(m.img.queue, node); i > 0 {
		m.img.queue = slices.Insert(slices.Delete(m.img.queue, i, i+1), 0, node)
	}
}

// imageWorker dumps queued nodes one at a time until the manager stops.
func (m *Manager) imageWorker() {
	for {
		m.img.mu.Lock()
		var node string
		if len(m.img.queue) > 0 {
			node, m.img.queue = m.img.queue[0], m.img.queue[1:]
		}
		collect := node == "" && m.img.collect
		if collect {
			m.img.collect = false
		}
		m.img.mu.Unlock()
		if collect {
			m.collectPages()
			continue
		}
		if node == "" {
			select {
			case <-m.stop:
				return
			case <-m.img.wake:
				continue
			}
		}
		start := time.Now()
		bytes, full, err := m.dumpNode(node)
		m.img.mu.Lock()
		st := m.img.nodes[node]
		if st == nil {
			st = &imageState{}
			m.img.nodes[node] = st
		}
		st.dumpDur = time.Since(start)
		if err != nil {
			st.state, st.err = "failed", err.Error()
			m.log.Info("durable image failed", "node", node, "err", err)
		} else {
			st.state, st.bytes, st.full, st.dumped = "complete", bytes, full, time.Now().UTC()
		}
		m.img.mu.Unlock()
		if err != nil {
			// What the failed image wrote (CRIU's files, the refs of the pages its
			// earlier templates stored) would stay until the next start otherwise: a
			// sandbox whose images its quota refuses would still fill the store.
			_ = store.RemoveAll(m.imagesDir(node)) // what stays, the next start removes (startImages)
			m.imagesRemoved()
		}
		select {
		case <-m.stop:
			return
		default:
		}
	}
}

// dumpNode writes node's image: each template copied, dumped and ingested, then the
// complete mark. It returns the bytes the store took and what full dumps' pages are.
func (m *Manager) dumpNode(node string) (int64, int64, error) {
	m.img.mu.Lock()
	copies := m.img.copies[node]
	m.img.mu.Unlock()
	defer func() {
		// Listed until they are gone (sandboxCopies: a checkpoint meanwhile must not
		// take them for processes of the sandbox).
		m.img.mu.Lock()
		m.killCopiesLocked(node) // ended by CRIU once dumped; here if not
		m.img.mu.Unlock()
	}()
	recs := m.processRecord(node)
	if recs == nil || len(recs.Templates) != len(copies) {
		return 0, 0, errors.New("the node's templates are not recorded")
	}
	// The node's process record (queued just before this image) committed first: an
	// image is of templates the next daemon knows, and the worker, at idle priority,
	// waits a few ms for the index rather than dumping ahead of it.
	if err := m.st.Index.WaitDurable(m.st.Index.Seq()); err != nil {
		return 0, 0, fmt.Errorf("the node's process record is not committed: %w", err)
	}
	dir := m.imagesDir(node)
	if err := store.RemoveAll(dir); err != nil { // what an earlier image left
		return 0, 0, err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return 0, 0, err
	}
	var bytes, full int64
	for i, c := range copies {
		what := recs.Templates[i].What
		if c.cp == nil {
			return 0, 0, fmt.Errorf("%s: its template could not be copied", what)
		}
		sub := filepath.Join(dir, strconv.Itoa(i))
		if err := os.Mkdir(sub, 0o700); err != nil {
			return 0, 0, err
		}
		m.crashPoint("image", 1+3*i) // DELTABOX_CRASH_AT=image:K, a test hook
		if _, err := durable.Dump(context.Background(), m.img.runner, c.cp.Pid, sub, durable.DumpOptions{Kill: true, Background: true}); err != nil {
			return 0, 0, fmt.Errorf("dump %s: %w", what, err)
		}
		// The copy waited in a group stop, which a SIGCONT from the sandbox ends: an image
		// of a copy that ran, or no longer stopped, is not the template's.
		if err := durable.CheckCopyImage(sub, c.cp.Regs); err != nil {
			return 0, 0, fmt.Errorf("%s: %w", what, err)
		}
		// The copy's files as its template's: read-only, for the node's read-only view.
		if err := durable.ReadOnlyFDs(sub); err != nil {
			return 0, 0, fmt.Errorf("%s: %w", what, err)
		}
		if err := writeJSONFile(filepath.Join(sub, "template.json"), recs.Templates[i]); err != nil {
			return 0, 0, err
		}
		m.crashPoint("image", 2+3*i)
		is, err := m.img.pages.Ingest(sub)
		if err != nil {
			return 0, 0, fmt.Errorf("store the pages of %s: %w", what, err)
		}
		if err := m.imageFits(node, bytes+is.StoredBytes); err != nil {
			return 0, 0, err // the worker removes the image, and collects its new pages
		}
		m.crashPoint("image", 3+3*i)
		bytes += is.StoredBytes
		full += is.ImageBytes
	}
	if err := writeJSONFile(filepath.Join(dir, "complete"), imageMark{Templates: len(copies), At: time.Now().UTC(), Bytes: bytes}); err != nil {
		return 0, 0, err
	}
	m.crashPoint("image", 1+3*len(copies))
	return bytes, full, nil
}

// imageMark is an image's "complete" file.
type imageMark struct {
	Templates int       `json:"templates"`
	At        time.Time `json:"at"`
	Bytes     int64     `json:"bytes"` // what it added to the store (imageState.bytes)
}

// imageFits refuses node's image once its templates' pages are stored (stored: what
// they added to the store, the page store's dedup counted) when it would put the
// sandbox that made the node over its disk_mb: the image fails and is removed, and the
// node's processes live in its templates alone. Until then the store holds the full
// dump (up to the templates' memory) and the new pages.
func (m *Manager) imageFits(node string, stored int64) error {
	m.mu.Lock()
	var s *sb
	if n := m.nodes[node]; n != nil {
		s = m.sandboxes[n.Sandbox]
	}
	m.mu.Unlock()
	if s == nil {
		return nil // its sandbox is gone: the node is the client's
	}
	return m.imageRoom(s, stored, "the durable image of its checkpoint "+node)
}

// readTemplateRecord reads the template record an image holds (dumpNode writes it).
func readTemplateRecord(sub string) (templateRecord, error) {
	var tr templateRecord
	b, err := os.ReadFile(filepath.Join(sub, "template.json"))
	if err == nil {
		err = json.Unmarshal(b, &tr)
	}
	return tr, err
}

func writeJSONFile(p string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	f, err := os.OpenFile(p, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	defer func() { _ = f.Close() }() // synced above: nothing left to write back
	if _, err := f.Write(b); err != nil {
		return err
	}
	return f.Sync()
}

// processRecord returns node's last process record (recordTemplates keeps it).
func (m *Manager) processRecord(node string) *nodeProcesses {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.procRecs[node]
}

// restoreImage brings node's templates back into s from its durable image: each
// template's image restored into the node's read-only view, as a child of init, stopped,
// then adopted as a template (fastpath.AdoptStopped). lazy: the restore was lazy, its
// pages still coming in (lazy.go). Precondition: s.opMu held (a restore's first step),
// the node has no template in s.
// +checklocks:s.opMu
func (m *Manager) restoreImage(s *sb, node, lazyImage string) (_ []*procTemplate, lazy bool, _ error) {
	<-m.img.ready
	dir, imported := m.processImageDir(node)
	if dir == "" {
		return nil, false, nil
	}
	m.mu.Lock()
	n := m.nodes[node]
	var image string
	if n != nil {
		image = n.Image
	}
	uts := m.procRecs[node]
	m.mu.Unlock()
	if n == nil || !m.pidsKept(s, node) {
		return nil, false, nil // an image restores where its PIDs are kept free: pidsKept
	}
	view, err := m.nodeView(s.rt, image, node)
	if err != nil {
		return nil, false, err
	}
	defer view.Close()
	sbx, closeAll, err := m.durableSandbox(s.rt, view.NS)
	if err != nil {
		return nil, false, err
	}
	defer closeAll()
	rootFD, err := unix.FcntlInt(uintptr(view.Root), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, false, err
	}
	sbx.Root = os.NewFile(uintptr(rootFD), "view-root")
	defer func() { _ = sbx.Root.Close() }()
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, false, err
	}
	var tps []*procTemplate
	var lrs []*lazyRestore
	fail := func(err error) ([]*procTemplate, bool, error) {
		for _, t := range tps {
			t.tmpl.Kill()
		}
		for _, lr := range lrs {
			lr.l.Kill()                   // its processes are killed above
			_ = durable.DropPages(lr.dir) // a copy its refs can make again: disk only
		}
		return nil, false, fmt.Errorf("restore node %s's processes from its image: %w (%w)", node, err, errdefs.ErrConflict) // +checklocksignore: an inline closure, under its caller's opMu (gVisor #11203)
	}
	for _, e := range ents {
		if !e.IsDir() {
			continue
		}
		sub := filepath.Join(dir, e.Name())
		tr, err := readTemplateRecord(sub)
		if err != nil {
			return fail(err)
		}
		man, err := durable.ReadManifest(sub)
		if err != nil {
			return fail(err)
		}
		// A terminal for each the template held (its session's): a fresh one, owned by the
		// sandbox's root; the revive gives the process its session's terminal anyway.
		var masters []*os.File
		sbx.TTYs = map[string]*os.File{}
		for _, key := range man.TTYs {
			ms, sl, err := s.rt.OpenPTY()
			if err != nil {
				return fail(err)
			}
			masters = append(masters, ms)
			sbx.TTYs[key] = sl
		}
		// The image's PID was its template's: a template just evicted or killed keeps it
		// until it has exited and init has reaped it (a 500 MB python takes a few ms to
		// free its memory), and CRIU's clone3 with that PID fails with EEXIST meanwhile.
		if err := waitPidFree(s.rt, man.Pid, pidFreeWait); err != nil {
			return fail(err)
		}
		// A sandbox that did not make the node (a fork's branch) restores from a copy of
		// the image of its own: restores of one image in several sandboxes may run at
		// once, and each materializes the pages in its directory, changes its mode and
		// drops the pages after (privateImage). Eagerly: the copy goes when CRIU is done.
		from, private := sub, n.Sandbox != s.rec.ID || imported
		if private {
			if from, err = m.privateImage(sub, imported); err != nil {
				return fail(err)
			}
		}
		err = m.img.pages.Materialize(from)
		var rs *durable.RestoreStats
		var pages int64 // the image's pages, materialized
		if err == nil {
			pages = durable.PagesBytes(from)
			lazy := !private && m.lazyFor(s, pages, lazyImage)
			rs, err = m.restoreFreeingPid(s.rt.InitPid(), proctree.Holders, func() (*durable.RestoreStats, error) {
				return durable.Restore(context.Background(), m.img.runner, from, sbx, durable.RestoreOptions{Lazy: lazy})
			})
			if err != nil && lazy {
				// Where lazy pages cannot work (no /dev/userfaultfd, a CRIU without
				// patch 0007), the same restore eagerly, once the PID is free again.
				m.log.Warn("a lazy restore from an image failed: restoring it eagerly", "node", node, "err", err)
				if err = waitPidFree(s.rt, man.Pid, pidFreeWait); err == nil {
					rs, err = durable.Restore(context.Background(), m.img.runner, from, sbx, durable.RestoreOptions{})
				}
			}
		}
		var fill int64 // what a lazily restored template will come to hold
		if err == nil && rs.Lazy != nil {
			// Its server reads the pages until it is done (lazy.go).
			lrs = append(lrs, &lazyRestore{l: rs.Lazy, node: node, dir: sub})
			fill = pages
		} else {
			_ = durable.DropPages(from) // a copy its refs can make again: disk only
		}
		if private {
			if err := store.RemoveAll(filepath.Dir(from)); err != nil {
				m.log.Warn("remove a branch's private copy of an image (the start-up sweep removes it)", "node", node, "err", err)
			}
		}
		for _, f := range masters {
			_ = f.Close() // the restored processes have their own
		}
		for _, f := range sbx.TTYs {
			_ = f.Close()
		}
		if err != nil {
			return fail(err)
		}
		inner, err := procfs.InnerPid(rs.HostPid)
		if err != nil {
			_ = unix.Kill(rs.HostPid, unix.SIGKILL) // ESRCH: gone already; fail kills the rest
			return fail(err)
		}
		t, err := fastpath.AdoptStopped(m.tracer(s), tr.Template, rs.HostPid, inner)
		if err != nil {
			return fail(err)
		}
		tps = append(tps, &procTemplate{session: tr.Session, what: tr.What, kind: tr.Kind, argv: tr.Argv,
			sandbox: s.rec.ID, tmpl: t, term: tr.Term, parked: true, rssAnon: fill})
	}
	m.mu.Lock()
	m.templates[node] = append(m.templates[node], tps...) // other sandboxes' (fork branches) stay
	if n.uts == nil && uts != nil {
		n.uts = uts.UTS
	}
	m.mu.Unlock()
	m.watchLazy(s, lrs)
	if len(lrs) > 0 {
		// A lazily restored template fills after the answer, apart from the live
		// processes forked from it (their pages are not shared): the kernel limit must
		// already make room for all of it (its rssAnon, set above), or the memory
		// cgroup's OOM killer takes a template (seen: bench durable, 500 MB).
		m.fitKernelLimit(s, false)
	}
	return tps, len(lrs) > 0, nil
}

// privateImage copies the image in dir (one template's) for one restore, by reflink,
// each file 0644 as CRIU writes them (the restored root task reads some as the
// sandbox's root; an import's copies are 0600; the directory's parents stay closed). Its pages are left out (Materialize writes them from the refs) unless
// withPages (an imported image holds its pages, no refs). It returns the copy; the
// caller removes its parent. Under ROOT/durable/restores, which start-up empties
// (startImages).
func (m *Manager) privateImage(dir string, withPages bool) (string, error) {
	parent, err := os.MkdirTemp(filepath.Join(m.img.root, "restores"), "r-")
	if err != nil {
		return "", fmt.Errorf("a copy of the image to restore: %w", err)
	}
	dst := filepath.Join(parent, filepath.Base(dir))
	keep := func(name string) bool { // the pages only withPages
		return withPages || !strings.HasPrefix(name, "pages-") || !strings.HasSuffix(name, ".img")
	}
	if err := store.CloneDir(dir, dst, keep, 0o644); err != nil {
		if rerr := store.RemoveAll(parent); rerr != nil {
			err = errors.Join(err, rerr)
		}
		return "", fmt.Errorf("a copy of the image to restore: %w", err)
	}
	return dst, nil
}

// pidFreeWait bounds how long a restore from an image waits for its PID to be free.
const pidFreeWait = 5 * time.Second

// waitPidFree waits, d at most, until no process of rt has PID pid (in the sandbox).
func waitPidFree(rt *sandbox.Sandbox, pid int, d time.Duration) error {
	deadline := time.Now().Add(d)
	for {
		st := rt.ProcState(pid)
		if st == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("pid %d, the image's, is still taken in the sandbox after %v (state %c): a process other than the node's evicted template has it", pid, d, st)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// restoreFreeingPid runs a CRIU restore (restore), again while it fails on a PID of
// its image that no process holds once it has failed (durable.PidTakenError, holders
// answering proctree.NoHolder), up to pidRetries times, 1 ms apart doubling. The PID was
// being freed: since Linux 6.15 release_task frees a reaped task's PIDs after it drops
// tasklist_lock ("pid: perform free_pid() calls outside of tasklist_lock"), so the
// task's /proc entry, which waitPidFree watches, goes first, and on a loaded machine the
// reaping thread can be preempted between the two for milliseconds; CRIU's clone3
// set_tid meanwhile fails with EEXIST (TestDiskCheckpointImagesCounted, 1 run in about
// 15 at load average 14: nothing held the PID a moment after). A PID that something
// does hold is reported with its holder, and not tried again.
func (m *Manager) restoreFreeingPid(initHost int, holders func(initHost, pid int) string, restore func() (*durable.RestoreStats, error)) (*durable.RestoreStats, error) {
	delay := time.Millisecond
	for attempt := 0; ; attempt++ {
		rs, err := restore()
		var pt *durable.PidTakenError
		if err == nil || !errors.As(err, &pt) {
			return rs, err
		}
		h := holders(initHost, pt.Pid)
		if h != proctree.NoHolder || attempt == pidRetries {
			return nil, fmt.Errorf("%w: held by %s (tried %d times)", err, h, attempt+1)
		}
		m.log.Info("a CRIU restore met a PID being freed: trying again", "pid", pt.Pid, "attempt", attempt+1, "after", delay)
		time.Sleep(delay)
		delay *= 2
	}
}

// pidRetries bounds restoreFreeingPid: 10 retries wait about 1 s in all.
const pidRetries = 10

// durableSandbox opens what durable.Restore needs of rt: its init's namespaces, the
// state namespace ns to restore onto, its cgroups. closeAll closes the files.
func (m *Manager) durableSandbox(rt *sandbox.Sandbox, ns int) (durable.Sandbox, func(), error) {
	var files []*os.File
	closeAll := func() {
		for _, f := range files {
			_ = f.Close()
		}
	}
	open := func(kind string) *os.File {
		f, err := rt.OpenInitNS(kind)
		if err != nil {
			return nil
		}
		files = append(files, f)
		return f
	}
	mnt, err := unix.FcntlInt(uintptr(ns), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return durable.Sandbox{}, closeAll, err
	}
	mf := os.NewFile(uintptr(mnt), "state-mnt-ns")
	files = append(files, mf)
	sbx := durable.Sandbox{PID: open("pid"), User: open("user"), Net: open("net"), IPC: open("ipc"), UTS: open("uts"),
		Time: open("time"), Mnt: mf, Cgroups: rt.CgroupDirs(), AsRoot: rt.AsRoot}
	// The commands' cgroup namespace, not init's (sbinit.Client.CommandCgroupNS).
	cg, err := rt.CommandCgroupNS()
	if err != nil {
		closeAll()
		return durable.Sandbox{}, func() {}, err
	}
	files = append(files, cg)
	sbx.Cgroup = cg
	if sbx.PID == nil || sbx.User == nil || sbx.Net == nil {
		closeAll()
		return durable.Sandbox{}, func() {}, errors.New("the sandbox's namespaces could not be opened")
	}
	return sbx, closeAll, nil
}

// nodeView builds a read-only view of node's layers (as templates are parked on).
func (m *Manager) nodeView(rt *sandbox.Sandbox, image, node string) (sandbox.State, error) {
	spec, err := m.spec(image, node, 0)
	if err != nil {
		return sandbox.None, err
	}
	lowers := spec.Lowers
	if len(lowers) == 1 {
		empty := filepath.Join(m.st.Root, "tmp", "empty-lower")
		if err := os.MkdirAll(empty, 0o755); err != nil {
			return sandbox.None, err
		}
		lowers = append(lowers[:1:1], empty)
	}
	return rt.BuildState(overlay.Spec{Lowers: lowers})
}
