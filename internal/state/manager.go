// Package state is DeltaBox's state manager: it owns the snapshot tree, the sandboxes
// and their positions in the tree, and makes every checkpoint and restore one step
// that either completes or leaves the sandbox as it was.
//
// # The tree
//
// A node is an immutable checkpoint. Its filesystem is a stack of frozen layers: its
// own layer (the sandbox's upper at the time of the checkpoint, frozen) on top of its
// parent's stack, down to the image. A checkpoint with no changes reuses the parent's
// top layer. A sandbox stands on a node (its head) with a fresh writable upper on top of
// the node's stack. A node a sandbox stands on, or has descendants a sandbox stands on,
// cannot be removed.
//
// # Locking
//
// Lock order: sandbox.opMu -> Manager.treeMu -> Manager.mu -> sandbox.mu.
//   - sandbox.opMu serialises state-changing operations on one sandbox (checkpoint,
//     restore, rm) and the start of an exec; different sandboxes proceed in parallel.
//   - treeMu is held shared by checkpoint and restore (which read node stacks and
//     mount them) and exclusively by node removal (which deletes layers).
//   - mu protects the maps and the layer allocator; it is never held across a mount,
//     a fork or an index wait.
//   - sandbox.mu protects execs (the count of running execs).
package state

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"sync"
	"time"

	"deltabox/internal/cgroup"
	"deltabox/internal/errdefs"
	"deltabox/internal/mountns"
	"deltabox/internal/overlay"
	"deltabox/internal/remote"
	"deltabox/internal/sandbox"
	"deltabox/internal/sbinit"
	"deltabox/internal/session"
	"deltabox/internal/store"
)

// Manager is the state manager.
type Manager struct {
	st  *store.Store
	log *slog.Logger

	treeMu sync.RWMutex

	mu        sync.Mutex
	nodes     map[string]*node
	sandboxes map[string]*sb
	nextLayer uint64

	templates map[string][]*procTemplate // node id -> its process templates (fastpath.go)

	uppers chan uint64   // empty layers made ahead of time (fillUppers)
	stop   chan struct{} // closed by Close

	// FailStep, when set (tests only), makes step k of a checkpoint or restore fail,
	// to prove that every failure leaves the sandbox as it was.
	FailStep func(op string, step int) error

	// noPrepare turns off the prepared next state (DELTABOX_NO_PREPARE=1), to measure
	// or debug the plain path.
	noPrepare bool
}

type node struct {
	store.Node
	seq      uint64 // index sequence of its last write (durability)
	removing bool   // RemoveNode is taking it out: make no warm state of it
}

type sb struct {
	opMu sync.Mutex
	rec  store.Sandbox // guarded by opMu (and read under Manager.mu for listings)
	rt   *sandbox.Sandbox
	err  error // why rt is nil (start failed after a daemon restart)
	seq  uint64

	// buildMu serialises the background builds of the next and warm states (one at a
	// time per sandbox, so that a layer's frozen/ is prepared by one of them at once).
	// It is held for the whole build, about a millisecond of mounts; prepMu only around
	// the reads and writes of what it guards, so that a restore arriving during a build
	// need not wait for it (it did: ~1 ms of every MCTS rollback that follows a
	// checkpoint). Lock order: m.treeMu -> buildMu -> prepMu -> m.mu.
	buildMu sync.Mutex
	prepMu  sync.Mutex // guards next, nextGen (prepare.go), warm, building and warmClosed (warm.go)
	next    *prepared
	// nextGen moves at every checkpoint and restore: a build asked for before it is stale.
	nextGen    uint64
	warm       map[string]*warmState
	building   string        // the node whose warm state is being built, if any
	buildDone  chan struct{} // closed when that build is over
	warmClosed bool

	bg *background // after-answer work waits for this sandbox's operations (background.go)

	tracer *remote.Tracer // owns the ptrace of this sandbox's processes; under opMu
	// hostPids caches each session process's host PID (by sandbox PID), checked at each
	// use (fastpath.IsHostPid): finding it among the cgroup's PIDs reads one
	// /proc/PID/status per process, templates included (100+ reads). Under opMu.
	hostPids map[int]int
	tmplMu   sync.Mutex // held by whoever seizes this sandbox's templates (restore, parking)

	mu          sync.Mutex
	execs       int
	removed     bool
	sessions    map[string]*session.Session
	sessionOpts map[string]SessionOptions
	ended       map[string]string // sessions a checkpoint/restore ended, and why
	warming     *procWarm         // the running warm-up of restored processes (procwarm.go)

	stats Stats
}

func newSB(r store.Sandbox) *sb {
	return &sb{rec: r, bg: newBackground(), warm: map[string]*warmState{}, sessions: map[string]*session.Session{}, sessionOpts: map[string]SessionOptions{}, ended: map[string]string{}, hostPids: map[int]int{}}
}

// Stats counts what happened to a sandbox.
type Stats struct {
	Checkpoints int `json:"checkpoints"`
	Restores    int `json:"restores"`
	Execs       int `json:"execs"`
	// Checkpoints that forked process templates and restores that forked them back (the
	// same as checkpoint_paths.process and restore_paths.process).
	ProcessCheckpoints int `json:"process_checkpoints"`
	ProcessRestores    int `json:"process_restores"`
	// Per path, with the reasons for the files-only one (stats.go).
	CheckpointPaths PathCounts `json:"checkpoint_paths"`
	RestorePaths    PathCounts `json:"restore_paths"`
	// WarmedBytes is how much restored processes' memory was pre-faulted (procwarm.go).
	WarmedBytes int64 `json:"warmed_bytes,omitempty"`
}

// New opens the manager on an opened store: loads the index, sweeps orphans, kills
// what a previous daemon left running, and restarts every sandbox of the index on its
// head with its upper (files survive a daemon restart; processes do not).
func New(st *store.Store, log *slog.Logger) (*Manager, error) {
	m := &Manager{st: st, log: log, nodes: map[string]*node{}, sandboxes: map[string]*sb{}, templates: map[string][]*procTemplate{},
		uppers: make(chan uint64, 4), stop: make(chan struct{}), noPrepare: os.Getenv("DELTABOX_NO_PREPARE") == "1"}
	st.Index.SyncFS = st.Syncfs
	nodes, sbs, err := st.Index.Load()
	if err != nil {
		return nil, fmt.Errorf("load index: %w", err)
	}
	for _, id := range cgroup.List() {
		g := &cgroup.Group{Path: filepath.Join(cgroup.Root, id)}
		if err := g.Destroy(5 * time.Second); err != nil {
			log.Warn("stale sandbox cgroup", "id", id, "err", err)
		}
	}
	for _, id := range cgroup.ListV1() { // limits: after the kill above, they are empty
		if err := cgroup.OpenV1(id).Destroy(5 * time.Second); err != nil {
			log.Warn("stale sandbox cgroup (v1)", "id", id, "err", err)
		}
	}
	for _, r := range st.Sweep(nodes, sbs) {
		log.Info("swept orphan", "path", r)
	}
	// Repair checkpoints a crash interrupted: a sandbox's upper that was being frozen
	// (the node was never recorded) goes back to being its upper; a recorded node's
	// layer loses the upper dirs that were still waiting to be dropped.
	for _, r := range sbs {
		if st.IsFrozen(r.Upper) {
			if err := st.Unfreeze(r.Upper); err != nil {
				return nil, fmt.Errorf("repair sandbox %s: %w", r.ID, err)
			}
			log.Info("repaired an interrupted checkpoint", "sandbox", r.ID, "layer", r.Upper)
		}
	}
	for _, n := range nodes {
		if n.Own {
			if !st.IsFrozen(n.Layer) {
				log.Error("node's layer is missing: restores to it and its subtree will fail; remove it with deltabox tree rm", "node", n.ID, "layer", st.LayerFrozen(n.Layer))
				continue
			}
			st.DropUpperDirs(n.Layer)
		}
	}
	m.nextLayer = st.MaxLayerID()
	for _, n := range nodes {
		m.nodes[n.ID] = &node{Node: n}
		if n.Layer > m.nextLayer {
			m.nextLayer = n.Layer
		}
	}
	for _, r := range sbs {
		s := newSB(r)
		m.sandboxes[r.ID] = s
		if r.Upper > m.nextLayer {
			m.nextLayer = r.Upper
		}
	}
	go m.fillUppers()
	for _, s := range m.sandboxes {
		if err := m.boot(s); err != nil {
			s.err = err
			log.Error("sandbox did not restart", "id", s.rec.ID, "err", err)
		}
	}
	return m, nil
}

// Close stops every sandbox (their records stay) and flushes the index.
func (m *Manager) Close() error {
	close(m.stop)
	m.mu.Lock()
	var all []*sb
	for _, s := range m.sandboxes {
		all = append(all, s)
	}
	m.mu.Unlock()
	for _, s := range all {
		s.opMu.Lock()
		m.stopProcWarm(s)
		m.discardNext(s)
		m.closeWarm(s)
		// The tracer first: a template it holds that dies stays a zombie until the tracer
		// has waited for it, and init's exit waits for every process of its namespace.
		if s.tracer != nil {
			s.tracer.Close()
			s.tracer = nil
		}
		if s.rt != nil {
			s.rt.Destroy()
			s.rt = nil
		}
		m.endSessions(s, "daemon stopped")
		s.opMu.Unlock()
	}
	return m.st.Close()
}

// ---- sandboxes ----

// CreateOptions configures a new sandbox.
type CreateOptions struct {
	ID       string `json:"id,omitempty"`
	Image    string `json:"image,omitempty"`
	Workdir  string `json:"workdir,omitempty"`
	Hostname string `json:"hostname,omitempty"`
	// Limits (0: the default; see cgroup.DefaultLimits and docs/API.md). MemoryMB is
	// in MiB.
	MemoryMB int64   `json:"memory_mb,omitempty"`
	Pids     int64   `json:"pids,omitempty"`
	CPUs     float64 `json:"cpus,omitempty"`
	// WarmProcesses: after each restore, pre-fault the pages the restored processes
	// had written, while their sessions wait for input (procwarm.go). Default: off, or
	// on for every sandbox with DELTABOX_WARM_PROC=1 in the daemon's environment.
	WarmProcesses bool `json:"warm_processes,omitempty"`
}

// SandboxInfo is what the API shows of a sandbox.
type SandboxInfo struct {
	store.Sandbox
	InitPid int    `json:"init_pid,omitempty"`
	Status  string `json:"status"`          // running | broken
	Error   string `json:"error,omitempty"` // why broken
	Stats   Stats  `json:"stats"`
	Durable bool   `json:"durable"`
	// WarmStates is how many nodes' states are kept mounted for fast restores (warm.go).
	WarmStates int `json:"warm_states"`
	// Usage of the limits (store.Sandbox.Limits) by the sandbox's commands, when running.
	Usage *cgroup.Usage `json:"usage,omitempty"`
	// Templates totals the sandbox's process templates (every node's) and their memory.
	Templates *TemplateInfo `json:"templates,omitempty"`
}

var idRE = regexp.MustCompile(`^[a-z0-9][a-z0-9_.-]{0,62}$`)

func randomID(prefix string) string {
	b := make([]byte, 4)
	rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

// Create makes a sandbox on image and starts it.
func (m *Manager) Create(ctx context.Context, o CreateOptions) (*SandboxInfo, error) {
	if o.Image == "" {
		o.Image = "default"
	}
	if o.Workdir == "" {
		o.Workdir = "/workspace"
	}
	if !filepath.IsAbs(o.Workdir) {
		return nil, fmt.Errorf("workdir %q must be an absolute path: %w", o.Workdir, errdefs.ErrInvalid)
	}
	if _, err := os.Stat(filepath.Join(m.st.Root, "images", o.Image, "image.json")); err != nil || !idRE.MatchString(o.Image) {
		return nil, fmt.Errorf("image %q does not exist (deltabox image ls lists them; scripts/setup.sh builds \"default\"): %w", o.Image, errdefs.ErrNotFound)
	}
	if err := mountns.CheckImage(m.st.ImageRootfs(o.Image)); err != nil {
		return nil, fmt.Errorf("image %s: %v: %w", o.Image, err, errdefs.ErrInvalid)
	}
	if o.ID == "" {
		o.ID = randomID("sb-")
	} else if !idRE.MatchString(o.ID) {
		return nil, fmt.Errorf("sandbox id %q: use 1-63 characters of a-z, 0-9, '.', '_', '-': %w", o.ID, errdefs.ErrInvalid)
	}
	if o.Hostname == "" {
		o.Hostname = o.ID
	}
	if o.MemoryMB > 1<<40 { // 1 EiB: far over any host's RAM (Check refuses it), and no overflow
		o.MemoryMB = 1 << 40
	}
	lim := cgroup.Limits{MemoryBytes: o.MemoryMB << 20, Pids: o.Pids, CPUs: o.CPUs}
	if err := lim.Check(); err != nil {
		return nil, fmt.Errorf("limits: %v: %w", err, errdefs.ErrInvalid)
	}
	m.mu.Lock()
	if _, ok := m.sandboxes[o.ID]; ok {
		m.mu.Unlock()
		return nil, fmt.Errorf("sandbox %s already exists: %w", o.ID, errdefs.ErrConflict)
	}
	if _, ok := m.nodes[o.ID]; ok {
		m.mu.Unlock()
		return nil, fmt.Errorf("%s is a node id; choose another sandbox id: %w", o.ID, errdefs.ErrConflict)
	}
	s := newSB(store.Sandbox{ID: o.ID, Image: o.Image, Workdir: o.Workdir, Hostname: o.Hostname, Created: time.Now().UTC(), WarmProcesses: o.WarmProcesses})
	s.opMu.Lock() // held until started: nothing else may touch a half-made sandbox
	defer s.opMu.Unlock()
	m.sandboxes[o.ID] = s
	m.mu.Unlock()

	upper, err := m.freshUpper(m.st.ImageRootfs(o.Image))
	if err == nil {
		s.rec.Upper = upper
		s.rec.Limits = lim.WithDefaults()
		err = m.boot(s)
	}
	if err != nil {
		m.mu.Lock()
		delete(m.sandboxes, o.ID)
		m.mu.Unlock()
		if s.rt != nil {
			s.rt.Destroy()
		}
		store.RemoveAll(m.st.LayerDir(upper))
		store.RemoveAll(m.st.SandboxDir(o.ID))
		return nil, err
	}
	// The directories exist before the record that names them.
	s.seq = m.st.Index.Apply(store.Op{PutSandbox: &s.rec})
	if err := m.ensureWorkdir(ctx, s); err != nil {
		m.log.Warn("workdir", "sandbox", o.ID, "err", err)
	}
	return m.info(s), nil
}

// boot starts the runtime of s on its head's stack and its upper.
func (m *Manager) boot(s *sb) error {
	dir := m.st.SandboxDir(s.rec.ID)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	spec, err := m.spec(s.rec.Image, s.rec.Head, s.rec.Upper)
	if err != nil {
		return err
	}
	if err := m.st.ResetWork(s.rec.Upper); err != nil {
		return fmt.Errorf("reset the upper's workdir: %w", err)
	}
	s.rec.Limits = s.rec.Limits.WithDefaults() // records older than limits
	rt, err := sandbox.Start(s.rec.ID, s.rec.Hostname, dir, s.rec.Limits)
	if err != nil {
		return err
	}
	if err := rt.SetState(spec); err != nil {
		rt.Destroy()
		return err
	}
	s.rt = rt
	s.err = nil
	m.prepareNext(s)
	return nil
}

func (m *Manager) ensureWorkdir(ctx context.Context, s *sb) error {
	r, err := s.rt.Exec(ctx, sandbox.ExecRequest{Argv: []string{"/bin/mkdir", "-p", s.rec.Workdir}, Dir: "/", Timeout: 10 * time.Second})
	if err != nil {
		return err
	}
	if r.ExitCode != 0 {
		return fmt.Errorf("mkdir %s: %s", s.rec.Workdir, r.Stderr)
	}
	return nil
}

func (m *Manager) get(id string) (*sb, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	s, ok := m.sandboxes[id]
	if !ok {
		return nil, fmt.Errorf("no sandbox %q (deltabox ls lists them): %w", id, errdefs.ErrNotFound)
	}
	return s, nil
}

// lockLive locks s.opMu and checks that s can be operated on. On success the caller
// holds opMu and must unlock it.
func (m *Manager) lockLive(s *sb) error {
	s.opMu.Lock()
	s.mu.Lock()
	removed := s.removed
	s.mu.Unlock()
	if removed {
		s.opMu.Unlock()
		return fmt.Errorf("no sandbox %q: it was removed: %w", s.rec.ID, errdefs.ErrNotFound)
	}
	if s.rt == nil {
		err := s.err
		s.opMu.Unlock()
		return fmt.Errorf("sandbox %s is broken (%v): remove it with deltabox rm: %w", s.rec.ID, err, errdefs.ErrConflict)
	}
	if !s.rt.Alive() {
		s.opMu.Unlock()
		return fmt.Errorf("sandbox %s is broken: its init died (killed from outside the daemon?); its files are intact: remove it with deltabox rm: %w", s.rec.ID, errdefs.ErrConflict)
	}
	return nil
}

func (m *Manager) info(s *sb) *SandboxInfo {
	in := &SandboxInfo{Sandbox: s.rec, Status: "running", Durable: m.st.Index.Durable(s.seq)}
	if s.rt != nil && !s.rt.Alive() {
		in.Status, in.Error = "broken", "its init died (killed from outside the daemon?); remove it with deltabox rm"
	} else if s.rt != nil {
		in.InitPid = s.rt.InitPid()
		u := s.rt.Usage()
		in.Usage = &u
	} else {
		in.Status = "broken"
		if s.err != nil {
			in.Error = s.err.Error()
		}
	}
	s.mu.Lock()
	in.Stats = s.stats
	s.mu.Unlock()
	in.WarmStates = m.warmCount(s)
	return in
}

// Get returns one sandbox.
func (m *Manager) Get(id string) (*SandboxInfo, error) {
	s, err := m.get(id)
	if err != nil {
		return nil, err
	}
	s.opMu.Lock()
	in := m.info(s)
	s.opMu.Unlock()
	_, perSandbox, _ := m.templateCosts(nil, id, time.Second)
	in.Templates = perSandbox[id]
	return in, nil
}

// List returns every sandbox, sorted by creation time.
func (m *Manager) List() []*SandboxInfo {
	m.mu.Lock()
	var all []*sb
	for _, s := range m.sandboxes {
		all = append(all, s)
	}
	m.mu.Unlock()
	var out []*SandboxInfo
	_, perSandbox, _ := m.templateCosts(nil, "", time.Second)
	for _, s := range all {
		s.opMu.Lock()
		in := m.info(s)
		s.opMu.Unlock()
		in.Templates = perSandbox[in.ID]
		out = append(out, in)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Created.Before(out[j].Created) })
	return out
}

// Remove destroys a sandbox: processes, mounts, cgroup, its upper layer and its
// directory. Nodes it created stay in the tree (remove them with RemoveNode).
func (m *Manager) Remove(id string) error {
	s, err := m.get(id)
	if err != nil {
		return err
	}
	s.opMu.Lock()
	defer s.opMu.Unlock()
	s.mu.Lock()
	if s.removed {
		s.mu.Unlock()
		return fmt.Errorf("no sandbox %q: %w", id, errdefs.ErrNotFound)
	}
	s.removed = true
	s.mu.Unlock()
	m.discardNext(s)
	m.closeWarm(s)
	m.stopProcWarm(s)
	// The tracer before the sandbox (see Close).
	if s.tracer != nil {
		s.tracer.Close()
		s.tracer = nil
	}
	var derr error
	if s.rt != nil {
		derr = s.rt.Destroy()
		s.rt = nil
	}
	m.endSessions(s, "sandbox removed")
	m.dropSandboxTemplates(id)
	m.mu.Lock()
	delete(m.sandboxes, id)
	m.mu.Unlock()
	upper, dir := m.st.LayerDir(s.rec.Upper), m.st.SandboxDir(id)
	// Record first, directories after: a crash in between leaves orphans the sweep removes.
	seq := m.st.Index.Apply(store.Op{DeleteSandbox: id}, store.Op{After: func() {
		store.RemoveAll(upper)
		store.RemoveAll(dir)
	}})
	// Wait for the directories to go, so the id can be reused at once.
	if err := m.st.Index.WaitDurable(seq); err != nil && derr == nil {
		derr = err
	}
	return derr
}

// ---- exec ----

// Exec runs a command in the sandbox. Execs may run in parallel with each other;
// a checkpoint or restore refuses (409) while one runs.
func (m *Manager) Exec(ctx context.Context, id string, r sandbox.ExecRequest) (*sandbox.ExecResult, error) {
	if len(r.Argv) == 0 {
		return nil, fmt.Errorf("exec needs a command: %w", errdefs.ErrInvalid)
	}
	s, err := m.get(id)
	if err != nil {
		return nil, err
	}
	if err := m.lockLive(s); err != nil {
		return nil, err
	}
	rt := s.rt
	var sess *session.Session
	var restarted bool
	if r.Session != "" {
		var err error
		if sess, restarted, err = m.sessionFor(s, r.Session); err != nil {
			s.opMu.Unlock()
			return nil, err
		}
	}
	if r.Dir == "" {
		r.Dir = s.rec.Workdir
	} else if !filepath.IsAbs(r.Dir) {
		r.Dir = filepath.Join(s.rec.Workdir, r.Dir)
	}
	s.mu.Lock()
	s.execs++
	s.stats.Execs++
	s.mu.Unlock()
	// A warm-up of restored processes lets go of its process before any command runs.
	m.stopProcWarm(s)
	s.opMu.Unlock()
	defer func() {
		s.mu.Lock()
		s.execs--
		s.mu.Unlock()
	}()
	if sess != nil {
		res, err := m.execSession(ctx, sess, r)
		if res != nil {
			res.Session, res.SessionRestarted = r.Session, restarted
		}
		return res, err
	}
	res, err := rt.Exec(ctx, r)
	if errors.Is(err, sbinit.ErrInitGone) {
		return nil, fmt.Errorf("sandbox %s: %v; remove it with deltabox rm: %w", id, err, errdefs.ErrConflict)
	}
	if err != nil { // the command could not start: not found, bad directory
		return nil, fmt.Errorf("%v: %w", err, errdefs.ErrInvalid)
	}
	return res, nil
}

// ---- layers ----

// newLayer allocates a layer id and creates its (empty) directories.
func (m *Manager) newLayer() (uint64, error) {
	m.mu.Lock()
	m.nextLayer++
	id := m.nextLayer
	m.mu.Unlock()
	if err := m.st.NewLayer(id); err != nil {
		return 0, fmt.Errorf("create layer %d: %w", id, err)
	}
	return id, nil
}

// stack returns the layer ids of node id's filesystem, top first (image excluded).
// Precondition: mu held.
func (m *Manager) stack(id string) []uint64 {
	var out []uint64
	var last uint64
	for id != "" {
		n := m.nodes[id]
		if n == nil {
			break
		}
		if n.Layer != 0 && n.Layer != last {
			out = append(out, n.Layer)
			last = n.Layer
		}
		id = n.Parent
	}
	return out
}

// spec is the overlay of a sandbox standing on head with upper.
func (m *Manager) spec(image, head string, upper uint64) (overlay.Spec, error) {
	m.mu.Lock()
	ids := m.stack(head)
	m.mu.Unlock()
	var lowers []string
	for _, l := range ids {
		lowers = append(lowers, m.st.LayerFrozen(l))
	}
	lowers = append(lowers, m.st.ImageRootfs(image))
	if len(lowers) > overlay.MaxLowers {
		return overlay.Spec{}, fmt.Errorf("the node's stack has %d layers, over overlayfs's limit of %d: %w", len(lowers), overlay.MaxLowers, errdefs.ErrConflict)
	}
	return overlay.Spec{Lowers: lowers, Upper: m.st.LayerDiff(upper), Work: m.st.LayerWork(upper)}, nil
}

func (m *Manager) fail(op string, step int) error {
	if m.FailStep != nil {
		return m.FailStep(op, step)
	}
	return nil
}
