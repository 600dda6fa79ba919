package state

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/apitypes"
	"deltabox/internal/cgroup"
	"deltabox/internal/errdefs"
	"deltabox/internal/files"
	"deltabox/internal/mountns"
	"deltabox/internal/sandbox"
	"deltabox/internal/sbinit"
	"deltabox/internal/session"
	"deltabox/internal/store"
)

// CreateOptions configures a new sandbox (the body of POST /v1/sandboxes), and
// SandboxInfo is what the API shows of one. The wire form is defined once, in apitypes.
type (
	CreateOptions = apitypes.CreateOptions
	SandboxInfo   = apitypes.SandboxInfo
)

var idRE = regexp.MustCompile(`^[a-z0-9][a-z0-9_.-]{0,62}$`)

func randomID(prefix string) string {
	b := make([]byte, 4)
	rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

// Create makes a sandbox on image and starts it.
func (m *Manager) Create(ctx context.Context, o CreateOptions) (*SandboxInfo, error) {
	return m.create(ctx, o, nil, "")
}

// create is Create; ident, for a fork branch, is its identity (the file it reads:
// fork.go), and forkOf the node whose processes it will run: its boot keeps their PIDs
// free, and its restores may bring them back (pidsKept).
func (m *Manager) create(ctx context.Context, o CreateOptions, ident *apitypes.ForkIdentity, forkOf string) (*SandboxInfo, error) {
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
	if o.DiskMB < 0 || o.DiskMB > 1<<40 {
		return nil, fmt.Errorf("disk_mb %d: want 1 to 2^40 MiB (0: the default, %d): %w", o.DiskMB, DefaultDiskMB, errdefs.ErrInvalid)
	}
	if o.DiskMB == 0 {
		o.DiskMB = DefaultDiskMB
	}
	switch {
	case o.TemplateBudgetMB < -1 || o.TemplateBudgetMB > 1<<40:
		return nil, fmt.Errorf("template_budget_mb %d: want 1 to 2^40 MiB (0: the default, %d; -1: none, templates count against memory_mb): %w", o.TemplateBudgetMB, m.cfg.TemplateBudgetBytes>>20, errdefs.ErrInvalid)
	case o.TemplateBudgetMB == 0:
		o.TemplateBudgetMB = max(m.cfg.TemplateBudgetBytes>>20, 1)
	}
	if err := checkNetwork(o.Network); err != nil {
		return nil, err
	}
	lim := cgroup.Limits{MemoryBytes: o.MemoryMB << 20, Pids: o.Pids, CPUs: o.CPUs}
	if err := cgroup.CheckLimits(lim); err != nil {
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
	s := m.newSB(store.Sandbox{ID: o.ID, Image: o.Image, Workdir: o.Workdir, Hostname: o.Hostname, User: o.User, Created: time.Now().UTC(), WarmProcesses: o.WarmProcesses, DiskMB: o.DiskMB, TemplateBudgetMB: o.TemplateBudgetMB, Network: o.Network})
	s.rec.ForkOf = forkOf
	if ident != nil {
		ident.Sandbox = o.ID
	}
	s.opMu.Lock() // held until started: nothing else may touch a half-made sandbox
	defer s.opMu.Unlock()
	m.sandboxes[o.ID] = s
	m.mu.Unlock()

	upper, err := m.freshUpper(m.st.ImageRootfs(o.Image))
	if err == nil {
		_, _, err = m.isolation(s, true)
	}
	if err == nil && ident != nil {
		err = m.writeIdentity(s, *ident)
	}
	if err == nil {
		s.rec.Upper = upper
		s.rec.Limits = cgroup.WithDefaults(lim)
		err = m.boot(s)
	}
	var user *sbinit.User
	if err == nil && o.User != "" {
		user, err = m.lookupUser(s)
	}
	if err != nil {
		m.mu.Lock()
		delete(m.sandboxes, o.ID)
		m.mu.Unlock()
		var derr error
		if s.rt != nil {
			derr = s.rt.Destroy()
		}
		derr = errors.Join(derr, store.RemoveAll(m.st.LayerDir(upper)), store.RemoveAll(m.st.SandboxDir(o.ID)))
		m.releaseIDs(o.ID, s.rec.UIDBase)
		return nil, withUndo(err, derr)
	}
	// The directories exist before the record that names them.
	s.seq = m.st.Index.Apply(store.Op{PutSandbox: &s.rec})
	if err := m.ensureWorkdir(ctx, s, user); err != nil {
		m.log.Warn("workdir", "sandbox", o.ID, "err", err)
	}
	return m.info(s), nil
}

// lookupUser resolves s's user in its current state's /etc/passwd and /etc/group, by
// openat2 confined to the state's root (sbinit.LookupUser), so that a bad user is a 400
// at create. Init resolves it again at every spawn: the files may change.
// +checklocks:s.opMu
func (m *Manager) lookupUser(s *sb) (*sbinit.User, error) {
	root, err := s.rt.RootFD()
	if err != nil {
		return nil, err
	}
	defer unix.Close(root)
	u, err := sbinit.LookupUser(root, s.rec.User)
	if err != nil {
		return nil, fmt.Errorf("%v: %w", err, errdefs.ErrInvalid)
	}
	return u, nil
}

// boot starts the runtime of s on its head's stack and its upper.
// +checklocks:s.opMu
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
	s.rec.Limits = cgroup.WithDefaults(s.rec.Limits) // records older than limits
	iso, changed, err := m.isolation(s, true)
	if err != nil {
		return err
	}
	if changed {
		// A sandbox recorded before it had a range (isolation was off) keeps the one it
		// gets now. (Create allocates a new sandbox's before boot: its record, written
		// after boot, has it.)
		s.seq = m.st.Index.Apply(store.Op{PutSandbox: &s.rec})
	}
	// The kernel's limit is memory_mb, no template yet: it grows with them
	// (budget.go: fitKernelLimit).
	rt, err := sandbox.Start(s.rec.ID, s.rec.Hostname, dir, s.rec.Limits, iso, m.pidFloor(s), diskLimit(s.rec.DiskMB))
	if err != nil {
		return err
	}
	rt.User = s.rec.User
	rt.TopLower = m.identityLayer(s.rec.ID)
	s.rec.Cgroup = "" // a spare's runtime's name, if it had one, went with it (spares.go)
	if err := rt.SetState(spec); err != nil {
		return withUndo(err, rt.Destroy())
	}
	kns, err := openKernelNS(rt)
	if err != nil {
		return withUndo(err, rt.Destroy())
	}
	s.rt, s.kns = rt, kns
	if err := m.attachNet(s); err != nil {
		s.rt, s.kns = nil, nil
		kns.Close()
		return withUndo(err, rt.Destroy())
	}
	s.err = nil
	m.recordInit(s) // written with the record by the caller
	s.limitMu.Lock()
	s.kernelLimit = s.rec.Limits.MemoryBytes
	s.limitMu.Unlock()
	s.mu.Lock()
	s.memRT = rt
	s.oomSeen = rt.OOMKills() // 0: a new cgroup
	s.mu.Unlock()
	m.prepareNext(s)
	return nil
}

// ensureWorkdir makes the workdir, as root. With a run-as user, a workdir it made, or
// one the image has empty, is given to that user: it is the user's project directory
// (Docker leaves its WORKDIR to root, and the first thing users then do is chown it).
// A workdir the image has filled keeps its owners.
// +checklocks:s.opMu
func (m *Manager) ensureWorkdir(ctx context.Context, s *sb, u *sbinit.User) error {
	run := func(argv ...string) error {
		r, err := s.rt.Exec(ctx, sandbox.ExecRequest{Argv: argv, Dir: "/", User: "0", Timeout: 10 * time.Second})
		if err != nil {
			return err // +checklocksignore: an inline closure, under its caller's opMu (gVisor #11203)
		}
		if r.ExitCode != 0 {
			return fmt.Errorf("%s %s: %s", argv[0], s.rec.Workdir, r.Stderr) // +checklocksignore: an inline closure, under its caller's opMu (gVisor #11203)
		}
		return nil // +checklocksignore: an inline closure, under its caller's opMu (gVisor #11203)
	}
	give := u != nil && m.workdirEmpty(s)
	if err := run("/bin/mkdir", "-p", s.rec.Workdir); err != nil || !give {
		return err
	}
	return run("/bin/chown", "-h", fmt.Sprintf("%d:%d", u.UID, u.GID), s.rec.Workdir)
}

// workdirEmpty reports whether s's workdir is missing or an empty directory, looked up
// confined to the state (files.EmptyDir: a symlink in the image's path must not lead the
// daemon to a host path).
// +checklocks:s.opMu
func (m *Manager) workdirEmpty(s *sb) bool {
	root, err := s.rt.RootFD()
	if err != nil {
		return false
	}
	defer unix.Close(root)
	return files.EmptyDir(root, s.rec.Workdir)
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

// lockLive locks s.opMu and checks that s can be operated on (checkLive). On success
// the caller holds opMu and must unlock it.
// +checklocksignore: it returns holding opMu on success only, which annotations cannot say
func (m *Manager) lockLive(s *sb) error {
	s.opMu.Lock()
	if err := m.checkLive(s); err != nil {
		s.opMu.Unlock()
		return err
	}
	return nil
}

// checkLive checks that s can be operated on: not removed, its init running.
// +checklocks:s.opMu
func (m *Manager) checkLive(s *sb) error {
	s.mu.Lock()
	removed := s.removed
	s.mu.Unlock()
	if removed {
		return fmt.Errorf("no sandbox %q: it was removed: %w", s.rec.ID, errdefs.ErrNotFound)
	}
	if s.rt == nil {
		return fmt.Errorf("sandbox %s is broken (%v): remove it with deltabox rm: %w", s.rec.ID, s.err, errdefs.ErrConflict)
	}
	if !s.rt.Alive() {
		return fmt.Errorf("sandbox %s is broken: its init died (killed from outside the daemon?); its files are intact: remove it with deltabox rm: %w", s.rec.ID, errdefs.ErrConflict)
	}
	return nil
}

// apiSandbox is what the API shows of a sandbox's index record (store.Sandbox): the two
// are separate types, so that neither the wire nor the disk changes with the other.
func apiSandbox(r store.Sandbox) apitypes.Sandbox {
	a := apitypes.Sandbox{ID: r.ID, Image: r.Image, Head: r.Head, Upper: r.Upper, Workdir: r.Workdir,
		Hostname: r.Hostname, User: r.User, Created: r.Created, Limits: r.Limits, WarmProcesses: r.WarmProcesses,
		UIDBase: r.UIDBase, DiskMB: r.DiskMB, TemplateBudgetMB: r.TemplateBudgetMB, Network: r.Network, ForkOf: r.ForkOf, Cgroup: r.Cgroup}
	if r.Init != nil {
		a.Init = &apitypes.InitRef{Pid: r.Init.Pid, Start: r.Init.Start, Level: r.Init.Level}
	}
	if f := r.Family; f != nil {
		a.Family = &apitypes.FamilyRef{ID: f.ID, Source: f.Source, Made: f.Made, Holder: apitypes.InitRef{Pid: f.Holder.Pid, Start: f.Holder.Start, Level: f.Holder.Level}}
	}
	return a
}

// +checklocks:s.opMu
func (m *Manager) info(s *sb) *SandboxInfo {
	in := &SandboxInfo{Sandbox: apiSandbox(s.rec), Status: "running", Durable: m.st.Index.Durable(s.seq)}
	in.Network = redactNet(in.Network)
	if s.rt != nil && !s.rt.Alive() {
		in.Status, in.Error = "broken", "its init died (killed from outside the daemon?); remove it with deltabox rm"
	} else if s.rt != nil {
		in.InitPid = s.rt.InitPid()
		u := s.rt.Usage()
		u.Network = netUsage(s)
		in.Usage = &u
	} else {
		in.Status = "broken"
		if s.err != nil {
			in.Error = s.err.Error()
		}
	}
	s.mu.Lock()
	in.Stats = s.stats
	in.Stats.ForkPaths = maps.Clone(s.stats.ForkPaths) // the answer's own: forks count on
	s.mu.Unlock()
	in.Stats.SpareBytes, in.Stats.SparePrivateBytes = m.sparesPSS(s)
	in.WarmStates = m.warmCount(s)
	in.Disk = m.diskInfo(s)
	return in
}

// Created is when sandbox id was created and its image: what create fixed, read without
// the sandbox's lock, for a caller on every request's path (E2B's envd and port routes)
// that must not wait behind a checkpoint nor pay for Get's usage readings.
func (m *Manager) Created(id string) (time.Time, string, error) {
	s, err := m.get(id)
	if err != nil {
		return time.Time{}, "", err
	}
	return s.rec.Created, s.rec.Image, nil
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
	perNode, perSandbox, _ := m.templateCosts(nil, id, time.Second)
	in.Templates = perSandbox[id]
	in.TemplateBudget = m.budgetInfo(s, in.Templates, perNode)
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
	m.closeSpares(s)
	if err := m.stopProcWarm(s); err != nil {
		m.log.Warn("remove", "sandbox", id, "err", err) // the tracer's close below ends it
	}
	// The tracer before the sandbox (see Close).
	if s.tracer != nil {
		_ = s.tracer.Close() // its processes end with init below; one it could not put back it killed
		s.tracer = nil
	}
	if s.kns != nil {
		s.kns.Close()
		s.kns = nil
	}
	// Background work of the sandbox (parking, views.go) may run from here on: it must
	// use the tracer it was given, now closed, never make a new one (m.tracer), or what
	// it seizes keeps init from exiting (sbinit.Client.Kill). Step 1 of "remove" is the
	// tests' point to let it run.
	var derr error
	if m.failStep != nil {
		_ = m.failStep("remove", 1) // a point for tests to wait at, not to fail
	}
	m.detachNet(s)
	if s.rt != nil {
		derr = s.rt.Destroy()
		s.rt = nil
	}
	s.mu.Lock()
	s.memRT = nil
	s.mu.Unlock()
	m.endSessions(s, "sandbox removed")
	m.dropSandboxTemplates(id)
	m.forgetKernelState(id)
	m.mu.Lock()
	delete(m.sandboxes, id)
	m.mu.Unlock()
	// A fast fork's source removed before its branches: its directory, the proof of
	// life of the family's uid range, stays until the family ends (family.go).
	keepIDs := m.leaveFamily(id)
	upper, dir := m.st.LayerDir(s.rec.Upper), m.st.SandboxDir(id)
	if keepIDs {
		dir = ""
	}
	// Record first, directories after: a crash in between leaves orphans the sweep removes.
	seq := m.st.Index.Apply(store.Op{DeleteSandbox: id}, store.Op{After: func() {
		if err := errors.Join(store.RemoveAll(upper), removeDir(dir)); err != nil {
			m.log.Warn("remove: what stays, the next start sweeps", "sandbox", id, "err", err)
		}
	}})
	// Wait for the directories to go, so the id can be reused at once.
	if err := m.st.Index.WaitDurable(seq); err != nil && derr == nil {
		derr = err
	}
	if !keepIDs {
		m.releaseIDs(id, s.rec.UIDBase)
	}
	m.diskFreed.Add(1) // the store has room again: a sandbox stopped for it may run
	return derr
}

// ---- exec ----

// Exec runs a command in the sandbox. Execs may run in parallel with each other; a
// checkpoint or restore refuses (409) while one runs, or waits for it (op.go:
// admission), and an exec that arrives while one waits waits behind it.
func (m *Manager) Exec(ctx context.Context, id string, r sandbox.ExecRequest) (*sandbox.ExecResult, error) {
	if len(r.Argv) == 0 {
		return nil, fmt.Errorf("exec needs a command: %w", errdefs.ErrInvalid)
	}
	s, err := m.get(id)
	if err != nil {
		return nil, err
	}
	if err := m.diskRefusal(s); err != nil {
		return nil, err
	}
	c, err := m.enterCall(ctx, s, describeExec(r))
	if err != nil {
		return nil, err
	}
	defer c.end()
	rt := s.rt // +checklocksignore: opMu held since enterCall
	var sess *session.Session
	var restarted bool
	if r.Session != "" {
		var err error
		if sess, restarted, err = m.sessionFor(s, r.Session); err != nil { // +checklocksignore: opMu held since enterCall
			s.opMu.Unlock() // +checklocksignore: opMu held since enterCall
			return nil, err
		}
	}
	if r.Dir == "" {
		r.Dir = s.rec.Workdir
	} else if !filepath.IsAbs(r.Dir) {
		r.Dir = filepath.Join(s.rec.Workdir, r.Dir)
	}
	c.start()
	s.mu.Lock()
	s.stats.Execs++
	s.mu.Unlock()
	// Kills by the memory limit: the count is read once the command is over (one read
	// of the cgroup, tens of µs) and compared with the last one read before it
	// started; a rise is told in the answer (oomNote) of every call that overlapped it.
	limit := s.rec.Limits.MemoryBytes
	s.mu.Lock()
	oom0 := s.oomSeen
	s.mu.Unlock()
	oom := func(res *sandbox.ExecResult) string {
		n := rt.OOMKills()
		s.mu.Lock()
		s.oomSeen = max(s.oomSeen, n)
		s.mu.Unlock()
		if n <= oom0 {
			return ""
		}
		note := m.oomNote(id, limit, n-oom0)
		if res != nil && res.ExitCode < 0 && res.Signal == int(unix.SIGKILL) && !res.TimedOut {
			note = "killed by SIGKILL: " + note // (a timeout's kill is ours)
		}
		return note
	}
	// A warm-up of restored processes lets go of its process before any command runs.
	werr := m.stopProcWarm(s)
	s.opMu.Unlock() // +checklocksignore: opMu held since enterCall
	if werr != nil {
		return nil, werr
	}
	if sess != nil {
		res, err := m.execSession(ctx, sess, r)
		if res != nil {
			res.Session, res.SessionRestarted = r.Session, restarted
			res.OOM = oom(res)
		} else if note := oom(nil); note != "" {
			err = fmt.Errorf("%w: %s", err, note)
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
	res.OOM = oom(res)
	return res, nil
}

// describeExec names an exec for a switch's 409 (op.go: admission.describe).
func describeExec(r sandbox.ExecRequest) string {
	text := strings.Join(r.Argv, " ")
	if i := strings.IndexByte(text, '\n'); i >= 0 {
		text = text[:i] + " ..."
	}
	if len(text) > 60 {
		text = text[:57] + "..."
	}
	if r.Session != "" {
		return fmt.Sprintf("a call to session %s (%q)", r.Session, text)
	}
	return fmt.Sprintf("exec %q", text)
}

// ---- layers ----

// removeDir is store.RemoveAll of dir, nothing for "".
func removeDir(dir string) error {
	if dir == "" {
		return nil
	}
	return store.RemoveAll(dir)
}
