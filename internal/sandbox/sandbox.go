// Package sandbox runs one sandbox: its init (PID 1 of fresh PID, mount, UTS, IPC and
// network namespaces), its cgroup, the mount namespace of its current state, and the
// commands executed in it. It knows nothing of the snapshot tree: the state manager
// tells it which overlay to stand on (SetState).
//
// Concurrency: SetState, DropState and Destroy must not run concurrently with each
// other (the state manager serialises them per sandbox); Exec may run concurrently
// with anything and takes a reference to the state namespace under mu.
package sandbox

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/cgroup"
	"deltabox/internal/mountns"
	"deltabox/internal/overlay"
	"deltabox/internal/sbinit"
)

// Sandbox is a running sandbox.
type Sandbox struct {
	ID       string
	Hostname string
	// User is who sessions and execs run as unless an exec names another
	// (sbinit.SpawnOptions.User); "": root. Set before the first command.
	User    string
	dir     string
	cg      *cgroup.Group
	lim     *cgroup.V1 // its limits (v1 controllers)
	init    *sbinit.Client
	baseNS  int // nsfs fd of the init's (base) mount namespace
	builder *mountns.Builder
	// builderClosed: Destroy closed the builder (Destroy runs once at a time, by contract).
	builderClosed bool

	mu    sync.Mutex // protects state
	state State      // the current state; NS -1 when none
}

// State is one filesystem state of a sandbox: its mount namespace and an fd on the root
// of its overlay (for path-confined file access with openat2 RESOLVE_IN_ROOT).
type State struct {
	NS, Root int
	held     *heldNS // init's duplicate of NS, if any (InitPath)
}

// heldNS is a state's namespace fd kept by init as fd n, so that a process of the
// sandbox can open it (an injected setns onto the state).
type heldNS struct {
	n    int
	init *sbinit.Client
	// once: copies of a State share this, and a second release could close the fd
	// number init has since given to another state's hold (a move would then open the
	// wrong namespace).
	once sync.Once
}

// None is the absence of a state.
var None = State{NS: -1, Root: -1}

// InitPath is where a process of the sandbox opens the state's namespace (init's
// duplicate, /proc/1/fd/N), or "" when init holds none.
func (st State) InitPath() string {
	if st.held == nil {
		return ""
	}
	return "/proc/1/fd/" + strconv.Itoa(st.held.n)
}

// Close releases the state; once no process is left in it, its overlay is unmounted.
// init's duplicate is released in the background (a round trip to init that no caller
// needs to wait for).
func (st State) Close() {
	if st.NS >= 0 {
		unix.Close(st.NS)
	}
	if st.Root >= 0 {
		unix.Close(st.Root)
	}
	if h := st.held; h != nil {
		h.once.Do(func() { go h.init.Release(h.n) })
	}
}

// Start creates the cgroups and the init, and builds the base namespace. dir is the
// sandbox's private directory in the store (init log, init root mount point). Every
// command the sandbox runs starts inside lim (zero fields: the defaults).
func Start(id, hostname, dir string, lim cgroup.Limits) (_ *Sandbox, err error) {
	s := &Sandbox{ID: id, Hostname: hostname, dir: dir, baseNS: -1, state: None}
	defer func() {
		if err != nil {
			s.Destroy()
		}
	}()
	if s.cg, err = cgroup.Create(id); err != nil {
		return nil, err
	}
	if s.lim, err = cgroup.CreateV1(id, lim); err != nil {
		return nil, err
	}
	tasks, err := s.lim.OpenTasks()
	if err != nil {
		return nil, err
	}
	defer func() {
		for _, f := range tasks {
			f.Close()
		}
	}()
	root := filepath.Join(dir, "initroot")
	if err = os.MkdirAll(root, 0o755); err != nil {
		return nil, err
	}
	log, err := os.OpenFile(filepath.Join(dir, "init.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	defer log.Close()
	cgfd, err := s.cg.Open()
	if err != nil {
		return nil, err
	}
	defer unix.Close(cgfd)
	s.init, err = sbinit.Start(sbinit.StartOptions{
		Config:   sbinit.Config{ID: id, Hostname: hostname, Root: root},
		CgroupFD: cgfd,
		Log:      log,

		CgroupTasks: tasks,
	})
	if err != nil {
		return nil, err
	}
	s.baseNS, err = unix.Open("/proc/"+strconv.Itoa(s.init.Pid())+"/ns/mnt", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open the init's mount namespace: %w", err)
	}
	if s.builder, err = mountns.NewBuilder(s.baseNS, 2); err != nil {
		return nil, err
	}
	return s, nil
}

// InitPid is the init's PID as the daemon sees it.
func (s *Sandbox) InitPid() int {
	if s.init == nil {
		return 0
	}
	return s.init.Pid()
}

// SetState mounts spec and makes it the sandbox's filesystem for commands started
// from now on. The previous state namespace, if any, is released: when no process
// remains in it, its overlay is unmounted.
func (s *Sandbox) SetState(spec overlay.Spec) error {
	_, _, err := s.SetStateTimed(spec)
	return err
}

// SetStateTimed is SetState reporting the time spent making the overlay and the
// namespace.
func (s *Sandbox) SetStateTimed(spec overlay.Spec) (ovl, ns time.Duration, err error) {
	t0 := time.Now()
	mfd, err := overlay.Mount(spec)
	if err != nil {
		return 0, 0, err
	}
	ovl = time.Since(t0)
	nsfd, err := s.builder.Build(mfd)
	ns = time.Since(t0) - ovl
	if err != nil {
		return ovl, ns, err
	}
	s.mu.Lock()
	old := s.state
	s.state = State{NS: nsfd, Root: mfd}
	s.mu.Unlock()
	old.Close()
	return ovl, ns, nil
}

// BuildState mounts spec and builds its namespace without installing it (a state
// prepared ahead of time; PutState installs it). init is given a duplicate of the
// namespace (InitPath), so that processes can be moved onto the state without a round
// trip to init then; a state init could not take is still a state (InitPath "").
func (s *Sandbox) BuildState(spec overlay.Spec) (State, error) {
	mfd, err := overlay.Mount(spec)
	if err != nil {
		return None, err
	}
	nsfd, err := s.builder.Build(mfd)
	if err != nil {
		return None, err
	}
	st := State{NS: nsfd, Root: mfd}
	if n, err := s.init.Hold(nsfd); err == nil {
		st.held = &heldNS{n: n, init: s.init}
	}
	return st, nil
}

// NSPath returns where a process of the sandbox opens st's namespace (an injected setns
// onto it): init's duplicate made by BuildState, else one made now, which release drops
// (a no-op for BuildState's, released with the state).
func (s *Sandbox) NSPath(st State) (path string, release func(), err error) {
	if p := st.InitPath(); p != "" {
		return p, func() {}, nil
	}
	return s.holdNS(st.NS)
}

// StateNSPath is NSPath of the current state.
func (s *Sandbox) StateNSPath() (path string, release func(), err error) {
	s.mu.Lock()
	p := s.state.InitPath()
	s.mu.Unlock()
	if p != "" {
		return p, func() {}, nil
	}
	ns, err := s.StateNS()
	if err != nil {
		return "", nil, err
	}
	defer unix.Close(ns)
	return s.holdNS(ns)
}

func (s *Sandbox) holdNS(ns int) (string, func(), error) {
	n, err := s.init.Hold(ns)
	if err != nil {
		return "", nil, err
	}
	return "/proc/1/fd/" + strconv.Itoa(n), func() { s.init.Release(n) }, nil
}

// TakeState detaches the current state and hands it to the caller, who closes it when
// convenient (closing unmounts; see DropState).
func (s *Sandbox) TakeState() State {
	s.mu.Lock()
	defer s.mu.Unlock()
	old := s.state
	s.state = None
	return old
}

// PutState reinstalls a state taken with TakeState (undoing a failed switch).
func (s *Sandbox) PutState(st State) {
	s.mu.Lock()
	old := s.state
	s.state = st
	s.mu.Unlock()
	old.Close()
}

// OnlyInit reports whether init is the sandbox's only process, read from the cgroup
// (a few microseconds, against a round trip to init for KillAll).
func (s *Sandbox) OnlyInit() bool {
	pids, err := s.cg.Pids()
	return err == nil && len(pids) == 1
}

// DropState releases the current state (its overlay is unmounted once no process is
// left in it). Precondition: KillAll has run, or processes keep it alive.
func (s *Sandbox) DropState() { s.TakeState().Close() }

// StateNS returns a duplicate of the current state namespace fd (the caller closes
// it), so that a concurrent SetState cannot close it under the caller.
func (s *Sandbox) StateNS() (int, error) {
	return s.dupState(func(st State) int { return st.NS })
}

// RootFD returns a duplicate of an fd on the root of the current state's overlay (the
// caller closes it).
func (s *Sandbox) RootFD() (int, error) {
	return s.dupState(func(st State) int { return st.Root })
}

func (s *Sandbox) dupState(which func(State) int) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.state.NS < 0 {
		return -1, fmt.Errorf("sandbox %s has no filesystem mounted (a checkpoint or restore failed half-way; restore a node)", s.ID)
	}
	return unix.FcntlInt(uintptr(which(s.state)), unix.F_DUPFD_CLOEXEC, 0)
}

// KillAll kills every process but init and keep (PIDs in the sandbox), and waits until
// init has reaped them.
func (s *Sandbox) KillAll(keep ...int) (int, error) { return s.init.KillAll(keep...) }

// Reap asks init to reap pids (in the sandbox), processes the caller killed, once they
// have exited; their exits reach Watch before it returns.
func (s *Sandbox) Reap(pids ...int) (int, error) { return s.init.Reap(pids...) }

// Watch returns a channel that receives the wait status of pid (in the sandbox) when
// init reaps it.
func (s *Sandbox) Watch(pid int) <-chan unix.WaitStatus { return s.init.Watch(pid) }

// Unwatch drops a Watch.
func (s *Sandbox) Unwatch(pid int) { s.init.Unwatch(pid) }

// Destroy kills everything and releases every resource; safe to call more than once
// and on a half-started sandbox. Errors are joined, cleanup goes on regardless.
func (s *Sandbox) Destroy() error {
	var errs []error
	if s.init != nil {
		s.init.Kill()
	}
	if s.cg != nil {
		if err := s.cg.Destroy(5 * time.Second); err != nil {
			errs = append(errs, err)
		}
	}
	if s.lim != nil {
		if err := s.lim.Destroy(5 * time.Second); err != nil {
			errs = append(errs, err)
		}
	}
	s.DropState()
	if s.builder != nil && !s.builderClosed {
		// The builder stays set: background work that raced the destruction gets
		// "builder is closed" from it instead of a nil pointer.
		s.builder.Close()
		s.builderClosed = true
	}
	if s.baseNS >= 0 {
		unix.Close(s.baseNS)
		s.baseNS = -1
	}
	if len(errs) > 0 {
		return fmt.Errorf("destroy sandbox %s: %v", s.ID, errs)
	}
	return nil
}

// Alive reports whether the init still runs.
func (s *Sandbox) Alive() bool {
	select {
	case <-s.init.Done():
		return false
	default:
		return true
	}
}

// Dead is closed when the init has exited.
func (s *Sandbox) Dead() <-chan struct{} { return s.init.Done() }

// Pids lists the sandbox's processes (host PIDs), init included.
func (s *Sandbox) Pids() ([]int, error) { return s.cg.Pids() }

// Usage is what the sandbox's commands use of their limits (init excluded).
func (s *Sandbox) Usage() cgroup.Usage { return s.lim.Usage() }

// MemoryUsage is Usage().MemoryBytes, read alone.
func (s *Sandbox) MemoryUsage() int64 { return s.lim.MemoryUsage() }

// OOMKills is Usage().OOMKills, read alone.
func (s *Sandbox) OOMKills() int64 { return s.lim.OOMKills() }
