package state

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/fastpath"
	"deltabox/internal/procfs"
	"deltabox/internal/sandbox"
	"deltabox/internal/sbinit"
	"deltabox/internal/session"
	"deltabox/internal/store"
)

// Sandboxes outlive the daemon. A daemon that stops (unless Config.StopSandboxes), crashes
// or is killed leaves every sandbox running: its init waits for the next daemon
// (sbinit/restart.go), its sessions' terminals are kept by init (keepSessions), and its
// templates stay stopped (a tracer's death leaves each in a group stop with SIGSTOP
// queued: fastpath/reattach.go). The next daemon adopts each sandbox (adopt) whose
// record names its running init (store.Sandbox.Init):
//
//  1. init: reconnected after its PID and start time are checked (sandbox.Adopt);
//  2. templates: taken back with fastpath.Reattach from the records written in the
//     index after each parking and each restore (recordTemplates: index bucket
//     processes, one JSON nodeProcesses per node); one that is gone or ran is dropped,
//     and its node restores files only (409, as for a template killed from inside);
//  3. the current state: the mount namespace the sandbox's processes stand in, if its
//     overlay's upper is the record's (sandbox.Sandbox.AdoptState). Processes anywhere
//     else are killed: a checkpoint or restore cut before its record reached the index
//     (a template not recorded, a process moved to a state the record does not name, a
//     restore's memory holder, a template not recorded yet: strayTemplate). If none
//     stands on the record's upper, every live process is killed and the record's state
//     mounted afresh, as a restart did before. (What the daemon held when it died, the
//     kernel killed: PTRACE_O_EXITKILL while a tracee is changed, internal/remote);
//  4. sessions: each one init kept whose process is among the live ones is adopted on
//     its kept terminal (session.Adopt); the others are reported ended.
//
// A sandbox whose record says a checkpoint was cut between its freeze and its record
// (the record's upper is frozen: the start-up repair gives it back) is not adopted: the
// live processes may stand on a state the repair changes under them. It is started
// afresh, files only, as is one whose init is gone. So a checkpoint or restore that a
// crash cut is undone unless its record reached the index (its answer's durable, or
// POST /v1/sync), and never half done.
//
// Nor is a sandbox whose init was started by a daemon below this one's feature level
// (store.InitRef.Level, sbinit.FeatureLevel): init spawns every command with the code of
// the daemon that started it, so adopted across an upgrade it would go on spawning them
// without the protections that came since (a Landlock domain each, the disk quota's
// limits, a user namespace owned by the uid base). It restarts afresh too.

// sessionKey prefixes the keys under which init keeps sessions' terminals.
const sessionKey = "session/"

// keptSession is the data init keeps with a session's terminal.
type keptSession struct {
	Opts    SessionOptions `json:"opts"`
	Kind    session.Kind   `json:"kind"`
	Argv    []string       `json:"argv"`
	Pid     int            `json:"pid"`
	Started time.Time      `json:"started"`
}

// parseKept reads one thing init keeps (keepSessions): a session's name and
// description; !ok for anything else.
func parseKept(key, data string) (name string, ks keptSession, ok bool) {
	name, ok = strings.CutPrefix(key, sessionKey)
	if ok {
		ok = json.Unmarshal([]byte(data), &ks) == nil
	}
	return name, ks, ok
}

// keptMark is what keepSessions last handed init for one session.
type keptMark struct {
	sess *session.Session
	pid  int
}

// keepSessions makes what s's init keeps agree with s's live sessions: the terminal of
// each (again after a restore gave it a new one), and nothing of a session that ended.
// One round trip to init per change, none when nothing changed. Called after a session
// starts or is killed, and in the background after checkpoints and restores; a crash
// before it ran loses the sessions that changed since (their terminals hang up with the
// daemon's masters).
func (m *Manager) keepSessions(s *sb) {
	s.keepMu.Lock()
	defer s.keepMu.Unlock()
	s.mu.Lock()
	want := map[string]*session.Session{}
	opts := map[string]SessionOptions{}
	for name, sess := range s.sessions {
		if sess.Alive() {
			want[name] = sess
			opts[name] = s.sessionOpts[name]
		}
	}
	s.mu.Unlock()
	for name, sess := range want {
		in := sess.Info()
		if k, ok := s.kept[name]; ok && k.sess == sess && k.pid == in.Pid {
			continue
		}
		data, _ := json.Marshal(keptSession{Opts: opts[name], Kind: in.Kind, Argv: in.Argv, Pid: in.Pid, Started: in.Started})
		if err := sess.Keep(sessionKey+name, string(data)); err != nil {
			m.log.Debug("keep session", "sandbox", s.rec.ID, "session", name, "err", err)
			continue
		}
		s.kept[name] = keptMark{sess, in.Pid}
	}
	s.mu.Lock()
	registered := map[string]*session.Session{}
	for name, sess := range s.sessions {
		registered[name] = sess
	}
	s.mu.Unlock()
	for name, k := range s.kept {
		if _, ok := want[name]; !ok {
			if registered[name] == k.sess {
				// Still the sandbox's, its process dead: a checkpoint or restore may be
				// between ending it and binding its replacement (criutrees.go); its
				// terminal stays kept until the session is replaced or killed.
				continue
			}
			_ = k.sess.Forget(sessionKey + name) // init's copy of the terminal then stays until init ends
			delete(s.kept, name)
		}
	}
}

// nodeProcesses is a node's process record in the index: what adopt needs to take its
// templates back.
type nodeProcesses struct {
	Sandbox   string           `json:"sandbox"`
	UTS       *sbinit.UTS      `json:"uts,omitempty"`
	Templates []templateRecord `json:"templates"`
}

type templateRecord struct {
	Session  string                  `json:"session,omitempty"`
	What     string                  `json:"what"`
	Kind     session.Kind            `json:"kind,omitempty"`
	Argv     []string                `json:"argv,omitempty"`
	Term     session.TermState       `json:"term"`
	Template fastpath.TemplateRecord `json:"template"`
}

// recordTemplates writes node's process record: its templates' records, read now (on
// the tracer's thread, under tmplMu: no revive runs). In the background, after the
// templates are parked and after each restore from them (a revive moves their
// counters). A template that cannot be recorded (gone) is left out.
func (m *Manager) recordTemplates(s *sb, node string, tps []*procTemplate) {
	m.recordTemplatesOf(s.rec.ID, &s.tmplMu, node, tps)
}

// recordTemplatesOf is recordTemplates for templates of owner (a sandbox, or a fast
// fork family's holder: family.id), which tmplMu keeps from being revived. tmplMu is
// held from the first template's read to the index's write: two records of one node
// (a restore's and a spare's, of a family's templates) each read while the other's
// fork ran would otherwise each hold a stale template, and the one written last wins
// (the next daemon then finds that template's counters moved and kills it).
func (m *Manager) recordTemplatesOf(owner string, tmplMu *sync.Mutex, node string, tps []*procTemplate) {
	tmplMu.Lock()
	defer tmplMu.Unlock()
	rec := nodeProcesses{Sandbox: owner}
	for _, t := range tps {
		tr, err := t.tmpl.Record()
		if err != nil {
			m.log.Debug("record template", "sandbox", owner, "node", node, "err", err)
			continue
		}
		rec.Templates = append(rec.Templates, templateRecord{Session: t.session, What: t.what, Kind: t.kind, Argv: t.argv, Term: t.term, Template: tr})
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	n := m.nodes[node]
	if n == nil || n.removing {
		return // RemoveNode deletes the record with the node
	}
	rec.UTS = n.uts
	b, err := json.Marshal(rec)
	if err != nil {
		m.log.Warn("record templates", "node", node, "err", err)
		return
	}
	m.st.Index.Apply(store.Op{PutProcesses: &store.Processes{Node: node, Data: b}})
	if len(rec.Templates) == len(tps) {
		m.procRecs[node] = &rec
		m.queueImage(node) // lock order: m.mu, then img.mu
	}
}

// adoptable reports why s's record cannot be adopted ("" when it can be tried).
func (m *Manager) adoptable(r store.Sandbox) string {
	switch {
	case r.Init == nil:
		return "no running init recorded"
	case r.Init.Level < sbinit.FeatureLevel:
		// Its init spawns commands with the code of the daemon that started it.
		return fmt.Sprintf("init predates %s (its feature level %d, the daemon's %d)", sbinit.FeatureLevelNames, r.Init.Level, sbinit.FeatureLevel)
	case m.st.FrozenHasEntries(r.Upper):
		return "a checkpoint was cut after its freeze, before its record"
	case m.cfg.NoIsolation != (r.UIDBase == 0):
		return "the daemon's isolation setting changed"
	}
	return ""
}

// salvageSessions reads, from the init of a sandbox that is not adopted (it restarts
// afresh), the sessions it kept, so that they are known as ended rather than unknown:
// the next call to one starts it again with its options (session_restarted), as after a
// restore that ended it. Nothing is changed in the sandbox (the caller then ends it).
// +checklocksignore: start-up, called by New before the manager is shared
func (m *Manager) salvageSessions(s *sb) {
	r := s.rec.Init
	if r == nil {
		return
	}
	c, _ := sbinit.Reconnect(r.Pid, r.Start)
	if c == nil {
		return
	}
	defer c.Detach()
	kept, err := c.Kept()
	if err != nil {
		return
	}
	for key, k := range kept {
		unix.Close(k.FD)
		name, ks, ok := parseKept(key, k.Data)
		if !ok {
			continue
		}
		s.sessionOpts[name] = ks.Opts
		s.ended[name] = "ended: the daemon restarted and could not keep the sandbox's processes (files only)"
	}
}

// adopt takes over s's running sandbox (see the top of this file). On error nothing of
// it is kept and the caller destroys it and boots it afresh. procs are the index's
// process records, by node.
// +checklocksignore: start-up, called by New before the manager is shared
func (m *Manager) adopt(s *sb, procs map[string]nodeProcesses) error {
	r := s.rec
	// Its init maps the recorded range: that range or none.
	iso, _, err := m.isolation(s, false)
	if err != nil {
		return err
	}
	var famRT *sandbox.Sandbox // a fork family's member's init is a branch init of the holder
	if fam := m.famOf[r.ID]; fam != nil {
		famRT = fam.rt
	}
	rt, warn, err := sandbox.Adopt(cmp.Or(r.Cgroup, r.ID), r.Hostname, m.st.SandboxDir(r.ID), iso, famRT, r.Init.Pid, r.Init.Start)
	if err != nil {
		return err
	}
	rt.TopLower = m.identityLayer(r.ID)
	if warn != nil {
		m.log.Warn("adopt sandbox", "id", r.ID, "warning", warn)
	}
	rt.User = r.User
	fail := func(err error) error {
		if s.tracer != nil {
			err = withUndo(err, s.tracer.Close())
			s.tracer = nil
		}
		m.dropSandboxTemplates(r.ID)
		rt.Detach()
		return err
	}
	// 2. Templates.
	keep := map[int]bool{1: true}
	nodes := make([]string, 0, len(procs))
	for n := range procs {
		nodes = append(nodes, n)
	}
	sort.Strings(nodes)
	for _, node := range nodes {
		np := procs[node]
		if np.Sandbox != r.ID {
			continue
		}
		m.mu.Lock()
		nd := m.nodes[node]
		taken := len(m.templates[node]) > 0 // a fork family's holder's (famrestart.go)
		m.mu.Unlock()
		if nd == nil || taken {
			continue
		}
		var tps []*procTemplate
		for _, tr := range np.Templates {
			t, err := fastpath.Reattach(m.tracer(s), tr.Template)
			if err != nil {
				m.log.Warn("template not taken back: its node restores files only", "sandbox", r.ID, "node", node, "process", tr.What, "err", err)
				continue
			}
			keep[t.SelfPid] = true
			tps = append(tps, &procTemplate{session: tr.Session, what: tr.What, kind: tr.Kind, argv: tr.Argv, sandbox: r.ID, tmpl: t, term: tr.Term, parked: true})
		}
		if len(tps) > 0 {
			m.mu.Lock()
			m.templates[node] = tps
			nd.uts = np.UTS
			m.mu.Unlock()
		}
	}
	// 3. The current state: the namespace of the live processes, if on the record's upper.
	live, err := m.adoptState(s, rt, keep)
	if err != nil {
		return fail(err)
	}
	var spare []int
	for p := range keep {
		if p != 1 {
			spare = append(spare, p)
		}
	}
	for p := range live {
		spare = append(spare, p)
	}
	if n, err := rt.KillAll(spare...); err != nil {
		return fail(fmt.Errorf("end what no record names: %w", err))
	} else if n > 0 {
		m.log.Info("adopt sandbox: ended processes no record names", "id", r.ID, "count", n)
	}
	if len(live) == 0 {
		spec, err := m.spec(r.Image, r.Head, r.Upper)
		if err == nil {
			err = m.st.ResetWork(r.Upper) // no overlay is left on it: its processes are gone
		}
		if err == nil {
			err = rt.SetState(spec)
		}
		if err != nil {
			return fail(fmt.Errorf("mount the recorded state: %w", err))
		}
	}
	// 4. Sessions.
	kept, err := rt.Kept()
	if err != nil {
		return fail(fmt.Errorf("the sessions init kept: %w", err))
	}
	s.rt = rt
	for key, k := range kept {
		name, ks, ok := parseKept(key, k.Data)
		if ok && live[ks.Pid] && !session.OnTerminal(rt, ks.Pid, k.FD) {
			// A restore gave the session a new terminal and the daemon died before init
			// kept it: this master is the old one, whose process the restore ended.
			ok = false
		}
		if !ok || !live[ks.Pid] {
			unix.Close(k.FD)
			_ = rt.Forget(key) // init's copy of the terminal then stays until init ends
			if ok {
				s.sessionOpts[name] = ks.Opts
				s.ended[name] = "its process ended while the daemon was down"
			}
			continue
		}
		sess, err := session.Adopt(rt, name, ks.Kind, ks.Argv, ks.Pid, ks.Started, os.NewFile(uintptr(k.FD), "ptmx"), rt.WatchAdopted(ks.Pid))
		if err != nil {
			m.log.Warn("adopt session", "sandbox", r.ID, "session", name, "err", err)
			continue
		}
		s.sessions[name], s.sessionOpts[name] = sess, ks.Opts
		s.kept[name] = keptMark{sess, ks.Pid}
	}
	rt.DropEarly()
	kns, err := openKernelNS(rt)
	if err != nil {
		s.rt = nil
		m.endSessions(s, "the daemon could not adopt the sandbox")
		return fail(err)
	}
	s.kns = kns
	if err := unlockLeftNet(rt); err != nil {
		m.log.Warn("adopt sandbox: the locks of its TCP connections", "id", r.ID, "err", err) // its connections stay dropped
	}
	if err := m.attachNet(s); err != nil {
		m.log.Warn("adopt sandbox: its network", "id", r.ID, "err", err) // it runs, without network
	}
	s.err = nil
	s.limitMu.Lock()
	s.kernelLimit = -1 // unknown: the next fitKernelLimit writes it (New calls it)
	s.limitMu.Unlock()
	s.mu.Lock()
	s.memRT = rt
	s.oomSeen = rt.OOMKills()
	s.mu.Unlock()
	return nil
}

// adoptState finds the state namespace the sandbox's live processes (every process but
// init and keep) stand in whose overlay's upper is the record's, and makes it rt's
// current state. It returns the processes in it (sandbox PIDs); none when no process
// stands on the record's upper (the caller mounts the state).
func (m *Manager) adoptState(s *sb, rt *sandbox.Sandbox, keep map[int]bool) (map[int]bool, error) {
	pids, err := rt.Procs()
	if err != nil {
		return nil, err
	}
	byNS := map[uint64][]int{}
	fds := map[uint64]int{}
	defer func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	}()
	for _, p := range pids {
		if keep[p] {
			continue
		}
		if strayTemplate(rt, p) {
			continue // not live: KillAll ends it
		}
		fd, err := rt.OpenProcNS(p, "mnt")
		if err != nil {
			continue // gone
		}
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil {
			unix.Close(fd)
			continue
		}
		if _, ok := fds[st.Ino]; ok {
			unix.Close(fd)
		} else {
			fds[st.Ino] = fd
		}
		byNS[st.Ino] = append(byNS[st.Ino], p)
	}
	for ino, fd := range fds {
		err := rt.AdoptState(fd, s.rec.Upper)
		if errors.Is(err, sandbox.ErrNotThisState) {
			m.log.Info("adopt sandbox: processes on another state are ended", "id", s.rec.ID, "pids", fmt.Sprint(byNS[ino]), "why", err)
			continue
		}
		if err != nil {
			m.log.Info("adopt sandbox: a namespace not inspected", "id", s.rec.ID, "pids", fmt.Sprint(byNS[ino]), "err", err)
			continue
		}
		live := map[int]bool{}
		for _, p := range byNS[ino] {
			live[p] = true
		}
		return live, nil
	}
	return map[int]bool{}, nil
}

// strayTemplate reports whether the sandbox's process pid, which no record names, looks
// like a template: stopped, a child of init, leading a session of its own without a
// terminal, as a fork of the fast path is left (fastpath.Held.Fork). A daemon that died
// during a checkpoint leaves such templates, not yet recorded. The live processes it
// held then are gone: a tracee the daemon has changed has PTRACE_O_EXITKILL set
// (internal/remote), so the kernel killed it with the daemon rather than let it run
// half-modified. Taken for a live process, a template would run a second copy of its
// process at the next SIGCONT, so adopt ends it. (A job the user stopped has its
// session's terminal, or a parent other than init; a process outside the sessions that
// someone stopped after it left its terminal and its parent would be ended too.)
func strayTemplate(rt *sandbox.Sandbox, pid int) bool {
	b, err := rt.ReadProcFile(pid, "stat")
	if err != nil {
		return false
	}
	f := procfs.StatFields(b) // state, ppid, pgrp, session, tty_nr...
	return len(f) > 4 && (string(f[0]) == "T" || string(f[0]) == "t") && string(f[1]) == "1" &&
		string(f[3]) == strconv.Itoa(pid) && string(f[4]) == "0"
}

// loadProcesses reads the index's process records; those of nodes the index no longer
// has are deleted.
// +checklocksignore: start-up, called by New before the manager is shared
func (m *Manager) loadProcesses() map[string]nodeProcesses {
	raw, err := m.st.Index.LoadProcesses()
	if err != nil {
		m.log.Warn("process records not read: templates are not taken back", "err", err)
		return nil
	}
	out := map[string]nodeProcesses{}
	for node, b := range raw {
		var np nodeProcesses
		if _, ok := m.nodes[node]; !ok || json.Unmarshal(b, &np) != nil {
			m.st.Index.Apply(store.Op{PutProcesses: &store.Processes{Node: node}})
			continue
		}
		out[node] = np
		m.procRecs[node] = &np
	}
	return out
}

// recordInit records s's running init for the next daemon. Precondition: s.opMu held
// or s not yet shared.
// +checklocks:s.opMu
func (m *Manager) recordInit(s *sb) {
	start, err := s.rt.InitStartTime()
	if err != nil {
		m.log.Warn("record init", "sandbox", s.rec.ID, "err", err)
		return
	}
	m.mu.Lock()
	s.rec.Init = &store.InitRef{Pid: s.rt.InitPid(), Start: start, Level: sbinit.FeatureLevel}
	m.mu.Unlock()
}

// detachSandbox lets go of s and leaves it running for the next daemon: its sessions'
// terminals with init, its templates in a group stop (the tracer detaches them, with
// SIGSTOP queued), its processes where they are. Precondition: s.opMu held, no
// background work of s left to start (Close).
// +checklocks:s.opMu
func (m *Manager) detachSandbox(s *sb) {
	m.keepSessions(s)
	if s.tracer != nil {
		if err := s.tracer.Close(); err != nil { // a template it could not put back it killed
			m.log.Warn("detach sandbox", "sandbox", s.rec.ID, "err", err)
		}
		s.tracer = nil
	}
	if s.kns != nil {
		s.kns.Close()
		s.kns = nil
	}
	s.mu.Lock()
	for _, sess := range s.sessions {
		sess.Release() // closes the daemon's master; init keeps its own
	}
	s.mu.Unlock()
	s.rt.Detach()
	s.rt = nil
	s.mu.Lock()
	s.memRT = nil
	s.mu.Unlock()
}
