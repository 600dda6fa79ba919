package sandbox

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/cgroup"
	"deltabox/internal/fastpath"
	"deltabox/internal/sbinit"
)

// StartBranch starts a sandbox whose init is a branch init made by family's init
// (sbinit.Client.Branch): its PID and user namespaces are children of family's, so the
// family's templates can be forked into it at their PIDs (PlaceTarget). Otherwise it is
// a sandbox like one Start makes: its own cgroups and limits, mount, UTS, IPC, network
// and cgroup namespaces, proc, devpts, states. iso is the family's (the branch runs as
// the family's host ids: its user namespace maps them one to one). Its namespace
// builder is held: it prepares nothing ahead until the branch's second state
// (mountns.NewBuilder). nice is the branch init's until sbinit.ResetNice (0: none; a
// background spare's: sbinit/nice.go).
func StartBranch(family *Sandbox, id, hostname, dir string, lim cgroup.Limits, iso *Isolation, pidFloor int, diskQuota int64, nice int) (_ *Sandbox, err error) {
	if family == nil || family.init == nil {
		return nil, fmt.Errorf("branch %s: no family init", id)
	}
	s := &Sandbox{ID: id, Hostname: hostname, dir: dir, baseNS: -1, proc: -1, devpts: -1, state: None, family: family}
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
			_ = f.Close()
		}
	}()
	if err = os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	log, err := os.OpenFile(filepath.Join(dir, "init.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	defer func() { _ = log.Close() }()
	s.init, err = family.init.Branch(sbinit.BranchOptions{
		Config:      sbinit.Config{ID: id, Hostname: hostname, PidFloor: pidFloor, DiskQuota: diskQuota, Nice: nice},
		Log:         log,
		CgroupTasks: tasks,
	})
	if err != nil {
		return nil, err
	}
	// Into the branch's own cgroup2 group before any process of it exists: what its
	// commands and copies start in (the limits are v1: each spawn joins them).
	if err = s.cg.Add(s.init.Pid()); err != nil {
		return nil, fmt.Errorf("the branch init's cgroup: %w", err)
	}
	if err = s.openFromInit(iso, true); err != nil {
		return nil, err
	}
	return s, nil
}

// PlaceTarget opens what fastpath.Revival.ReviveInto needs to place a family template's
// copy into s: the daemon's fds on s's init's namespaces, a cgroup namespace rooted as
// its commands' are, and home, the family's PID namespace (family's init's). close
// releases them.
func (s *Sandbox) PlaceTarget(family *Sandbox) (_ *fastpath.Target, closeFn func(), err error) {
	var fds []int
	release := func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	}
	// Not closeFn: an error return sets it to nil before this runs.
	defer func() {
		if err != nil {
			release()
		}
	}()
	open := func(pid int, kind string) (int, error) {
		fd, err := unix.Open("/proc/"+strconv.Itoa(pid)+"/ns/"+kind, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return -1, fmt.Errorf("open %s namespace of init %d: %w", kind, pid, err)
		}
		fds = append(fds, fd)
		return fd, nil
	}
	tg := &fastpath.Target{}
	pid := s.init.Pid()
	for _, n := range []struct {
		dst  *int
		kind string
	}{{&tg.PID, "pid"}, {&tg.User, "user"}, {&tg.Net, "net"}, {&tg.IPC, "ipc"}, {&tg.UTS, "uts"}} {
		if *n.dst, err = open(pid, n.kind); err != nil {
			return nil, nil, err
		}
	}
	if tg.Home, err = open(family.init.Pid(), "pid"); err != nil {
		return nil, nil, err
	}
	cg, err := s.init.CommandCgroupNS()
	if err != nil {
		return nil, nil, err
	}
	tg.Cgroup, err = unix.FcntlInt(cg.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	_ = cg.Close()
	if err != nil {
		return nil, nil, err
	}
	fds = append(fds, tg.Cgroup)
	tg.Place = func(hostPid int) error {
		if err := s.cg.Add(hostPid); err != nil {
			return err
		}
		return s.lim.Add(hostPid)
	}
	return tg, release, nil
}

// A process placed in a branch by injection (a copy of a family template, and every
// template forked from it: CLONE_PARENT) is a child of the family init, outside the
// branch: its exit is reported on the family's socket, and the family init reaps it,
// not the branch init. Until then its zombie holds its PID in the branch. So a branch's
// Watch of such a process goes to the family (WatchPlaced), and its KillAll and Reap
// return once the processes are gone from the branch's proc, reaped (the family init
// reaps on SIGCHLD; reapWait bounds the wait).

// reapWait bounds the wait for the family init to reap a branch's killed processes.
const reapWait = 10 * time.Second

// WatchPlaced is Watch for a process of s placed by injection, known by its host PID: on
// the family's init for a branch (see above), on s's own otherwise. Precondition: the
// process cannot have exited yet (it is stopped, traced).
func (s *Sandbox) WatchPlaced(pid, hostPid int) <-chan unix.WaitStatus {
	if s.family == nil {
		return s.init.Watch(pid)
	}
	return s.family.init.Watch(fastpath.SandboxPid(hostPid, s.family.init.Pid()))
}

// IsBranch reports whether s is a branch of a fast fork (StartBranch).
func (s *Sandbox) IsBranch() bool { return s.family != nil }

// waitGone waits until s's PID namespace holds init and keep alone.
func (s *Sandbox) waitGone(keep []int) error {
	spare := map[int]bool{1: true}
	for _, p := range keep {
		spare[p] = true
	}
	deadline := time.Now().Add(reapWait)
	for {
		pids, err := s.Procs()
		if err != nil {
			return err
		}
		left := 0
		for _, p := range pids {
			if !spare[p] {
				left++
			}
		}
		if left == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("branch %s: %d processes still in its PID namespace %v after its kill-all (the family init reaps them)", s.ID, left, reapWait)
		}
		time.Sleep(500 * time.Microsecond)
	}
}

// waitReaped waits until each of pids is gone from s's proc (reaped).
func (s *Sandbox) waitReaped(pids []int) error {
	deadline := time.Now().Add(reapWait)
	for _, p := range pids {
		for s.ProcState(p) != 0 {
			if time.Now().After(deadline) {
				return fmt.Errorf("branch %s: process %d not reaped %v after it was killed (the family init reaps it)", s.ID, p, reapWait)
			}
			time.Sleep(500 * time.Microsecond)
		}
	}
	return nil
}

// BecomeHolder makes s, a fast fork's source runtime, the holder of its family: its
// init (the family init) and hostPids (its templates) move into cgroups of their own
// named id, which s's Destroy then ends. The cgroups s had keep what else runs there
// (the source's live processes: KillOwnCgroup) and are the source's next runtime's.
func (s *Sandbox) BecomeHolder(id string, hostPids []int) error {
	cg, err := cgroup.Create(id)
	if err != nil {
		return err
	}
	lim, err := cgroup.CreateV1(id, cgroup.Limits{})
	if err != nil {
		return errors.Join(err, cg.Destroy(time.Second))
	}
	undo := func(err error) error { return errors.Join(err, cg.Destroy(time.Second), lim.Destroy(time.Second)) }
	if err := cg.Add(s.init.Pid()); err != nil {
		return undo(err)
	}
	for _, h := range hostPids {
		if err := cg.Add(h); err != nil {
			return undo(err)
		}
		if err := lim.Add(h); err != nil {
			return undo(err)
		}
	}
	s.ownCG = s.cg
	s.cg, s.lim = cg, lim
	return nil
}

// KillOwnCgroup ends what is left in the cgroup2 group s had before BecomeHolder (the
// source's live processes, children of the family init, which reaps them), waits until
// it is empty and removes it.
func (s *Sandbox) KillOwnCgroup() error {
	if s.ownCG == nil {
		return fmt.Errorf("sandbox %s is no holder", s.ID)
	}
	return s.ownCG.Destroy(reapWait)
}
