package remote

import (
	"encoding/binary"
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The helpers below inject one syscall each (Clone3 and those taking structs or strings
// also use scratch memory, released when they return). A syscall failure is returned as
// an error wrapping the unix.Errno (errors.Is(err, unix.ENOENT) works); a failure to drive
// the tracee is a *TraceeError. None of them restores the registers: Restore or Detach
// does, once, at the end of a sequence. Results are checked by the caller before the
// tracee runs its own code again, which happens only after Detach.

// call runs fn on the tracer's thread with scratch memory released afterwards, and
// turns an injection failure into a TraceeError.
func (t *Tracee) call(name string, fn func() (uintptr, error)) (uintptr, error) {
	var ret uintptr
	err := t.tr.Do(func() error {
		if err := t.usable(); err != nil {
			return err
		}
		t.initScratch()
		m := t.scr.mark()
		defer t.scr.release(m)
		var err error
		ret, err = fn()
		return err
	})
	if _, ok := err.(unix.Errno); ok {
		return ret, fmt.Errorf("remote %s in pid %d: %w", name, t.pid, err)
	}
	return ret, err
}

// sys injects a syscall from inside call: the errno is returned as is, a failure to
// drive the tracee goes through failed.
func (t *Tracee) sys(nr uintptr, args ...uintptr) (uintptr, error) {
	ret, errno, err := t.inject(nr, args, nil)
	if err != nil {
		return 0, t.failed(fmt.Sprintf("inject syscall %d", nr), err)
	}
	if errno != 0 {
		return 0, errno
	}
	return ret, nil
}

// data places b in scratch memory from inside call.
func (t *Tracee) data(b []byte) (uintptr, error) {
	a, err := t.alloc(b)
	if err != nil {
		return 0, t.failed("scratch memory", err)
	}
	return a, nil
}

func (t *Tracee) str(s string) (uintptr, error) { return t.data(append([]byte(s), 0)) }

// bytesOf is the memory of a kernel ABI struct (Itimerval, Winsize, Termios: fixed
// layouts without pointers).
func bytesOf[T any](v *T) []byte { return unsafe.Slice((*byte)(unsafe.Pointer(v)), unsafe.Sizeof(*v)) }

// Getpid returns the tracee's pid in its own PID namespace.
func (t *Tracee) Getpid() (int, error) {
	r, err := t.call("getpid", func() (uintptr, error) { return t.sys(unix.SYS_GETPID) })
	return int(r), err
}

// Open is openat(AT_FDCWD, path, flags, mode) in the tracee; it returns the tracee's fd.
// Opening a FIFO without O_NONBLOCK blocks the Tracer's thread until a peer opens it.
func (t *Tracee) Open(path string, flags int, mode uint32) (int, error) {
	return t.Openat(unix.AT_FDCWD, path, flags, mode)
}

// Openat is openat(dirfd, path, flags, mode) in the tracee.
func (t *Tracee) Openat(dirfd int, path string, flags int, mode uint32) (int, error) {
	r, err := t.call(fmt.Sprintf("openat(%q)", path), func() (uintptr, error) {
		p, err := t.str(path)
		if err != nil {
			return 0, err
		}
		return t.sys(unix.SYS_OPENAT, uintptr(dirfd), p, uintptr(flags), uintptr(mode))
	})
	return int(r), err
}

// Close is close(fd) in the tracee.
func (t *Tracee) Close(fd int) error {
	_, err := t.call(fmt.Sprintf("close(%d)", fd), func() (uintptr, error) { return t.sys(unix.SYS_CLOSE, uintptr(fd)) })
	return err
}

// Lseek is lseek(fd, off, whence) in the tracee; it returns the new offset.
func (t *Tracee) Lseek(fd int, off int64, whence int) (int64, error) {
	r, err := t.call(fmt.Sprintf("lseek(%d)", fd), func() (uintptr, error) {
		return t.sys(unix.SYS_LSEEK, uintptr(fd), uintptr(off), uintptr(whence))
	})
	return int64(r), err
}

// Dup3 is dup3(oldfd, newfd, flags) in the tracee (flags: 0 or O_CLOEXEC).
func (t *Tracee) Dup3(oldfd, newfd, flags int) error {
	_, err := t.call(fmt.Sprintf("dup3(%d, %d)", oldfd, newfd), func() (uintptr, error) {
		return t.sys(unix.SYS_DUP3, uintptr(oldfd), uintptr(newfd), uintptr(flags))
	})
	return err
}

// Chdir is chdir(path) in the tracee.
func (t *Tracee) Chdir(path string) error {
	_, err := t.call(fmt.Sprintf("chdir(%q)", path), func() (uintptr, error) {
		p, err := t.str(path)
		if err != nil {
			return 0, err
		}
		return t.sys(unix.SYS_CHDIR, p)
	})
	return err
}

// Fchdir is fchdir(fd) in the tracee.
func (t *Tracee) Fchdir(fd int) error {
	_, err := t.call(fmt.Sprintf("fchdir(%d)", fd), func() (uintptr, error) { return t.sys(unix.SYS_FCHDIR, uintptr(fd)) })
	return err
}

// Setns is setns(fd, nstype) in the tracee; fd is the tracee's (an nsfs fd or a pidfd).
// It needs CAP_SYS_ADMIN in the namespace's owning user namespace, held by the tracee.
func (t *Tracee) Setns(fd int, nstype int) error {
	_, err := t.call(fmt.Sprintf("setns(%d, %#x)", fd, nstype), func() (uintptr, error) {
		return t.sys(unix.SYS_SETNS, uintptr(fd), uintptr(nstype))
	})
	return err
}

// Setsid is setsid() in the tracee; it returns the new session id (EPERM for a process
// group leader).
func (t *Tracee) Setsid() (int, error) {
	r, err := t.call("setsid", func() (uintptr, error) { return t.sys(unix.SYS_SETSID) })
	return int(r), err
}

// Ioctl is ioctl(fd, req, arg) in the tracee with an integer (or tracee-pointer) argument.
func (t *Tracee) Ioctl(fd int, req uint, arg uintptr) (uintptr, error) {
	return t.call(fmt.Sprintf("ioctl(%d, %#x)", fd, req), func() (uintptr, error) {
		return t.sys(unix.SYS_IOCTL, uintptr(fd), uintptr(req), arg)
	})
}

// ioctlStruct injects ioctl(fd, req, &v) with v in scratch memory and reads v back.
func ioctlStruct[T any](t *Tracee, fd int, req uint, v *T) error {
	_, err := t.call(fmt.Sprintf("ioctl(%d, %#x)", fd, req), func() (uintptr, error) {
		b := bytesOf(v)
		a, err := t.data(b)
		if err != nil {
			return 0, err
		}
		r, err := t.sys(unix.SYS_IOCTL, uintptr(fd), uintptr(req), a)
		if err != nil {
			return r, err
		}
		if err := t.readMem(a, b); err != nil {
			return 0, t.failed("read ioctl result", err)
		}
		return r, nil
	})
	return err
}

// IoctlSetWinsize is ioctl(fd, TIOCSWINSZ, ws) in the tracee.
func (t *Tracee) IoctlSetWinsize(fd int, ws unix.Winsize) error {
	return ioctlStruct(t, fd, unix.TIOCSWINSZ, &ws)
}

// IoctlGetWinsize is ioctl(fd, TIOCGWINSZ) in the tracee.
func (t *Tracee) IoctlGetWinsize(fd int) (unix.Winsize, error) {
	var ws unix.Winsize
	err := ioctlStruct(t, fd, unix.TIOCGWINSZ, &ws)
	return ws, err
}

// IoctlSetTermios is ioctl(fd, req, tio) in the tracee, req one of TCSETS, TCSETSW, TCSETSF.
func (t *Tracee) IoctlSetTermios(fd int, req uint, tio unix.Termios) error {
	return ioctlStruct(t, fd, req, &tio)
}

// IoctlGetTermios is ioctl(fd, TCGETS) in the tracee.
func (t *Tracee) IoctlGetTermios(fd int) (unix.Termios, error) {
	var tio unix.Termios
	err := ioctlStruct(t, fd, unix.TCGETS, &tio)
	return tio, err
}

// Setitimer is setitimer(which, &v, &old) in the tracee; it returns the old value.
// (fork does not copy interval timers: a forked child needs them re-armed this way.)
func (t *Tracee) Setitimer(which int, v unix.Itimerval) (unix.Itimerval, error) {
	var old unix.Itimerval
	_, err := t.call("setitimer", func() (uintptr, error) {
		nv, err := t.data(bytesOf(&v))
		if err != nil {
			return 0, err
		}
		ov, err := t.data(bytesOf(&old))
		if err != nil {
			return 0, err
		}
		if _, err := t.sys(unix.SYS_SETITIMER, uintptr(which), nv, ov); err != nil {
			return 0, err
		}
		if err := t.readMem(ov, bytesOf(&old)); err != nil {
			return 0, t.failed("read old itimerval", err)
		}
		return 0, nil
	})
	return old, err
}

// Getitimer is getitimer(which, &v) in the tracee.
func (t *Tracee) Getitimer(which int) (unix.Itimerval, error) {
	var v unix.Itimerval
	_, err := t.call("getitimer", func() (uintptr, error) {
		a, err := t.data(bytesOf(&v))
		if err != nil {
			return 0, err
		}
		if _, err := t.sys(unix.SYS_GETITIMER, uintptr(which), a); err != nil {
			return 0, err
		}
		if err := t.readMem(a, bytesOf(&v)); err != nil {
			return 0, t.failed("read itimerval", err)
		}
		return 0, nil
	})
	return v, err
}

// Prctl is prctl(option, a2..a5) in the tracee. Pointer arguments must point into the
// tracee (Scratch).
func (t *Tracee) Prctl(option int, a2, a3, a4, a5 uintptr) (uintptr, error) {
	return t.call(fmt.Sprintf("prctl(%d)", option), func() (uintptr, error) {
		return t.sys(unix.SYS_PRCTL, uintptr(option), a2, a3, a4, a5)
	})
}

// Madvise is madvise(addr, length, advice) in the tracee (e.g. MADV_POPULATE_WRITE, which
// process_madvise refuses, to pre-fault a forked child's pages from inside).
func (t *Tracee) Madvise(addr, length uintptr, advice int) error {
	_, err := t.call("madvise", func() (uintptr, error) {
		return t.sys(unix.SYS_MADVISE, addr, length, uintptr(advice))
	})
	return err
}

// Mmap is mmap(addr, length, prot, flags, fd, off) in the tracee; it returns the address.
func (t *Tracee) Mmap(addr, length uintptr, prot, flags, fd int, off int64) (uintptr, error) {
	return t.call("mmap", func() (uintptr, error) {
		return t.sys(unix.SYS_MMAP, addr, length, uintptr(prot), uintptr(flags), uintptr(fd), uintptr(off))
	})
}

// Munmap is munmap(addr, length) in the tracee.
func (t *Tracee) Munmap(addr, length uintptr) error {
	_, err := t.call("munmap", func() (uintptr, error) { return t.sys(unix.SYS_MUNMAP, addr, length) })
	return err
}

// Mprotect is mprotect(addr, length, prot) in the tracee.
func (t *Tracee) Mprotect(addr, length uintptr, prot int) error {
	_, err := t.call("mprotect", func() (uintptr, error) { return t.sys(unix.SYS_MPROTECT, addr, length, uintptr(prot)) })
	return err
}

// Signal is kill(pid, sig) made by the tracee (pid in the tracee's PID namespace). A signal
// the tracee sends to itself is taken and delivered after Detach like any other.
func (t *Tracee) Signal(pid int, sig unix.Signal) error {
	_, err := t.call(fmt.Sprintf("kill(%d, %v)", pid, sig), func() (uintptr, error) {
		return t.sys(unix.SYS_KILL, uintptr(pid), uintptr(sig))
	})
	return err
}

// CloneArgs selects what an injected clone3 does.
type CloneArgs struct {
	// Flags are CLONE_* flags. Allowed: CLONE_PARENT, CLONE_FS, CLONE_FILES, CLONE_SYSVSEM,
	// CLONE_IO, CLONE_NEW{NS,PID,UTS,IPC,NET,USER,CGROUP,TIME}, CLONE_INTO_CGROUP,
	// CLONE_CLEAR_SIGHAND. Flags that share the address space or threads, write to tracee
	// pointers, or untrace the child are refused.
	Flags uint64
	// ExitSignal is sent to the parent when the child exits: SIGCHLD for a fork. It must be
	// 0 with CLONE_PARENT: clone3 refuses a non-zero exit_signal with CLONE_PARENT (EINVAL),
	// the child inherits the caller's.
	ExitSignal unix.Signal
	// SetTID are the child's PIDs, innermost PID namespace first (clone3 set_tid). Each must
	// be free, and the tracee needs CAP_CHECKPOINT_RESTORE in the owner of each namespace.
	SetTID []int
	// Cgroup is a cgroup2 directory fd *in the tracee*, used with CLONE_INTO_CGROUP.
	Cgroup int
}

const cloneAllowed = unix.CLONE_PARENT | unix.CLONE_FS | unix.CLONE_FILES | unix.CLONE_SYSVSEM |
	unix.CLONE_IO | unix.CLONE_NEWNS | unix.CLONE_NEWPID | unix.CLONE_NEWUTS | unix.CLONE_NEWIPC |
	unix.CLONE_NEWNET | unix.CLONE_NEWUSER | unix.CLONE_NEWCGROUP | unix.CLONE_NEWTIME |
	unix.CLONE_INTO_CGROUP | unix.CLONE_CLEAR_SIGHAND

// Fork is Clone3(CloneArgs{ExitSignal: SIGCHLD}): a plain fork whose child is the tracee's.
func (t *Tracee) Fork() (*Tracee, error) { return t.Clone3(CloneArgs{ExitSignal: unix.SIGCHLD}) }

// Clone3 makes the tracee fork with clone3 and returns the child, traced by the same
// Tracer and stopped before running any code, with the registers the parent had when
// seized (so when detached it resumes where the parent was, restarting an interrupted
// syscall the same way). Its memory is the parent's at the fork, scratch data included,
// which the child's Restore/Detach put back like the parent's.
//
// The child is reported by PTRACE_EVENT_FORK (exit_signal SIGCHLD) or PTRACE_EVENT_CLONE
// (any other exit_signal, CLONE_PARENT) and auto-attached: the tracer thread traces it from
// its first instruction. If anything fails after the child exists, the child is killed.
// The parent is left attached, with its registers still modified (Restore/Detach).
//
// With CLONE_PARENT the child is a sibling of the tracee (a child of the tracee's parent,
// which reaps it); CLONE_PARENT is refused for a PID namespace's init. Without it the
// tracee is the parent and must reap it.
func (t *Tracee) Clone3(a CloneArgs) (*Tracee, error) {
	if a.Flags&^cloneAllowed != 0 {
		return nil, fmt.Errorf("remote: clone3 flags %#x not supported", a.Flags&^cloneAllowed)
	}
	if a.Flags&unix.CLONE_PARENT != 0 && a.ExitSignal != 0 {
		return nil, fmt.Errorf("remote: clone3 with CLONE_PARENT needs ExitSignal 0 (the child inherits the caller's): %w", unix.EINVAL)
	}
	var child *Tracee
	_, err := t.call("clone3", func() (uintptr, error) {
		var err error
		child, _, err = t.clone3(a)
		return 0, err
	})
	return child, err
}

// HoldMM makes the tracee clone a holder of its address space: a child made with
// CLONE_VM|CLONE_PARENT (so a sibling, reaped by the tracee's parent) that never runs an
// instruction: it is caught at its first stop, leaves the tracee's session and group
// (an injected setsid), and is left, untraced, in a SIGSTOP group stop. While the
// holder lives, the tracee's memory is not torn down when the tracee exits: its exit
// no longer waits for exit_mmap (zap and free every page: 1.3-2 ms for a 63 MB python
// on these VMs, 35 us/MB), which is what a restore waits for before the tracee's PID is
// free. Killing the holder later does that work then, off the critical
// path. hostPid is the holder's PID in the tracer's namespace, pid the one in the
// tracee's (clone3's return value).
//
// The holder is never detached through Restore (its memory is the tracee's, whose
// scratch the tracee's own Restore puts back) and must never be resumed: only killed.
// Precondition: the tracee's parent reaps its children (the sandbox's init does).
func (t *Tracee) HoldMM() (hostPid, pid int, err error) {
	_, err = t.call("clone3(CLONE_VM)", func() (uintptr, error) {
		c, ret, err := t.clone3(CloneArgs{Flags: unix.CLONE_VM | unix.CLONE_PARENT})
		if err != nil {
			return 0, err
		}
		hostPid, pid = c.pid, int(ret)
		// Out of the tracee's session and process group: a PID stays taken while it
		// names a live process's group or session, and the tracee's must be free once it
		// is reaped. (setsid takes no memory argument: nothing of the shared memory is
		// touched.)
		if _, err := c.syscall(unix.SYS_SETSID); err != nil {
			c.killNow()
			return 0, fmt.Errorf("setsid in the holder: %w", err)
		}
		return 0, c.parkUntouched()
	})
	return hostPid, pid, err
}

// parkUntouched lets a clone3 child go into a SIGSTOP group stop without putting
// anything back (HoldMM's holder: its memory is its parent's). Precondition: on the
// tracer's thread, the child at its first stop.
func (t *Tracee) parkUntouched() error {
	if err := unix.Kill(t.pid, unix.SIGSTOP); err != nil {
		t.killNow()
		return fmt.Errorf("queue SIGSTOP for the holder %d: %w (killed)", t.pid, err)
	}
	if err := ptrace(unix.PTRACE_DETACH, t.pid, 0, 0); err != nil {
		t.killNow()
		return fmt.Errorf("detach the holder %d: %w (killed)", t.pid, err)
	}
	t.state = detached
	delete(t.tr.tracees, t.pid)
	return nil
}

func (t *Tracee) clone3(a CloneArgs) (*Tracee, uintptr, error) {
	var tidAddr uintptr
	if len(a.SetTID) > 0 {
		b := make([]byte, 4*len(a.SetTID))
		for i, p := range a.SetTID {
			binary.LittleEndian.PutUint32(b[4*i:], uint32(int32(p)))
		}
		var err error
		if tidAddr, err = t.data(b); err != nil {
			return nil, 0, err
		}
	}
	// struct clone_args, CLONE_ARGS_SIZE_VER2: flags, pidfd, child_tid, parent_tid,
	// exit_signal, stack, stack_size, tls, set_tid, set_tid_size, cgroup.
	var ca [unix.CLONE_ARGS_SIZE_VER2]byte
	binary.LittleEndian.PutUint64(ca[0:], a.Flags)
	binary.LittleEndian.PutUint64(ca[32:], uint64(a.ExitSignal))
	binary.LittleEndian.PutUint64(ca[64:], uint64(tidAddr))
	binary.LittleEndian.PutUint64(ca[72:], uint64(len(a.SetTID)))
	binary.LittleEndian.PutUint64(ca[80:], uint64(a.Cgroup))
	caAddr, err := t.data(ca[:])
	if err != nil {
		return nil, 0, err
	}
	childPid := 0
	onFork := func(pid int) error {
		if childPid != 0 {
			return fmt.Errorf("second fork event (children %d and %d)", childPid, pid)
		}
		childPid = pid
		return nil
	}
	ret, errno, err := t.inject(unix.SYS_CLONE3, []uintptr{caAddr, unix.CLONE_ARGS_SIZE_VER2}, onFork)
	if err != nil {
		if childPid != 0 {
			(&Tracee{tr: t.tr, pid: childPid, state: attached}).killNow()
		}
		return nil, 0, t.failed("inject clone3", err)
	}
	if errno != 0 {
		return nil, 0, errno
	}
	if childPid == 0 {
		return nil, 0, t.failed("clone3", fmt.Errorf("returned %d without a fork event", ret))
	}
	c := &Tracee{
		tr:         t.tr,
		pid:        childPid,
		state:      attached,
		saved:      t.saved,
		startStack: t.startStack,
		sc:         t.sc,
		codePage:   t.codePage,
		// The child inherits the parent's ptrace options, PTRACE_O_EXITKILL included (the
		// parent is dirty while injecting), and a copy of its memory: scratch data and
		// arena included, so its Restore must undo them as well.
		exitKill: t.exitKill,
		scr:      t.scr.inherit(),
		clonedAs: int(ret),
	}
	t.tr.tracees[childPid] = c
	// An auto-attached child of a seized tracee starts in a PTRACE_EVENT_STOP.
	ws, err := c.wait()
	switch {
	case err != nil:
		c.killNow()
		return nil, 0, &TraceeError{Pid: childPid, Op: "wait for the clone3 child's first stop", Err: err, Killed: true}
	case !ws.Stopped():
		return nil, 0, &TraceeError{Pid: childPid, Op: "clone3 child", Err: fmt.Errorf("%s", describe(ws)), Exited: true}
	case int(ws)>>16 != unix.PTRACE_EVENT_STOP:
		c.killNow()
		return nil, 0, &TraceeError{Pid: childPid, Op: "clone3 child", Err: fmt.Errorf("unexpected first stop (%s)", describe(ws)), Killed: true}
	}
	// Its registers are the parent's at the clone3 (rax 0, rip past our instruction);
	// give it the parent's saved ones.
	if err := unix.PtraceSetRegs(childPid, &c.saved); err != nil {
		c.killNow()
		return nil, 0, &TraceeError{Pid: childPid, Op: "set the clone3 child's registers", Err: err, Killed: true}
	}
	return c, ret, nil
}

// inherit returns the scratch state of a fork child: the same saved bytes (the child's
// copy of the stack holds the parent's scratch data) and the same arena, nothing
// allocated.
func (s *scratch) inherit() scratch {
	c := *s
	c.saved = append([]byte(nil), s.saved...)
	c.cur = c.top
	if c.arena != 0 {
		c.arenaCur = c.arena
	}
	return c
}

// ---- POSIX timers and clocks ----
//
// fork does not copy POSIX timers (timer_create) into the child: a forked child that
// must have them re-creates them with these, after PR_TIMER_CREATE_RESTORE_IDS (Linux
// 6.16+) so that they get their old ids.

// Sigevent is what timer_create reads of a struct sigevent: the value carried by the
// signal (si_value), the signal, how to notify (SIGEV_SIGNAL, SIGEV_NONE, SIGEV_THREAD,
// optionally | SIGEV_THREAD_ID) and, with SIGEV_THREAD_ID, the thread (a tid in the
// tracee's PID namespace).
type Sigevent struct {
	Value  uint64
	Signo  int32
	Notify int32
	Tid    int32
}

// sigev_notify values (asm-generic/siginfo.h; golang.org/x/sys/unix has none).
const (
	SigevSignal   = 0 // SIGEV_SIGNAL: the signal goes to the process
	SigevNone     = 1 // SIGEV_NONE: no notification
	SigevThread   = 2 // SIGEV_THREAD: to the kernel, like SIGEV_SIGNAL (libc uses SIGEV_THREAD_ID)
	SigevThreadID = 4 // SIGEV_THREAD_ID: or'ed in, the signal goes to thread Tid
)

// sigeventSize is sizeof(struct sigevent) on x86-64 (SIGEV_MAX_SIZE).
const sigeventSize = 64

func (e *Sigevent) bytes() []byte {
	b := make([]byte, sigeventSize)
	binary.LittleEndian.PutUint64(b[0:], e.Value)
	binary.LittleEndian.PutUint32(b[8:], uint32(e.Signo))
	binary.LittleEndian.PutUint32(b[12:], uint32(e.Notify))
	binary.LittleEndian.PutUint32(b[16:], uint32(e.Tid))
	return b
}

// TimerCreate is timer_create(clock, &ev, &id) in the tracee; it returns the new timer's
// id. want is written into the id argument first: the kernel reads it as the id to give
// the timer while prctl(PR_TIMER_CREATE_RESTORE_IDS, PR_TIMER_CREATE_RESTORE_IDS_ON) is in
// effect in the tracee (EBUSY if that id is taken), and ignores it otherwise.
func (t *Tracee) TimerCreate(clock int32, ev Sigevent, want int32) (int32, error) {
	r, err := t.call(fmt.Sprintf("timer_create(%d)", clock), func() (uintptr, error) {
		ea, err := t.data(ev.bytes())
		if err != nil {
			return 0, err
		}
		var idb [4]byte
		binary.LittleEndian.PutUint32(idb[:], uint32(want))
		ia, err := t.data(idb[:])
		if err != nil {
			return 0, err
		}
		if _, err := t.sys(unix.SYS_TIMER_CREATE, uintptr(int64(clock)), ea, ia); err != nil {
			return 0, err
		}
		if err := t.readMem(ia, idb[:]); err != nil {
			return 0, t.failed("read the timer id", err)
		}
		return uintptr(binary.LittleEndian.Uint32(idb[:])), nil
	})
	return int32(r), err
}

// TimerSettime is timer_settime(id, flags, &v, &old) in the tracee (flags: 0 or
// TIMER_ABSTIME); it returns the old setting.
func (t *Tracee) TimerSettime(id int32, flags int, v unix.ItimerSpec) (unix.ItimerSpec, error) {
	var old unix.ItimerSpec
	_, err := t.call(fmt.Sprintf("timer_settime(%d)", id), func() (uintptr, error) {
		nv, err := t.data(bytesOf(&v))
		if err != nil {
			return 0, err
		}
		ov, err := t.data(bytesOf(&old))
		if err != nil {
			return 0, err
		}
		if _, err := t.sys(unix.SYS_TIMER_SETTIME, uintptr(id), uintptr(flags), nv, ov); err != nil {
			return 0, err
		}
		if err := t.readMem(ov, bytesOf(&old)); err != nil {
			return 0, t.failed("read old itimerspec", err)
		}
		return 0, nil
	})
	return old, err
}

// TimerGettime is timer_gettime(id, &v) in the tracee: the time to the next expiry (0:
// disarmed) and the interval.
func (t *Tracee) TimerGettime(id int32) (unix.ItimerSpec, error) {
	var v unix.ItimerSpec
	_, err := t.call(fmt.Sprintf("timer_gettime(%d)", id), func() (uintptr, error) {
		a, err := t.data(bytesOf(&v))
		if err != nil {
			return 0, err
		}
		if _, err := t.sys(unix.SYS_TIMER_GETTIME, uintptr(id), a); err != nil {
			return 0, err
		}
		if err := t.readMem(a, bytesOf(&v)); err != nil {
			return 0, t.failed("read itimerspec", err)
		}
		return 0, nil
	})
	return v, err
}

// TimerDelete is timer_delete(id) in the tracee.
func (t *Tracee) TimerDelete(id int32) error {
	_, err := t.call(fmt.Sprintf("timer_delete(%d)", id), func() (uintptr, error) {
		return t.sys(unix.SYS_TIMER_DELETE, uintptr(id))
	})
	return err
}

// ClockGettime is clock_gettime(clock) made by the tracee (as the raw syscall: its own
// CPU-time clocks and its time namespace apply).
func (t *Tracee) ClockGettime(clock int32) (unix.Timespec, error) {
	var ts unix.Timespec
	_, err := t.call(fmt.Sprintf("clock_gettime(%d)", clock), func() (uintptr, error) {
		a, err := t.data(bytesOf(&ts))
		if err != nil {
			return 0, err
		}
		if _, err := t.sys(unix.SYS_CLOCK_GETTIME, uintptr(int64(clock)), a); err != nil {
			return 0, err
		}
		if err := t.readMem(a, bytesOf(&ts)); err != nil {
			return 0, t.failed("read timespec", err)
		}
		return 0, nil
	})
	return ts, err
}

// ---- pending signals ----
//
// fork clears the child's pending signals (both its own queue and its process's); a
// forked child that must have them gets them queued again with QueueSignals, from what
// PendingSignals read in the parent.

// Siginfo is a kernel siginfo_t (128 bytes), kept whole so that a signal can be queued
// again exactly as it was (sender, si_code, value, timer id...).
type Siginfo [128]byte

// Signo is si_signo.
func (s *Siginfo) Signo() int { return int(int32(le32(s[0:]))) }

// Code is si_code (SI_USER 0, SI_QUEUE -1, SI_TIMER -2, SI_TKILL -6, SI_KERNEL 0x80...).
func (s *Siginfo) Code() int { return int(int32(le32(s[8:]))) }

// TimerID is si_timerid of an SI_TIMER signal.
func (s *Siginfo) TimerID() int32 { return int32(le32(s[16:])) }

// PendingSignal is a signal pending in a process: queued for its thread (Shared false:
// tgkill, SIGEV_THREAD_ID timers, faults) or for the whole process (Shared: kill, most
// timers).
type PendingSignal struct {
	Info   Siginfo
	Shared bool
}

// ptracePeeksiginfoShared is PTRACE_PEEKSIGINFO_SHARED: read the process's queue, not
// the thread's.
const ptracePeeksiginfoShared = 1

// PendingSignals reads the signals queued for the tracee without dequeuing them
// (PTRACE_PEEKSIGINFO): its thread's queue, then its process's, each in queue order.
// Signals pending without a queue entry (a standard signal sent when RLIMIT_SIGPENDING
// was exhausted) are not listed: /proc/PID/status SigPnd and ShdPnd show them. Signals
// this package took from the tracee while injecting are not queued either: HeldSignals.
func (t *Tracee) PendingSignals() ([]PendingSignal, error) {
	var out []PendingSignal
	err := t.tr.Do(func() error {
		if err := t.usable(); err != nil {
			return err
		}
		for _, shared := range []bool{false, true} {
			var buf [32]Siginfo
			for off := uint64(0); ; {
				// struct ptrace_peeksiginfo_args { u64 off; u32 flags; s32 nr; }
				var args [16]byte
				binary.LittleEndian.PutUint64(args[0:], off)
				if shared {
					binary.LittleEndian.PutUint32(args[8:], ptracePeeksiginfoShared)
				}
				binary.LittleEndian.PutUint32(args[12:], uint32(len(buf)))
				n, _, e := unix.RawSyscall6(unix.SYS_PTRACE, unix.PTRACE_PEEKSIGINFO, uintptr(t.pid),
					uintptr(unsafe.Pointer(&args)), uintptr(unsafe.Pointer(&buf)), 0, 0)
				if e != 0 {
					return fmt.Errorf("remote: PTRACE_PEEKSIGINFO in pid %d: %w", t.pid, e)
				}
				for i := 0; i < int(n); i++ {
					out = append(out, PendingSignal{Info: buf[i], Shared: shared})
				}
				if int(n) < len(buf) {
					break
				}
				off += uint64(n)
			}
		}
		return nil
	})
	return out, err
}

// HeldSignals returns the signals this package took from the tracee while injecting
// (it dequeued them at a signal-delivery-stop), in arrival order. They are pending for
// the tracee's own code: Restore and Detach queue them again.
func (t *Tracee) HeldSignals() []Siginfo {
	var out []Siginfo
	t.tr.Do(func() error {
		for i := range t.held {
			out = append(out, Siginfo(t.held[i]))
		}
		return nil
	})
	return out
}

// QueueSignals makes sigs pending in the tracee, in order, each with its siginfo as
// given: rt_tgsigqueueinfo(self, self, ...) for a thread's signal, rt_sigqueueinfo(self,
// ...) for a process's (a process may queue any si_code to itself). It runs with every
// signal blocked (PTRACE_SETSIGMASK, the tracee's own mask put back afterwards), so
// that a signal the tracee does not block is not taken again by the injection that
// follows; call it last before Detach. SIGKILL and SIGSTOP are refused.
func (t *Tracee) QueueSignals(sigs []PendingSignal) error {
	if len(sigs) == 0 {
		return nil
	}
	for i := range sigs {
		if s := unix.Signal(sigs[i].Info.Signo()); s == unix.SIGKILL || s == unix.SIGSTOP || s <= 0 || s > 64 {
			return fmt.Errorf("remote: cannot queue signal %d", s)
		}
	}
	_, err := t.call("queue signals", func() (uintptr, error) {
		self, err := t.selfPid()
		if err != nil {
			return 0, t.failed("find the tracee's pid", err)
		}
		var old uint64
		if err := t.sigmask(unix.PTRACE_GETSIGMASK, &old); err != nil {
			return 0, t.failed("get signal mask", err)
		}
		all := uint64(blockAll)
		if err := t.sigmask(unix.PTRACE_SETSIGMASK, &all); err != nil {
			return 0, t.failed("block signals", err)
		}
		var qerr error
		for i := range sigs {
			a, err := t.data(sigs[i].Info[:])
			if err != nil {
				return 0, err
			}
			sig := uintptr(sigs[i].Info.Signo())
			if sigs[i].Shared {
				_, qerr = t.sys(unix.SYS_RT_SIGQUEUEINFO, uintptr(self), sig, a)
			} else {
				_, qerr = t.sys(unix.SYS_RT_TGSIGQUEUEINFO, uintptr(self), uintptr(self), sig, a)
			}
			if qerr != nil {
				if _, ok := qerr.(unix.Errno); !ok {
					return 0, qerr
				}
				qerr = fmt.Errorf("queue %s: %w", unix.SignalName(unix.Signal(sig)), qerr)
				break
			}
		}
		if err := t.sigmask(unix.PTRACE_SETSIGMASK, &old); err != nil {
			return 0, t.failed("restore signal mask", err)
		}
		return 0, qerr
	})
	return err
}
