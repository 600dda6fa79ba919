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
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"deltabox/internal/cgroup"
	"deltabox/internal/remote"
	"deltabox/internal/sandbox"
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
