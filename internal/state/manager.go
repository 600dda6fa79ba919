package state

import (
	"cmp"
	"fmt"
	"log/slog"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/cgroup"
	"deltabox/internal/hostids"
	"deltabox/internal/mountns"
	"deltabox/internal/netproxy"
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
	net *netproxy.Proxy // serves every sandbox with a network (network.go)

	treeMu sync.RWMutex

	mu sync.Mutex
	// +checklocks:mu
	nodes map[string]*node
	// kids: each node's children's ids ("": the roots), in no order, kept with nodes
	// (addNodeLocked, removeNodeLocked) so that an answer's node needs no walk of them all.
	// +checklocks:mu
	kids map[string][]string
	// idsTaken: node IDs handed out by newNodeID whose node is not in nodes yet (a
	// checkpoint syncs its CRIU trees between the two); protected by mu.
	// +checklocks:mu
	idsTaken map[string]bool
	// pending: the nodes of checkpoints between their answer and their end (answer.go),
	// and those whose checkpoint failed after an early answer (kept, bounded, to say so).
	// +checklocks:mu
	pending map[string]*pendingNode
	// +checklocks:mu
	failedOrder []string // the failed ones in pending, oldest first
	// +checklocks:mu
	sandboxes map[string]*sb
	// +checklocks:mu
	nextLayer uint64
	// sessionStarts counts the sessions being started (reserveSession), under mu.
	// +checklocks:mu
	sessionStarts int

	// +checklocks:mu
	templates map[string][]*procTemplate // node id -> its process templates (templates.go)
	// famOf is each fast fork family's member's family, families every family alive
	// (family.go).
	// +checklocks:mu
	famOf map[string]*family
	// +checklocks:mu
	families []*family
	// procRecs is each node's last process record (restart.go: recordTemplates), under mu.
	// +checklocks:mu
	procRecs map[string]*nodeProcesses
	// img: durable images of templates (durable.go).
	img *images

	// diskMu serialises the disk usage passes (diskquota.go); taken under no other lock,
	// and no sandbox's opMu under it (doc.go).
	diskMu sync.Mutex
	// inodeBytes: what an inode costs in a sandbox's quota (the store's inode size; under diskMu).
	// +checklocks:diskMu
	inodeBytes int64
	// passAt is when the last complete pass started, and passFreed diskFreed then: what
	// diskRefusal reuses (under diskMu).
	// +checklocks:diskMu
	passAt time.Time
	// +checklocks:diskMu
	passFreed uint64
	// diskFreed counts what may have lowered a sandbox's usage through the API since: file
	// operations on a sandbox over its quota, node and sandbox removals.
	diskFreed atomic.Uint64
	// fastForks counts the fast forks under way: the watcher's timed pass waits for them
	// (diskDue).
	fastForks atomic.Int32

	cfg    Config
	ids    *hostids.Registry // the host's id ranges (ids.go); nil with isolation off
	uppers chan uint64       // empty layers made ahead of time (fillUppers)
	// squashQ: nodes whose stack is long enough to squash (squash.go: squashLoop).
	squashQ chan string
	// spareSlots bounds the spares being made at once (spares.go: spareBuilds).
	spareSlots chan struct{}
	stop       chan struct{}  // closed by Close
	wg         sync.WaitGroup // the manager's goroutines (see the package doc); Close waits

	// imageDone reports whether a node's durable process image is complete (budget.go:
	// eviction may then drop its templates). nil until durable images exist: nothing is
	// evicted. Set before the manager serves; read under mu.
	imageDone func(node string) bool

	// failStep, when set (by tests, through export_test.go's SetFailStep), makes step k
	// of a checkpoint or restore fail, to prove that every failure leaves the sandbox as
	// it was. Remove calls it at its step 1 too (its error is ignored there): a point for
	// a test to delay.
	failStep func(op string, step int) error
	// crashAt is the crash point (op.go: crashPoint) of a daemon built with -tags
	// testhooks (crashpoint_testhooks.go), else "".
	crashAt string
}

type node struct {
	store.Node
	seq      uint64 // index sequence of its last write (durability)
	removing bool   // RemoveNode is taking it out: make no warm state of it
	// uts: the host and domain names its checkpoint read, for restores by the sandbox
	// that made it (kernelstate.go); recorded with its templates (restart.go), which a
	// daemon restart keeps.
	uts *sbinit.UTS
	// pinned: the client's hint that it will restore the node again (budget.go: never
	// evicted); lastRestore: its last restore, for eviction's order. In memory, like its
	// templates.
	pinned      bool
	lastRestore time.Time
	// completeMS: the time its checkpoint took until it was complete (0: made before
	// this daemon started, or imported).
	completeMS float64
}

type sb struct {
	opMu sync.Mutex
	// rec is guarded by opMu (and read under Manager.mu for listings); its ID and what
	// create fixed are read without a lock. Not checklocks-annotated: no one guard.
	rec store.Sandbox
	// +checklocks:opMu
	rt *sandbox.Sandbox
	// +checklocks:opMu
	kns *sbinit.NS // rt's IPC and UTS namespaces (kernelstate.go)
	// +checklocks:opMu
	err error // why rt is nil (start failed after a daemon restart)
	// +checklocks:opMu
	seq uint64

	// buildMu serialises the background builds of the next and warm states (one at a
	// time per sandbox, so that a layer's frozen/ is prepared by one of them at once).
	// It is held for the whole build, about a millisecond of mounts; prepMu only around
	// the reads and writes of what it guards, so that a restore arriving during a build
	// need not wait for it (it did: ~1 ms of every MCTS rollback that follows a
	// checkpoint). Lock order: m.treeMu -> buildMu -> prepMu -> m.mu.
	buildMu sync.Mutex
	prepMu  sync.Mutex // guards next, nextGen (prepare.go), warm, building and warmClosed (warm.go)
	// +checklocks:prepMu
	next *prepared
	// nextGen moves at every checkpoint and restore: a build asked for before it is stale.
	// +checklocks:prepMu
	nextGen uint64
	// +checklocks:prepMu
	warm map[string]*warmState
	// +checklocks:prepMu
	building string // the node whose warm state is being built, if any
	// +checklocks:prepMu
	buildDone chan struct{} // closed when that build is over
	// +checklocks:prepMu
	warmClosed bool // +checklocksignore: prepMu guards it; the hint that buildMu does is a coincidence (its writer and readers build)

	bg *background // after-answer work waits for this sandbox's operations (background.go)

	// lazy are the lazy restores into this sandbox still copying pages (lazy.go); under
	// lazyMu, a leaf.
	lazyMu sync.Mutex
	// +checklocks:lazyMu
	lazy []*lazyRestore

	// net serves the sandbox's network (network.go); nil: none.
	// +checklocks:mu
	net *netproxy.Sandbox

	// +checklocks:opMu
	tracer *remote.Tracer // owns the ptrace of this sandbox's processes; under opMu
	// hostPids caches each session process's host PID (by sandbox PID), checked at each
	// use (fastpath.IsHostPid): finding it among the cgroup's PIDs reads one
	// /proc/PID/status per process, templates included (100+ reads). Under opMu.
	// +checklocks:opMu
	hostPids map[int]int
	// copyMu is held while a copy of a template is made and registered for its image
	// (durable.go: copyForImage), and by a checkpoint while it lists the sandbox's
	// processes (holdOthers), so that a copy being made is never taken for a process of
	// the sandbox. Not a leaf: held across the copy's injected fork and a round trip to
	// init (doc.go: the lock order).
	copyMu sync.Mutex

	// keepMu serialises keepSessions; kept is what it last handed init (under keepMu).
	keepMu sync.Mutex
	// +checklocks:keepMu
	kept map[string]keptMark

	// tmplMu is held by whoever seizes this sandbox's templates (a restore while it
	// forks from them, parking in the background), so that no template is seized twice.
	tmplMu sync.Mutex

	mu sync.Mutex
	// +checklocks:mu
	execs int // calls running (admission.running, counted)
	// +checklocks:mu
	adm admission // calls and state switches in arrival order (op.go)
	// +checklocks:mu
	oomSeen int64 // +checklocksignore: not opMu's: Exec (not analysed) takes only mu; the memory limit's kill count when last read (Exec)
	// +checklocks:mu
	removed bool
	// lateFailure: a checkpoint of this sandbox that answered early and then failed,
	// not reported yet: the next call or switch answers it (answer.go).
	// +checklocks:mu
	lateFailure *pendingNode
	// +checklocks:mu
	sessions map[string]*session.Session
	// +checklocks:mu
	sessionOpts map[string]SessionOptions
	// +checklocks:mu
	ended map[string]string // sessions a checkpoint/restore ended, and why
	// +checklocks:mu
	warming *procWarm // the running warm-up of restored processes (procwarm.go)

	// +checklocks:mu
	stats Stats
	// +checklocks:mu
	disk diskState // what the disk watcher measured (diskquota.go)
	// reclaiming: the disk watcher is dropping its upper (diskquota.go: reclaimDisk).
	// +checklocks:mu
	reclaiming bool
	// +checklocks:mu
	budget budgetMeasure // what its templates held when last measured (budget.go)
	// limitMu serialises the changes of the kernel's memory limit (budget.go:
	// fitKernelLimit) and guards kernelLimit, the limit written last.
	limitMu sync.Mutex
	// +checklocks:limitMu
	kernelLimit int64

	// memRT is rt, for reads of its memory usage by other sandboxes' admissions
	// (budget.go), which must not wait for this sandbox's opMu.
	// +checklocks:mu
	memRT *sandbox.Sandbox

	// spareMu guards spares, spareMaking and spareClosed (spares.go): a leaf.
	spareMu sync.Mutex
	// +checklocks:spareMu
	spares []*spare // oldest first
	// +checklocks:spareMu
	spareMaking map[string]chan struct{} // nodes whose spare is being made: closed when done
	// +checklocks:spareMu
	spareClosed bool

	// budgetMB is the record's TemplateBudgetMB, fixed at create (budget.go:
	// templateBudget); read without a lock.
	budgetMB int64
}

func (m *Manager) newSB(r store.Sandbox) *sb {
	return &sb{rec: r, bg: newBackground(m.cfg.AnswerDelay, &m.wg), warm: map[string]*warmState{}, sessions: map[string]*session.Session{}, sessionOpts: map[string]SessionOptions{}, ended: map[string]string{}, hostPids: map[int]int{}, kept: map[string]keptMark{}, spareMaking: map[string]chan struct{}{}, budgetMB: r.TemplateBudgetMB}
}

// Stats counts what happened to a sandbox (countPath, countFailed). The wire form is
// defined once, in apitypes.
type Stats = apitypes.Stats

// New opens the manager on an opened store: loads the index, sweeps orphans, kills
// what a previous daemon left running outside the sandboxes it adopts (restart.go), and
// restarts every sandbox it does not adopt on its head with its upper, with no process
// running (its nodes' durable images can still bring theirs back: durable.go).
func New(st *store.Store, log *slog.Logger, cfg Config) (*Manager, error) {
	if per, total := DefaultTemplateBudgets(); cfg.TemplateBudgetBytes <= 0 || cfg.TemplateBudgetTotalBytes <= 0 {
		cfg.TemplateBudgetBytes = cmp.Or(max(cfg.TemplateBudgetBytes, 0), per)
		cfg.TemplateBudgetTotalBytes = cmp.Or(max(cfg.TemplateBudgetTotalBytes, 0), total)
	}
	m := &Manager{st: st, log: log, cfg: cfg, nodes: map[string]*node{}, pending: map[string]*pendingNode{}, sandboxes: map[string]*sb{}, templates: map[string][]*procTemplate{}, famOf: map[string]*family{}, procRecs: map[string]*nodeProcesses{},
		uppers: make(chan uint64, 4), squashQ: make(chan string, 64), spareSlots: make(chan struct{}, spareBuilds()), stop: make(chan struct{}), crashAt: crashAtFromEnv(log),
		net: netproxy.New(netproxy.Config{DNS: cfg.NetDNS, Log: log})}
	if err := mountns.OpenHostProc(); err != nil {
		return nil, err
	}
	if !cfg.NoIsolation {
		var err error
		if m.ids, err = hostids.Open(cmp.Or(cfg.IDsDir, hostids.DefaultDir), hostids.Ranges{First: idsFirst, Size: idsPerSandbox, Count: idsSlots}); err != nil {
			return nil, err
		}
	}
	st.Index.SyncFS = st.Syncfs
	nodes, sbs, err := st.Index.Load()
	if err != nil {
		return nil, fmt.Errorf("load index: %w", err)
	}
	for _, n := range nodes {
		m.addNodeLocked(&node{Node: n}) // +checklocksignore: start-up: New has not shared the manager yet
	}
	// Sandboxes whose init still runs are adopted, with their processes (restart.go);
	// the others' cgroups, and anything left in them, go.
	procs := m.loadProcesses()
	m.endLeftCRIU()
	resumeCutCRIUTrees(st.Root)
	adopted := map[string]*sb{}
	byID := map[string]*sb{}
	for _, r := range sbs {
		byID[r.ID] = m.newSB(r)
	}
	cgroups := map[string]bool{}
	for _, id := range cgroup.List() {
		cgroups[id] = true
	}
	// Fast fork families: their holders first, the members after (famrestart.go).
	sbs, held, afresh, keepDirs := m.adoptFamilies(sbs, byID, procs, cgroups)
	for _, r := range sbs {
		s := byID[r.ID]
		why := m.adoptable(r)
		if why == "" {
			why = m.familyAdoptable(s)
		}
		if why == "" && afresh[r.ID] {
			why = "its fork was cut after its processes were being moved"
		}
		if why != "" {
			if r.Init != nil {
				log.Info("sandbox restarts afresh", "id", r.ID, "why", why)
				m.salvageSessions(s)
			}
			continue
		}
		if err := m.adopt(s, procs); err != nil {
			log.Warn("sandbox not adopted: it restarts afresh, files only", "id", r.ID, "err", err)
			m.salvageSessions(s)
			continue
		}
		adopted[r.ID] = s
		log.Info("adopted a running sandbox", "id", r.ID, "init", r.Init.Pid, "sessions", len(s.sessions)) // +checklocksignore: start-up: New has not shared the manager yet
	}
	for _, fam := range m.families {
		if fam.rt != nil {
			fam.rt.DropEarly() // its members' copies are watched now
		}
	}
	// An adopted sandbox's cgroups are named by its record's Cgroup if it has one (its
	// runtime was a spare: spares.go), and those named by its id are then a runtime a
	// swap ended, which a crash may have left: they go here, as a spare's, no record's.
	owned := map[string]bool{}
	for id, s := range adopted {
		owned[cmp.Or(s.rec.Cgroup, id)] = true
	}
	for _, id := range cgroup.List() {
		if owned[id] || held[id] {
			continue
		}
		g := &cgroup.Group{Path: filepath.Join(cgroup.Root, id)}
		if err := g.Destroy(5 * time.Second); err != nil {
			log.Warn("stale sandbox cgroup", "id", id, "err", err)
		}
	}
	// The daemon's memory usage, read by every checkpoint's admission (budget.go).
	if err := cgroup.OpenV1MemoryUsageAll(); err != nil {
		log.Warn("template budget: the daemon's memory cgroup", "err", err)
	}
	for _, id := range cgroup.ListV1() { // limits: after the kill above, they are empty
		if owned[id] || held[id] {
			continue
		}
		if err := cgroup.OpenV1(id).Destroy(5 * time.Second); err != nil {
			log.Warn("stale sandbox cgroup (v1)", "id", id, "err", err)
		}
	}
	for _, r := range st.Sweep(nodes, append(keepDirs, sbs...)) {
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
		m.nextLayer = max(m.nextLayer, n.Layer, n.Squash)
	}
	for _, r := range sbs {
		s := byID[r.ID]
		m.sandboxes[r.ID] = s
		if r.Upper > m.nextLayer {
			m.nextLayer = r.Upper
		}
	}
	m.recordFamilyTemplates()
	m.startImages()
	m.wg.Add(3)
	go m.fillUppers()
	go m.watchDisk()
	go m.squashLoop()
	for _, s := range m.sandboxes {
		if adopted[s.rec.ID] != nil {
			m.fitKernelLimit(s, false)
			m.prepareNext(s) // +checklocksignore: start-up: New has not shared the manager yet
			for node, tps := range m.templates {
				if len(tps) > 0 && tps[0].sandbox == s.rec.ID {
					// Reattach moved their counters: the records are taken again.
					m.recordTemplates(s, node, tps)
				}
			}
			continue
		}
		if err := m.boot(s); err != nil { // +checklocksignore: start-up: New has not shared the manager yet
			s.err = err // +checklocksignore: start-up: New has not shared the manager yet
			log.Error("sandbox did not restart", "id", s.rec.ID, "err", err)
			continue
		}
		s.seq = m.st.Index.Apply(store.Op{PutSandbox: &s.rec}) // +checklocksignore: start-up: New has not shared the manager yet; its new init

	}
	return m, nil
}

// Close lets go of every sandbox, which keeps running for the next daemon (restart.go),
// or with Config.StopSandboxes stops them (their records stay); then it flushes the
// index.
func (m *Manager) Close() error {
	close(m.stop)
	m.mu.Lock()
	var all []*sb
	for _, s := range m.sandboxes {
		all = append(all, s)
	}
	m.mu.Unlock()
	if !m.cfg.StopSandboxes {
		// Background work first (parking and recording templates, keeping sessions), so
		// that what the next daemon adopts is recorded; the warm-ups of restored processes,
		// which run until stopped, are stopped before.
		for _, s := range all {
			s.opMu.Lock()
			if err := m.stopProcWarm(s); err != nil {
				m.log.Warn("close", "sandbox", s.rec.ID, "err", err)
			}
			s.opMu.Unlock()
		}
		m.wg.Wait()
	}
	for _, s := range all {
		s.opMu.Lock()
		if err := m.stopProcWarm(s); err != nil {
			m.log.Warn("close", "sandbox", s.rec.ID, "err", err) // the tracer's close below ends it
		}
		m.discardNext(s)
		m.closeWarm(s)
		m.closeSpares(s) // before closeFamilies: the holder's tracer's close would let their copies run
		m.detachNet(s)
		if !m.cfg.StopSandboxes && s.rt != nil && s.rt.Alive() {
			m.detachSandbox(s)
			s.opMu.Unlock()
			continue
		}
		// The tracer first: a template it holds that dies stays a zombie until the tracer
		// has waited for it, and init's exit waits for every process of its namespace.
		if s.tracer != nil {
			_ = s.tracer.Close() // stopping: its processes end with init below; one it could not put back it killed
			s.tracer = nil
		}
		if s.kns != nil {
			s.kns.Close()
			s.kns = nil
		}
		if s.rt != nil {
			if err := s.rt.Destroy(); err != nil {
				m.log.Warn("close", "sandbox", s.rec.ID, "err", err)
			}
			s.rt = nil
			s.mu.Lock()
			s.memRT = nil
			s.mu.Unlock()
		}
		m.endSessions(s, "daemon stopped")
		s.opMu.Unlock()
	}
	m.closeFamilies()
	// Work queued after answers runs to its end (it finds its sandbox closed), and the
	// index is closed after the last of it.
	m.wg.Wait()
	cgroup.CloseV1MemoryUsageAll()
	return m.st.Close()
}

// ---- sandboxes ----
