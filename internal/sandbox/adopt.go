package sandbox

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"

	"deltabox/internal/cgroup"
	"deltabox/internal/fastpath"
	"deltabox/internal/mountns"
	"deltabox/internal/procfs"
	"deltabox/internal/sbinit"
)

// Adopt takes over a sandbox that a previous daemon started and whose init still runs
// (the daemon stopped, crashed or was killed: sbinit/restart.go): init's PID and start
// time as that daemon recorded them. It reconnects to init, opens the sandbox's cgroups,
// and opens again what Start opened: the sandbox's proc and devpts, its base mount
// namespace, the idmapped view of the store, a namespace builder. It has no current
// state: the caller finds the one the sandbox's processes stand in (AdoptState) or
// mounts one (SetState).
//
// Why init's mounts can still be trusted here, though the sandbox's code has run since
// its start (Start opened them before any): init's root and mount namespace are its
// own, which no process of the sandbox can enter (setns is filtered) or change (mount,
// umount and the new mount API are filtered, and init's root is a read-only tmpfs), and
// each is checked for its filesystem type, as at Start.
//
// warn reports what was lost while no daemon ran (exit events init could not queue);
// err means the sandbox cannot be adopted (its init is gone, or is not the recorded
// process): nothing of it was changed, and the caller destroys it.
//
// family is, for a branch of a fast fork (StartBranch), its family's adopted holder:
// its placed processes are the family init's children (WatchPlaced); nil otherwise.
func Adopt(id, hostname, dir string, iso *Isolation, family *Sandbox, initPid int, initStart uint64) (_ *Sandbox, warn, err error) {
	s := &Sandbox{ID: id, Hostname: hostname, dir: dir, baseNS: -1, proc: -1, devpts: -1, state: None, family: family}
	defer func() {
		if err != nil {
			if s.init != nil {
				s.init.Detach()
			}
			s.release()
		}
	}()
	// Frozen only by a restore from a spare, between its swap and its record (state's
	// spares.go): a daemon that died there left the record naming this runtime, whose
	// processes then run on as they were (that restore did not happen). Thawed before
	// init is asked to take the new daemon, which a frozen init would not answer.
	_ = (&cgroup.Group{Path: filepath.Join(cgroup.Root, id)}).Thaw() // no group: Open fails below
	s.init, err = sbinit.Reconnect(initPid, initStart)
	if s.init == nil {
		return nil, nil, err
	}
	warn, err = err, nil
	s.cg = &cgroup.Group{Path: filepath.Join(cgroup.Root, id)}
	if cg, err := s.cg.Open(); err != nil {
		return nil, nil, fmt.Errorf("the sandbox's cgroup: %w", err)
	} else {
		unix.Close(cg)
	}

	s.lim = cgroup.OpenV1(id)
	s.execLeft.Store(1) // the previous daemon's execs may have left groups
	if err = s.openFromInit(iso, false); err != nil {
		return nil, nil, err
	}
	return s, warn, nil
}

// WatchAdopted is Watch for a process of an adopted sandbox, which may be a placed
// copy in a branch: one whose parent is the family init is watched there (WatchPlaced).
func (s *Sandbox) WatchAdopted(pid int) <-chan unix.WaitStatus {
	if s.family != nil {
		if hosts, err := s.cg.Pids(); err == nil {
			if h, err := fastpath.HostPid(hosts, pid); err == nil {
				if pp, err := procfs.PPid(h); err == nil && pp == s.family.init.Pid() {
					return s.WatchPlaced(pid, h)
				}
			}
		}
	}
	return s.init.Watch(pid)
}

// ErrNotThisState: the namespace AdoptState was given is not on the upper it was told.
var ErrNotThisState = errors.New("not the sandbox's recorded state")

// AdoptState makes nsfd, a state namespace a process of the sandbox stands in (from
// /proc/PID/ns/mnt), the sandbox's current state, after checking that its overlay's
// upper is layer upper of the store (mountns.Inspect); ErrNotThisState otherwise. nsfd
// stays the caller's.
func (s *Sandbox) AdoptState(nsfd int, upper uint64) error {
	root, got, err := mountns.Inspect(nsfd)
	if err != nil {
		return err
	}
	if got != upper {
		unix.Close(root)
		return fmt.Errorf("its overlay's upper is layer %d, the record's %d: %w", got, upper, ErrNotThisState)
	}
	ns, err := unix.FcntlInt(uintptr(nsfd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		unix.Close(root)
		return err
	}
	s.PutState(State{NS: ns, Root: root})
	return nil
}

// Detach lets go of the sandbox and leaves it running for the next daemon (Adopt):
// init stays, with everything it keeps (sessions' terminals); the daemon's fds on the
// sandbox are closed. The states' overlays stay mounted while processes stand in them.
func (s *Sandbox) Detach() {
	if s.init != nil {
		s.init.Detach()
	}
	s.release()
}

// release closes what the daemon holds of the sandbox, and kills nothing. Safe to call
// more than once and on a half-started sandbox.
func (s *Sandbox) release() {
	s.DropState()
	if s.builder != nil && !s.builderClosed {
		// The builder stays set: background work that raced the destruction gets
		// "builder is closed" from it instead of a nil pointer.
		s.builder.Close()
		s.builderClosed = true
	}
	for _, fd := range []*int{&s.baseNS, &s.proc, &s.devpts} {
		if *fd >= 0 {
			unix.Close(*fd)
			*fd = -1
		}
	}
	s.idmap.Close()
	s.idmap = nil
}

// OpenProcNS opens namespace kind ("mnt", "net"...) of the sandbox's process pid (in
// the sandbox), through the proc of its PID namespace (procs.go): an nsfs fd.
func (s *Sandbox) OpenProcNS(pid int, kind string) (int, error) {
	if s.proc < 0 {
		return -1, fmt.Errorf("sandbox %s: no proc of its PID namespace", s.ID)
	}
	return unix.Openat(s.proc, strconv.Itoa(pid)+"/ns/"+kind, unix.O_RDONLY|unix.O_CLOEXEC, 0)
}

// ReadProcFile reads file name of the sandbox's process pid (in the sandbox) through
// the proc of its PID namespace.
func (s *Sandbox) ReadProcFile(pid int, name string) ([]byte, error) {
	if s.proc < 0 {
		return nil, fmt.Errorf("sandbox %s: no proc of its PID namespace", s.ID)
	}
	fd, err := unix.Openat(s.proc, strconv.Itoa(pid)+"/"+name, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(fd), name)
	defer func() { _ = f.Close() }() // read-only, after the read
	return io.ReadAll(f)
}

// InitStartTime is the init's start time, recorded beside its PID for Adopt.
func (s *Sandbox) InitStartTime() (uint64, error) { return s.init.StartTime() }

// Keep, Forget and Kept: what init keeps for the next daemon (sbinit.Client.Keep).
func (s *Sandbox) Keep(key, data string, fd int) error { return s.init.Keep(key, data, fd) }
func (s *Sandbox) Forget(key string) error             { return s.init.Forget(key) }
func (s *Sandbox) Kept() (map[string]sbinit.KeptFile, error) {
	return s.init.Kept()
}

// DropEarly: see sbinit.Client.DropEarly.
func (s *Sandbox) DropEarly() { s.init.DropEarly() }

// OpenInitNS opens namespace kind ("pid", "user", "net", "ipc", "uts", "time",
// "cgroup"...) of the sandbox's init: its PID namespace is the sandbox's.
func (s *Sandbox) OpenInitNS(kind string) (*os.File, error) {
	return os.Open("/proc/" + strconv.Itoa(s.init.Pid()) + "/ns/" + kind)
}

// CommandCgroupNS: see sbinit.Client.CommandCgroupNS.
func (s *Sandbox) CommandCgroupNS() (*os.File, error) { return s.init.CommandCgroupNS() }

// CgroupDirs lists the cgroup directories the sandbox's commands run in: its cgroup2
// group and its v1 limit groups (init itself stays outside the latter).
func (s *Sandbox) CgroupDirs() []string {
	dirs := []string{s.cg.Path}
	for _, d := range s.lim.Dirs() {
		dirs = append(dirs, d)
	}
	return dirs
}
