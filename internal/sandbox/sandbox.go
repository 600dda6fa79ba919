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
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
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
	User   string
	dir    string
	cg     *cgroup.Group
	lim    *cgroup.V1 // its limits (v1 controllers)
	init   *sbinit.Client
	baseNS int // nsfs fd of the init's (base) mount namespace
	// proc and devpts: O_PATH fds on the proc of the sandbox's PID namespace and on its
	// devpts, opened at start before any code of the sandbox ran (procs.go, pty.go).
	// (One name per field: checklocks pairs a struct's ast fields with its type's.)
	proc    int
	devpts  int
	builder *mountns.Builder
	// idmap is the sandbox's idmapped view of the store (its user namespace's ids);
	// nil with isolation off.
	idmap *overlay.IDMapped
	// TopLower, when set, is a layer stacked over every state's lowers: a fork branch's
	// identity (state/fork.go), which no restore of the sandbox rolls back. Set before
	// the first state is mounted, never after.
	TopLower string
	// builderClosed: Destroy closed the builder (Destroy runs once at a time, by contract).
	builderClosed bool
	// family, for a branch of a fast fork (StartBranch), is the runtime whose init made
	// its init: the parent of every process placed in the branch by injection (branch.go).
	family *Sandbox
	// ownCG, for a family's holder (BecomeHolder), is the cgroup it had before.
	ownCG *cgroup.Group

	// execLeft counts exec groups left with processes in them (Exec's dropExecGroup);
	// the next Exec tries to remove them.
	execLeft atomic.Int64

	mu sync.Mutex // protects state
	// +checklocks:mu
	state State // the current state; NS -1 when none
}

// State is one filesystem state of a sandbox: its mount namespace and an fd on the root
// of its overlay (for path-confined file access with openat2 RESOLVE_IN_ROOT). No
// process of the sandbox holds either: the fast path hands the namespace to each
// process it moves, for that move (fastpath's handFD).
type State struct {
	NS, Root int
}

// None is the absence of a state.
var None = State{NS: -1, Root: -1}

// Close releases the state; once no process is left in it, its overlay is unmounted.
func (st State) Close() {
	if st.NS >= 0 {
		unix.Close(st.NS)
	}
	if st.Root >= 0 {
		unix.Close(st.Root)
	}
}

// Isolation is what puts a sandbox in a user namespace of its own: the host ids its
// root and users map to, and the store whose layers it sees through an idmapped mount.
type Isolation struct {
	IDs   sbinit.IDRange
	Store string // the store's root directory (the mount that is idmapped)
}

// Start creates the cgroups and the init, and builds the base namespace. dir is the
// sandbox's private directory in the store (init log, init root mount point). Every
// command the sandbox runs starts inside lim (zero fields: the defaults). iso nil
// starts the sandbox without a user namespace (isolation off: for comparisons only).
//
// pidFloor, when not 0, makes every PID of the sandbox (its processes' and its init's
// threads') larger than it: those a restore must give back are not taken meanwhile.
// diskQuota, when not 0, is what no call of its processes may pass at once
// (sbinit.Config.DiskQuota): the longest fallocate(2), the largest file.
func Start(id, hostname, dir string, lim cgroup.Limits, iso *Isolation, pidFloor int, diskQuota int64) (_ *Sandbox, err error) {
	s := &Sandbox{ID: id, Hostname: hostname, dir: dir, baseNS: -1, proc: -1, devpts: -1, state: None}
	defer func() {
		if err != nil {
			err = errors.Join(err, s.Destroy())
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
			_ = f.Close() // cgroup files: nothing written back
		}
	}()
	root := filepath.Join(dir, "initroot")
	if err = os.MkdirAll(root, 0o755); err != nil {
		return nil, err
	}
	rootDir, err := os.OpenFile(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer func() { _ = rootDir.Close() }()
	var ids *sbinit.IDRange
	if iso != nil {
		ids = &iso.IDs
	}
	log, err := os.OpenFile(filepath.Join(dir, "init.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	defer func() { _ = log.Close() }() // init writes through its own copy
	cgfd, err := s.cg.Open()
	if err != nil {
		return nil, err
	}
	defer unix.Close(cgfd)
	s.init, err = sbinit.Start(sbinit.StartOptions{
		Config:   sbinit.Config{ID: id, Hostname: hostname, PidFloor: pidFloor, DiskQuota: diskQuota},
		CgroupFD: cgfd,
		Log:      log,
		RootDir:  rootDir,
		IDs:      ids,

		CgroupTasks: tasks,
	})
	if err != nil {
		return nil, err
	}
	// Before the first spawn: nothing of the sandbox has run yet.
	if err = s.openFromInit(iso, false); err != nil {
		return nil, err
	}
	return s, nil
}

// openFromInit opens what the daemon keeps of a running init's sandbox: its proc and
// devpts (checked for their filesystem types), its base mount namespace, the idmapped
// view of the store (iso nil: none) and a namespace builder. Start calls it before any
// code of the sandbox ran; Adopt on a sandbox that has run (adopt.go says why that is
// sound). held: the builder prepares nothing ahead until its second Build
// (mountns.NewBuilder).
func (s *Sandbox) openFromInit(iso *Isolation, held bool) (err error) {
	pid := s.init.Pid()
	if s.proc, err = openInitMount(pid, "proc", unix.PROC_SUPER_MAGIC); err != nil {
		return err
	}
	if err = checkProcOf(s.proc, pid); err != nil {
		return err
	}
	if s.devpts, err = openInitMount(pid, "dev/pts", unix.DEVPTS_SUPER_MAGIC); err != nil {
		return err
	}
	s.baseNS, err = unix.Open("/proc/"+strconv.Itoa(pid)+"/ns/mnt", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open the init's mount namespace: %w", err)
	}
	var fresh func() (int, error)
	if iso != nil {
		uns, err := unix.Open("/proc/"+strconv.Itoa(pid)+"/ns/user", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("open the init's user namespace: %w", err)
		}
		s.idmap, err = overlay.NewIDMapped(iso.Store, uns, iso.IDs.Base)
		unix.Close(uns)
		if err != nil {
			return err
		}
		// State namespaces must be the user namespace's (see sbinit.Client.NewMountNS).
		fresh = s.init.NewMountNS
	}
	s.builder, err = mountns.NewBuilder(s.baseNS, 2, fresh, held)
	return err
}

// InitPid is the init's PID as the daemon sees it.
func (s *Sandbox) InitPid() int {
	if s.init == nil {
		return 0
	}
	return s.init.Pid()
}

// OpenNetNS opens the sandbox's network namespace (its init's), read-only: the file
// holds the namespace whatever becomes of the PID.
func (s *Sandbox) OpenNetNS() (*os.File, error) {
	return os.Open(fmt.Sprintf("/proc/%d/ns/net", s.InitPid()))
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
	mfd, err := s.mount(spec)
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
// prepared ahead of time; PutState installs it).
func (s *Sandbox) BuildState(spec overlay.Spec) (State, error) {
	mfd, err := s.mount(spec)
	if err != nil {
		return None, err
	}
	nsfd, err := s.builder.Build(mfd)
	if err != nil {
		return None, err
	}
	return State{NS: nsfd, Root: mfd}, nil
}

// mount makes spec's overlay: through the sandbox's idmapped view of the store, as its
// root, when it has a user namespace.
func (s *Sandbox) mount(spec overlay.Spec) (int, error) {
	if s.TopLower != "" {
		spec.Lowers = append([]string{s.TopLower}, spec.Lowers...)
	}
	if s.idmap != nil {
		return s.idmap.Mount(spec)
	}
	return overlay.Mount(spec)
}

// AsRoot runs fn with the daemon's file credentials set to the sandbox's root (fsuid and
// fsgid; capabilities kept), so that what fn creates in the sandbox's files belongs to
// root inside: through the idmapped layers, the daemon's own ids are not mapped and a
// create fails with EOVERFLOW. Without a user namespace it just runs fn.
func (s *Sandbox) AsRoot(fn func() error) error {
	if s.idmap != nil {
		return s.idmap.AsRoot(fn)
	}
	return fn()
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

// OnlyInit reports whether init is the sandbox's only process, read from its PID
// namespace (a few microseconds, against a round trip to init for KillAll).
func (s *Sandbox) OnlyInit() bool {
	pids, err := s.Procs()
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
func (s *Sandbox) KillAll(keep ...int) (int, error) {
	n, err := s.init.KillAll(keep...)
	if err == nil && s.family != nil {
		err = s.waitGone(keep)
	}
	return n, err
}

// Reap asks init to reap pids (in the sandbox), processes the caller killed, once they
// have exited; their exits reach Watch before it returns.
func (s *Sandbox) Reap(pids ...int) (int, error) {
	n, err := s.init.Reap(pids...)
	if err == nil && s.family != nil {
		err = s.waitReaped(pids)
	}
	return n, err
}

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
		if err := s.init.Kill(); err != nil {
			errs = append(errs, err)
		}
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
	s.release()
	if len(errs) > 0 {
		return fmt.Errorf("destroy sandbox %s: %v", s.ID, errs)
	}
	return nil
}

// Freeze stops every process of the sandbox's cgroup, init included, and returns at
// once (cgroup.Group.Freeze): none runs again; Destroy, after, kills them.
func (s *Sandbox) Freeze() error { return s.cg.Freeze() }

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

// Pids lists the processes in the sandbox's cgroup (host PIDs), init included: an
// index from host PIDs for the processes Procs finds, not the list of the sandbox's
// processes (a process can leave the cgroup; procs.go).
func (s *Sandbox) Pids() ([]int, error) { return s.cg.Pids() }

// Usage is what the sandbox's commands use of their limits (init excluded).
func (s *Sandbox) Usage() cgroup.Usage { return s.lim.Usage() }

// MemoryUsage is Usage().MemoryBytes, read alone.
func (s *Sandbox) MemoryUsage() int64 { return s.lim.MemoryUsage() }

// MemoryAnon is the anonymous and shared memory of the sandbox's commands (cgroup.V1.MemoryAnon).
func (s *Sandbox) MemoryAnon() int64 { return s.lim.MemoryAnon() }

// SetMemoryLimit changes the kernel's memory limit of the sandbox (cgroup.V1.SetMemoryLimit).
func (s *Sandbox) SetMemoryLimit(b int64) error { return s.lim.SetMemoryLimit(b) }

// OOMKills is Usage().OOMKills, read alone.
func (s *Sandbox) OOMKills() int64 { return s.lim.OOMKills() }
