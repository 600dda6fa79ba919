package remote

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"deltabox/internal/procfs"
)

// Kernel-internal errnos a syscall interrupted by a signal (or by PTRACE_INTERRUPT)
// leaves in rax; user space never sees them when the kernel's restart logic runs.
const (
	errRestartSys     = 512 // ERESTARTSYS
	errRestartNoIntr  = 513 // ERESTARTNOINTR
	errRestartNoHand  = 514 // ERESTARTNOHAND
	errRestartBlock   = 516 // ERESTART_RESTARTBLOCK
	maxInjectRestarts = 100
	maxStepStops      = 10000 // signals and group-stop reports while stepping one instruction
)

const (
	// baseOptions are set at seize and kept: an injected clone3 reports its child
	// (PTRACE_EVENT_FORK when exit_signal is SIGCHLD, PTRACE_EVENT_CLONE otherwise), and the
	// child is traced by the same thread from its first instruction.
	//
	// PTRACE_O_SUSPEND_SECCOMP: the injected calls are the daemon's, not the tracee's
	// code, and a sandbox's filter refuses setns and gives clone3 ENOSYS
	// (internal/sbinit/seccomp.go). The kernel copies the option to a child that a
	// traced clone3 makes (ptrace_init_task), so the child's own injected calls are
	// exempt too, and it ends with the detach: the tracee runs none of its own code
	// while attached (the package doc). Setting it needs CAP_SYS_ADMIN in the initial
	// user namespace and no filter on the tracer (the daemon), and a kernel with
	// CONFIG_CHECKPOINT_RESTORE.
	baseOptions = unix.PTRACE_O_TRACEFORK | unix.PTRACE_O_TRACECLONE | unix.PTRACE_O_SUSPEND_SECCOMP
	// While a tracee differs from its saved state (registers, scratch memory, held
	// signals), PTRACE_O_EXITKILL is added: if the tracer thread dies then (daemon crash),
	// the kernel kills the tracee rather than letting it run half-modified. A clean tracee
	// is merely detached by the kernel and goes on as if never traced.
	dirtyOptions = baseOptions | unix.PTRACE_O_EXITKILL

	userCS64 = 0x33 // __USER_CS: the tracee executes 64-bit code

	redZone         = 128      // x86-64 SysV ABI: leaf functions use 128 bytes below rsp
	maxStackScratch = 64 << 10 // at most this much stack below the red zone is used
	arenaMin        = 64 << 10 // size of the mmap fallback arena
	// mainStackSpan: an rsp less than this far below the process's start_stack is on its
	// main stack. The kernel keeps mmap_base at least 128 MiB below the stack top, so no
	// other mapping (short of MAP_FIXED) lives in this span.
	mainStackSpan = 100 << 20
)

type traceeState int

const (
	attached traceeState = iota
	detached
	gone
)

// Tracee is a process seized by a Tracer. It stays in a ptrace-stop (it runs none of its
// own code) from Seize until Detach, DetachStopped or Kill; between them it only executes
// the syscalls injected into it, one instruction at a time.
//
// All methods may be called from any goroutine: each runs on the Tracer's thread (see
// Tracer.Do). No method may be called after Detach, DetachStopped or Kill returned.
type Tracee struct {
	tr  *Tracer
	pid int // in the tracer's PID namespace

	// Immutable after Seize (or Clone3).
	saved      unix.PtraceRegs // the registers to restore
	wasStopped bool            // a group stop was in effect when seized
	startStack uintptr         // mm->start_stack
	clonedAs   int             // a Clone3 child: its pid as the tracee that forked it sees it

	// Touched only on the tracer's thread.
	state    traceeState
	sc       uintptr // address of a 0f 05 (syscall) instruction, 0 until found
	codePage uintptr // where a Batch's code is written, 0 until needed (batchPage)
	nsPid    int     // the tracee's pid in its own PID namespace, 0 until needed
	exitKill bool    // PTRACE_O_EXITKILL is set
	regsDirt bool    // registers differ from saved
	held     []siginfo
	scr      scratch
}

// Pid returns the tracee's pid in the tracer's PID namespace.
func (t *Tracee) Pid() int { return t.pid }

// ClonedAs returns, for a Clone3 child, its pid as the tracee that forked it sees it
// (clone3's return value there: no /proc read), and 0 for a seized process.
func (t *Tracee) ClonedAs() int { return t.clonedAs }

// Regs returns the registers the tracee had when seized (for a Clone3 child: its
// parent's), which Restore and Detach put back.
func (t *Tracee) Regs() unix.PtraceRegs { return t.saved }

// WasStopped reports whether a group stop (SIGSTOP, SIGTSTP...) was in effect when the
// tracee was seized. Such a tracee is not continued by this package: it executes injected
// syscalls while the group stop stays in effect, and re-enters the stop when detached.
func (t *Tracee) WasStopped() bool { return t.wasStopped }

// InSyscall reports whether the tracee was seized inside a syscall (orig_rax != -1); if
// it was interrupted in a blocking one, rax holds -ERESTART* and Detach restarts it.
func (t *Tracee) InSyscall() bool { return int64(t.saved.Orig_rax) != -1 }

// Seize attaches to pid with PTRACE_SEIZE, stops it with PTRACE_INTERRUPT and saves its
// registers. The process must be single-threaded, 64-bit, and not traced by anyone else;
// the caller needs CAP_SYS_PTRACE over it (or to be its parent under Yama scope 1).
//
// A process in a group stop is seized without being continued (no SIGCONT): it stays
// stopped at the signal level, so if the daemon dies while it is clean the kernel's
// implicit detach leaves it stopped. WasStopped reports it.
//
// PTRACE_O_EXITKILL is not set while the tracee is clean: a daemon crash must not kill
// sandboxes' processes. It is set only while registers, memory or signals are modified
// (see the package doc).
//
// Seize does not block on a process in uninterruptible sleep: it waits up to 10 ms for
// it to leave that state and then returns ErrUninterruptible. A process that enters one
// between that check and the interrupt delays Seize until it leaves it.
func (tr *Tracer) Seize(pid int) (*Tracee, error) {
	var t *Tracee
	err := tr.Do(func() error {
		var err error
		t, err = tr.seize(pid)
		return err
	})
	return t, err
}

func (tr *Tracer) seize(pid int) (*Tracee, error) {
	if _, ok := tr.tracees[pid]; ok {
		return nil, fmt.Errorf("remote: seize %d: already traced by this Tracer", pid)
	}
	st, err := readStat(pid)
	for i := 0; err == nil && st.state == 'D' && i < 20; i++ {
		time.Sleep(500 * time.Microsecond)
		st, err = readStat(pid)
	}
	// A thread whose join has returned may still be ending: python's join returns once
	// the thread's state is released, before the OS thread exits, and the kernel counts
	// it until then. Wait a little for it (20 ms at most) rather than refuse the process.
	for i := 0; err == nil && st.threads > 1 && i < 40; i++ {
		time.Sleep(500 * time.Microsecond)
		st, err = readStat(pid)
	}
	switch {
	case err != nil:
		return nil, fmt.Errorf("remote: seize %d: %w", pid, err)
	case st.state == 'D':
		return nil, fmt.Errorf("remote: seize %d: %w", pid, ErrUninterruptible)
	case st.state == 'Z' || st.state == 'X':
		return nil, fmt.Errorf("remote: seize %d: process has exited", pid)
	case st.threads != 1:
		return nil, fmt.Errorf("remote: seize %d: %w (%d threads)", pid, ErrMultiThreaded, st.threads)
	}
	if err := ptrace(unix.PTRACE_SEIZE, pid, 0, baseOptions); err != nil {
		return nil, fmt.Errorf("remote: PTRACE_SEIZE %d: %w (traced by someone else, or not permitted: PTRACE_O_SUSPEND_SECCOMP needs the daemon to run as root with CAP_SYS_ADMIN and no seccomp filter of its own, e.g. not under systemd SystemCallFilter= or a container runtime's profile)", pid, err)
	}
	t := &Tracee{tr: tr, pid: pid, state: attached}
	if err := ptrace(unix.PTRACE_INTERRUPT, pid, 0, 0); err != nil {
		return nil, t.seizeFailed("PTRACE_INTERRUPT", err)
	}
	ws, err := t.wait()
	if err != nil {
		return nil, t.seizeFailed("wait for the interrupt stop", err)
	}
	if !ws.Stopped() {
		return nil, &TraceeError{Pid: pid, Op: "seize", Err: fmt.Errorf("exited (%s)", describe(ws)), Exited: true}
	}
	if ev := int(ws) >> 16; ev != unix.PTRACE_EVENT_STOP {
		// Job-control traps are taken before any signal is dequeued, so the first stop
		// after PTRACE_INTERRUPT is the interrupt's. Anything else is a kernel we do not
		// understand: let go, handing a signal back if it was one.
		sig := 0
		if ev == 0 {
			sig = int(ws.StopSignal())
		}
		_ = ptrace(unix.PTRACE_DETACH, pid, 0, uintptr(sig))
		return nil, fmt.Errorf("remote: seize %d: unexpected first stop (%s)", pid, describe(ws))
	}
	// In a group stop the interrupt trap carries the stop signal, otherwise SIGTRAP.
	t.wasStopped = ws.StopSignal() != unix.SIGTRAP
	if err := unix.PtraceGetRegs(pid, &t.saved); err != nil {
		return nil, t.seizeFailed("get registers", err)
	}
	if t.saved.Cs != userCS64 {
		_ = ptrace(unix.PTRACE_DETACH, pid, 0, 0)
		return nil, fmt.Errorf("remote: seize %d: %w", pid, ErrNot64Bit)
	}
	// The process cannot create threads while stopped: this check is the one that counts.
	if st, err = readStat(pid); err != nil || st.threads != 1 {
		_ = ptrace(unix.PTRACE_DETACH, pid, 0, 0)
		if err != nil {
			return nil, fmt.Errorf("remote: seize %d: %w", pid, err)
		}
		return nil, fmt.Errorf("remote: seize %d: %w (%d threads)", pid, ErrMultiThreaded, st.threads)
	}
	t.startStack = st.startStack
	tr.tracees[pid] = t
	return t, nil
}

// seizeFailed lets go of a tracee that was seized but whose registers were never touched.
func (t *Tracee) seizeFailed(op string, err error) error {
	if t.state == gone {
		return &TraceeError{Pid: t.pid, Op: "seize: " + op, Err: err, Exited: true}
	}
	if derr := ptrace(unix.PTRACE_DETACH, t.pid, 0, 0); derr != nil && t.waitGone() {
		return &TraceeError{Pid: t.pid, Op: "seize: " + op, Err: err, Exited: true}
	}
	t.state = detached
	return fmt.Errorf("remote: seize %d: %s: %w", t.pid, op, err)
}

// usable reports whether methods may drive t.
func (t *Tracee) usable() error {
	if t.state != attached {
		return fmt.Errorf("remote: pid %d: %w", t.pid, ErrNotAttached)
	}
	return nil
}

// ---- ptrace plumbing ----

func ptrace(req int, pid int, addr, data uintptr) error {
	_, _, e := unix.RawSyscall6(unix.SYS_PTRACE, uintptr(req), uintptr(pid), addr, data, 0, 0)
	if e != 0 {
		return e
	}
	return nil
}

// siginfo is the kernel's 128-byte siginfo_t, kept opaque so it can be re-queued as is.
type siginfo [128]byte

func (s *siginfo) signo() int  { return int(int32(le32(s[0:]))) }
func (s *siginfo) code() int   { return int(int32(le32(s[8:]))) }
func (s *siginfo) sender() int { return int(int32(le32(s[16:]))) } // si_pid of kill/queue layouts

func le32(b []byte) uint32 {
	return uint32(b[0]) | uint32(b[1])<<8 | uint32(b[2])<<16 | uint32(b[3])<<24
}

const (
	siUser    = 0  // SI_USER: kill()
	siTkill   = -6 // SI_TKILL: tgkill()
	sysSeccmp = 1  // SYS_SECCOMP: si_code of a seccomp SECCOMP_RET_TRAP SIGSYS
)

func (t *Tracee) getSiginfo(si *siginfo) error {
	_, _, e := unix.RawSyscall6(unix.SYS_PTRACE, unix.PTRACE_GETSIGINFO, uintptr(t.pid), 0, uintptr(unsafe.Pointer(si)), 0, 0)
	if e != 0 {
		return e
	}
	return nil
}

// wait waits for the next state change of t. An exit marks t gone (and, when the tracer's
// process is its parent, reaps it: the tracer thread's wait is the parent's wait).
func (t *Tracee) wait() (unix.WaitStatus, error) {
	var ws unix.WaitStatus
	for {
		_, err := unix.Wait4(t.pid, &ws, unix.WALL, nil)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return 0, err
		}
		if ws.Exited() || ws.Signaled() {
			t.setGone()
		}
		return ws, nil
	}
}

func (t *Tracee) setGone() {
	t.state = gone
	delete(t.tr.tracees, t.pid)
}

// waitGone reports whether t has exited, waiting up to a second for it: a ptrace request
// fails with ESRCH when the tracee was killed and left its stop.
func (t *Tracee) waitGone() bool {
	for i := 0; i < 1000 && t.state != gone; i++ {
		var ws unix.WaitStatus
		n, err := unix.Wait4(t.pid, &ws, unix.WALL|unix.WNOHANG, nil)
		if err == unix.ECHILD {
			t.setGone()
			break
		}
		if n == t.pid && (ws.Exited() || ws.Signaled()) {
			t.setGone()
			break
		}
		time.Sleep(time.Millisecond)
	}
	return t.state == gone
}

// killNow kills t with SIGKILL and waits until it is gone (reaped if the tracer's
// process is its parent, else left to its parent as a zombie).
func (t *Tracee) killNow() {
	if t.state == gone {
		return
	}
	_ = unix.Kill(t.pid, unix.SIGKILL)
	for t.state != gone {
		if _, err := t.wait(); err != nil {
			t.setGone() // ECHILD: someone else reaped it
		}
	}
}

// failed handles a failure to drive the tracee (not an injected syscall's errno): it puts
// the tracee back as it was or, when that fails too, kills it. It never leaves it
// half-modified.
func (t *Tracee) failed(op string, err error) error {
	te := &TraceeError{Pid: t.pid, Op: op, Err: err}
	if t.state == gone || (errors.Is(err, unix.ESRCH) && t.waitGone()) {
		te.Exited = true
		return te
	}
	if _, rerr := t.restore(); rerr != nil {
		te.Err = fmt.Errorf("%v; restoring: %v", err, rerr)
		t.killNow()
		te.Killed = true
	}
	return te
}

// ---- state changes ----

// dirty records that t is about to differ from its saved state.
func (t *Tracee) dirty() error {
	if t.exitKill {
		return nil
	}
	if err := ptrace(unix.PTRACE_SETOPTIONS, t.pid, 0, dirtyOptions); err != nil {
		return err
	}
	t.exitKill = true
	return nil
}

// testHookRestore, when set (by tests), runs at the start of every restore; an error from it
// is handled like a failed restore.
var testHookRestore func(t *Tracee) error

// Restore puts back the tracee's memory, registers and held signals, leaving it
// attached and stopped: it is then exactly as when seized (plus the effects of the
// injected syscalls themselves, which are the point). More syscalls may be injected
// afterwards. If restoring fails the tracee is killed and a *TraceeError with Killed
// set is returned. If a held signal could not be re-queued (not seen in practice: the
// tracee had room for it before), the tracee is restored and an error names the lost
// signal. Detach calls Restore itself.
func (t *Tracee) Restore() error {
	return t.tr.Do(func() error {
		if err := t.usable(); err != nil {
			return err
		}
		lost, err := t.restore()
		if err != nil {
			te := &TraceeError{Pid: t.pid, Op: "restore", Err: err}
			if t.state == gone {
				te.Exited = true
			} else {
				t.killNow()
				te.Killed = true
			}
			return te
		}
		if lost != nil {
			return fmt.Errorf("remote: pid %d restored, but %w", t.pid, lost)
		}
		return nil
	})
}

// restore undoes everything in order: the arena (an injected munmap), the held signals
// (injected, the last injections), the stack bytes, the registers, then EXITKILL. An err
// means the tracee may be half-restored: the caller must kill it. lost reports signals
// that could not be re-queued (the tracee is otherwise restored).
func (t *Tracee) restore() (lost, err error) {
	if testHookRestore != nil {
		if err := testHookRestore(t); err != nil {
			return nil, err
		}
	}
	s := &t.scr
	stop := false
	if len(t.held) > 0 || s.arena != 0 {
		// The injections below run with every signal blocked (PTRACE_SETSIGMASK), so none
		// can be taken from the tracee any more (but SIGSTOP), and re-queued ones stay
		// pending. Its own mask is put back after the last injection.
		var old uint64
		if err := t.sigmask(unix.PTRACE_GETSIGMASK, &old); err != nil {
			return nil, fmt.Errorf("get signal mask: %w", err)
		}
		all := uint64(blockAll)
		if err := t.sigmask(unix.PTRACE_SETSIGMASK, &all); err != nil {
			return nil, fmt.Errorf("block signals: %w", err)
		}
		if stop, lost, err = t.requeue(); err != nil {
			return nil, err
		}
		if s.arena != 0 {
			_, errno, err := t.inject(unix.SYS_MUNMAP, []uintptr{s.arena, s.arenaLen}, nil)
			if err == nil && errno != 0 {
				err = fmt.Errorf("munmap of the scratch arena: %w", errno)
			}
			if err != nil {
				return nil, err
			}
			s.arena, s.arenaLen, s.arenaCur = 0, 0, 0
		}
		if err := t.sigmask(unix.PTRACE_SETSIGMASK, &old); err != nil {
			return nil, fmt.Errorf("restore signal mask: %w", err)
		}
		for i := range t.held { // a SIGSTOP that came during the munmap
			stop = stop || t.held[i].signo() == int(unix.SIGSTOP)
		}
		t.held = nil
	}
	if len(s.saved) > 0 {
		if err := t.writeMem(s.savedLo, s.saved); err != nil {
			return nil, fmt.Errorf("restoring %d bytes of stack at %#x: %w", len(s.saved), s.savedLo, err)
		}
	}
	t.scr = scratch{}
	if t.regsDirt {
		if err := unix.PtraceSetRegs(t.pid, &t.saved); err != nil {
			return nil, fmt.Errorf("restoring registers: %w", err)
		}
		t.regsDirt = false
	}
	if stop {
		// A SIGSTOP arrived while injecting. It cannot be blocked, so it was not re-queued
		// with the others; send it now: it stays pending until the tracee resumes.
		if err := unix.Kill(t.pid, unix.SIGSTOP); err != nil {
			return nil, fmt.Errorf("re-sending SIGSTOP: %w", err)
		}
	}
	if t.exitKill {
		if err := ptrace(unix.PTRACE_SETOPTIONS, t.pid, 0, baseOptions); err != nil {
			return nil, fmt.Errorf("clearing PTRACE_O_EXITKILL: %w", err)
		}
		t.exitKill = false
	}
	return lost, nil
}

// blockAll is every signal but SIGKILL and SIGSTOP (which cannot be blocked).
const blockAll = ^uint64(0) &^ (1<<(unix.SIGKILL-1) | 1<<(unix.SIGSTOP-1))

// sigmask is PTRACE_GETSIGMASK or PTRACE_SETSIGMASK. (PTRACE_SETSIGMASK also cancels a
// pending restore of a ppoll/pselect temporary mask; by the time it is used here the first
// injected step has already done that restore, and the interrupted call re-applies its
// mask when it is restarted.)
func (t *Tracee) sigmask(req int, mask *uint64) error {
	_, _, e := unix.RawSyscall6(unix.SYS_PTRACE, uintptr(req), uintptr(t.pid), 8, uintptr(unsafe.Pointer(mask)), 0, 0)
	if e != 0 {
		return e
	}
	return nil
}

// Detach restores the tracee (Restore) and lets it go with PTRACE_DETACH. It resumes
// exactly where it was: a syscall it was blocked in is restarted by the kernel (the saved
// rax holds -ERESTART*, orig_rax the syscall), signals that arrived while it was held are
// pending again, and a process that was in a group stop when seized stays stopped (unless
// it was sent SIGCONT meanwhile): Detach returns once it is back in the stop (settleStop).
// If restoring fails the tracee is killed.
func (t *Tracee) Detach() error {
	return t.tr.Do(func() error { return t.detach(false) })
}

// DetachStopped is Detach, but the tracee is left in a SIGSTOP group stop, whatever its
// state before: SIGSTOP is queued with kill() before PTRACE_DETACH, because PTRACE_DETACH's
// signal argument is ignored unless the tracee is in a signal-delivery-stop. The tracee
// takes the SIGSTOP before returning to user space, so none of its code runs.
func (t *Tracee) DetachStopped() error {
	return t.tr.Do(func() error { return t.detach(true) })
}

// KeepStopped restores the tracee (Restore) and keeps it attached, in its ptrace-stop,
// with SIGSTOP queued: a template's parking. A ptrace-stop is not ended by SIGCONT, as a
// group stop is; and if the tracee is ever detached (by DetachStopped, Close, or the
// tracer's exit) it takes the SIGSTOP before it runs an instruction of its own.
func (t *Tracee) KeepStopped() error {
	return t.tr.Do(func() error {
		err := t.Restore() // an error with the tracee still usable: a signal was lost
		if uerr := t.usable(); uerr != nil {
			return err
		}
		if kerr := unix.Kill(t.pid, unix.SIGSTOP); kerr != nil {
			return t.failed("queue SIGSTOP", kerr)
		}
		return err
	})
}

func (t *Tracee) detach(stopped bool) error {
	if err := t.usable(); err != nil {
		return err
	}
	lost, err := t.restore()
	if err != nil {
		te := &TraceeError{Pid: t.pid, Op: "restore before detach", Err: err}
		if t.state == gone {
			te.Exited = true
		} else {
			t.killNow()
			te.Killed = true
		}
		return te
	}
	if stopped {
		if err := unix.Kill(t.pid, unix.SIGSTOP); err != nil {
			return t.failed("queue SIGSTOP", err)
		}
	}
	if err := ptrace(unix.PTRACE_DETACH, t.pid, 0, 0); err != nil {
		if t.waitGone() {
			return &TraceeError{Pid: t.pid, Op: "detach", Err: err, Exited: true}
		}
		return &TraceeError{Pid: t.pid, Op: "detach", Err: err}
	}
	t.state = detached
	delete(t.tr.tracees, t.pid)
	if t.wasStopped {
		settleStop(t.pid, true)
	}
	if lost != nil {
		return fmt.Errorf("remote: pid %d detached, but %w", t.pid, lost)
	}
	return nil
}

// Kill kills the tracee with SIGKILL and waits until it is gone. If the tracer's process
// is its parent (a CLONE_PARENT child of a process this daemon started, for instance) it is
// reaped; otherwise its parent reaps it.
func (t *Tracee) Kill() error {
	return t.tr.Do(func() error {
		if err := t.usable(); err != nil {
			return err
		}
		t.killNow()
		return nil
	})
}

// ---- injection ----

// refused lists syscalls Syscall will not inject. The fork family and execve change the
// process in ways Restore cannot follow (use Clone3), exit ends it, rt_sigreturn loads
// registers from the stack, and the calls that may return -ERESTART_RESTARTBLOCK would
// overwrite the restart block of a sleep the tracee was interrupted in.
var refused = map[uintptr]string{
	unix.SYS_CLONE: "clone", unix.SYS_CLONE3: "clone3", unix.SYS_FORK: "fork", unix.SYS_VFORK: "vfork",
	unix.SYS_EXECVE: "execve", unix.SYS_EXECVEAT: "execveat", unix.SYS_EXIT: "exit",
	unix.SYS_EXIT_GROUP: "exit_group", unix.SYS_RT_SIGRETURN: "rt_sigreturn",
	unix.SYS_RESTART_SYSCALL: "restart_syscall", unix.SYS_NANOSLEEP: "nanosleep",
	unix.SYS_CLOCK_NANOSLEEP: "clock_nanosleep", unix.SYS_POLL: "poll", unix.SYS_FUTEX: "futex",
}

// Syscall makes the tracee execute syscall nr with up to six arguments and returns its
// result. A failure of the syscall is returned as a unix.Errno and changes nothing else;
// a failure to drive the tracee is a *TraceeError.
//
// The tracee's registers are restored only by Restore or Detach, not after each call, and
// pointer arguments must point into the tracee (see Scratch). An injected syscall that
// blocks blocks the Tracer's thread (and its other tracees) until it returns. Syscalls
// the tracee's seccomp filter forbids fail as the filter says. ErrRefused is returned for
// the calls listed in the package doc.
func (t *Tracee) Syscall(nr uintptr, args ...uintptr) (uintptr, error) {
	var ret uintptr
	err := t.tr.Do(func() error {
		var err error
		ret, err = t.syscall(nr, args...)
		return err
	})
	return ret, err
}

// syscall is Syscall on the tracer's thread.
func (t *Tracee) syscall(nr uintptr, args ...uintptr) (uintptr, error) {
	if err := t.usable(); err != nil {
		return 0, err
	}
	if name, ok := refused[nr]; ok {
		return 0, fmt.Errorf("remote: %s: %w", name, ErrRefused)
	}
	if len(args) > 6 {
		return 0, fmt.Errorf("remote: syscall %d: %d arguments, at most 6", nr, len(args))
	}
	ret, errno, err := t.inject(nr, args, nil)
	if err != nil {
		return 0, t.failed(fmt.Sprintf("inject syscall %d", nr), err)
	}
	if errno != 0 {
		return 0, errno
	}
	return ret, nil
}

// inject runs one syscall in the tracee. err is a failure to drive it (state unknown:
// the caller must restore or kill); errno is the syscall's own failure. onFork is called
// with the pid of a child reported by a fork/clone event.
//
// Registers: rax = nr, the six argument registers, rip = a syscall instruction, and
// orig_rax = -1. The last one matters when the tracee was stopped inside a syscall: the
// kernel's restart logic runs on the way back to user space after every ptrace stop in the
// signal path, and looks at orig_rax; -1 says "not in a syscall", so the injected call is
// never mistaken for the interrupted one. All other registers are the saved ones.
//
// The tracee is single-stepped over the instruction: the step trap is reported at syscall
// exit, before it returns to user space, so none of the tracee's own code runs.
func (t *Tracee) inject(nr uintptr, args []uintptr, onFork func(int) error) (uintptr, unix.Errno, error) {
	sc, err := t.syscallAddr()
	if err != nil {
		return 0, 0, err
	}
	if err := t.dirty(); err != nil {
		return 0, 0, fmt.Errorf("set PTRACE_O_EXITKILL: %w", err)
	}
	var a [6]uintptr
	copy(a[:], args)
	regs := t.saved
	regs.Rax = uint64(nr)
	regs.Orig_rax = ^uint64(0)
	regs.Rip = uint64(sc)
	regs.Rdi, regs.Rsi, regs.Rdx = uint64(a[0]), uint64(a[1]), uint64(a[2])
	regs.R10, regs.R8, regs.R9 = uint64(a[3]), uint64(a[4]), uint64(a[5])
	for attempt := 0; attempt < maxInjectRestarts; attempt++ {
		t.regsDirt = true
		if err := unix.PtraceSetRegs(t.pid, &regs); err != nil {
			return 0, 0, fmt.Errorf("set registers: %w", err)
		}
		out, err := t.step(onFork)
		if err != nil {
			return 0, 0, err
		}
		r := int64(out.Rax)
		switch -r {
		case errRestartSys, errRestartNoIntr, errRestartNoHand, errRestartBlock:
			// Interrupted by a signal, which step has taken (it is held and re-queued at
			// Restore). Inject the call again, as the kernel would have restarted it.
			continue
		}
		if r < 0 && r >= -4095 {
			return 0, unix.Errno(-r), nil
		}
		return uintptr(out.Rax), 0, nil
	}
	return 0, 0, fmt.Errorf("syscall %d interrupted %d times in a row", nr, maxInjectRestarts)
}

// step single-steps the tracee until it has executed the syscall instruction at t.sc and
// returns the registers it then has. Other stops on the way are handled:
//   - PTRACE_EVENT_STOP (group-stop reports, the trap a PTRACE_INTERRUPT or a SIGCONT
//     leaves behind): ignored, the tracee is stepped again;
//   - fork/clone events: the child's pid goes to onFork;
//   - a signal-delivery-stop: the signal is taken from the tracee (resumed with signal 0),
//     with its siginfo kept in t.held to be re-queued by Restore, so it is delivered after
//     Detach exactly once; signals the injected syscall raised against the tracee itself
//     (SIGSYS from seccomp, SIGPIPE, SIGXFSZ) are dropped, being ours, not the tracee's.
func (t *Tracee) step(onFork func(int) error) (unix.PtraceRegs, error) {
	var regs unix.PtraceRegs
	for stops := 0; ; stops++ {
		if stops == maxStepStops {
			return regs, fmt.Errorf("%d stops without executing the syscall instruction", stops)
		}
		ws, err := t.resume(unix.PTRACE_SINGLESTEP)
		if err != nil {
			return regs, err
		}
		if ev, err := t.event(ws, onFork); err != nil {
			return regs, err
		} else if ev {
			continue
		}
		sig := ws.StopSignal()
		if sig == unix.SIGTRAP {
			if err := unix.PtraceGetRegs(t.pid, &regs); err != nil {
				return regs, fmt.Errorf("get registers: %w", err)
			}
			// The step trap of a syscall instruction is forced at syscall exit, and
			// synchronous kernel signals are dequeued before any other, so the first SIGTRAP
			// with rip past the instruction is ours. A SIGTRAP someone sent earlier shows
			// rip still at the instruction and is held like any other signal.
			if uintptr(regs.Rip) == t.sc+2 {
				return regs, nil
			}
		}
		var si siginfo
		if err := t.getSiginfo(&si); err != nil {
			return regs, fmt.Errorf("get siginfo of %v: %w", sig, err)
		}
		t.take(&si)
	}
}

// event handles a stop that is not a signal-delivery-stop, and reports whether ws was
// one: a group-stop report or an interrupt's trap (PTRACE_EVENT_STOP) is ignored, a
// fork event's child goes to onFork (an error without one), any other event is an error.
func (t *Tracee) event(ws unix.WaitStatus, onFork func(int) error) (bool, error) {
	switch ev := int(ws) >> 16; ev {
	case 0:
		return false, nil
	case unix.PTRACE_EVENT_STOP:
		return true, nil
	case unix.PTRACE_EVENT_FORK, unix.PTRACE_EVENT_CLONE, unix.PTRACE_EVENT_VFORK:
		msg, err := unix.PtraceGetEventMsg(t.pid)
		if err != nil {
			return true, fmt.Errorf("get event message: %w", err)
		}
		if onFork == nil {
			return true, fmt.Errorf("unexpected fork event (child %d)", msg)
		}
		return true, onFork(int(msg))
	}
	return true, fmt.Errorf("unexpected stop (%s)", describe(ws))
}

// take keeps a signal the tracee dequeued during an injection (held, re-queued by
// Restore), unless the injection raised it against the tracee itself.
func (t *Tracee) take(si *siginfo) {
	if !t.raisedByInjection(si) {
		t.hold(si)
	}
}

// resume restarts the stopped tracee with req (PTRACE_SINGLESTEP or PTRACE_CONT, no
// signal) and waits for its next stop; an exit is an error.
func (t *Tracee) resume(req int) (unix.WaitStatus, error) {
	if err := ptrace(req, t.pid, 0, 0); err != nil {
		return 0, fmt.Errorf("resume (ptrace request %d): %w", req, err)
	}
	ws, err := t.wait()
	if err != nil {
		return 0, fmt.Errorf("wait: %w", err)
	}
	if !ws.Stopped() {
		return ws, fmt.Errorf("tracee %s", describe(ws))
	}
	return ws, nil
}

// raisedByInjection reports whether the signal was raised by the injected syscall
// against the tracee itself.
func (t *Tracee) raisedByInjection(si *siginfo) bool {
	switch si.signo() {
	case int(unix.SIGSYS):
		return si.code() == sysSeccmp
	case int(unix.SIGPIPE), int(unix.SIGXFSZ):
		// send_sig(sig, current, 0): si_code SI_USER, si_pid the tracee itself.
		if si.code() != siUser {
			return false
		}
		self, err := t.selfPid()
		return err == nil && si.sender() == self
	}
	return false
}

// hold keeps a signal taken from the tracee. Standard signals do not queue: a second
// instance of one already held is the same pending signal.
func (t *Tracee) hold(si *siginfo) {
	if sig := si.signo(); sig < 32 {
		for i := range t.held {
			if t.held[i].signo() == sig {
				return
			}
		}
	}
	t.held = append(t.held, *si)
}

// requeue makes the held signals pending again in the tracee, in arrival order, with
// their original siginfo (sender pid and uid, si_code, si_value): it injects
// rt_tgsigqueueinfo(self, self, sig, &info) for each, which a process may do with any
// si_code for itself. The caller has blocked all signals: a re-queued deliverable signal
// would otherwise be dequeued again by the next injected instruction. SIGSTOP cannot be
// blocked: it is reported in stop instead (the caller sends it after the last injection),
// unless a SIGCONT came after it.
func (t *Tracee) requeue() (stop bool, lost, err error) {
	if len(t.held) == 0 {
		return false, nil, nil
	}
	t.initScratch()
	mark := t.scr.mark()
	defer t.scr.release(mark)
	self, err := t.selfPid()
	if err != nil {
		return false, nil, err
	}
	var lostSigs []string
	for len(t.held) > 0 {
		held := t.held
		t.held = nil // only SIGSTOP can be held again from here on
		for i := range held {
			si := &held[i]
			switch si.signo() {
			case int(unix.SIGSTOP):
				stop = true
				continue
			case int(unix.SIGCONT):
				stop = false
			}
			addr, err := t.alloc(si[:])
			if err != nil {
				return false, nil, err
			}
			_, errno, err := t.inject(unix.SYS_RT_TGSIGQUEUEINFO, []uintptr{uintptr(self), uintptr(self), uintptr(si.signo()), addr}, nil)
			if err != nil {
				return false, nil, err
			}
			if errno != 0 {
				lostSigs = append(lostSigs, fmt.Sprintf("%s (%v)", unix.SignalName(unix.Signal(si.signo())), errno))
			}
		}
	}
	if len(lostSigs) > 0 {
		lost = fmt.Errorf("signals could not be re-queued (lost): %s", strings.Join(lostSigs, ", "))
	}
	return stop, lost, nil
}

// selfPid returns the tracee's pid in its own PID namespace (the last NSpid entry).
func (t *Tracee) selfPid() (int, error) {
	if t.nsPid != 0 {
		return t.nsPid, nil
	}
	n, err := procfs.InnerPid(t.pid)
	if err != nil {
		return 0, err
	}
	t.nsPid = n
	return n, nil
}

// ---- the syscall instruction ----

// SyscallAddr returns the address of the syscall instruction used for injection, or 0
// if none was needed yet.
func (t *Tracee) SyscallAddr() uintptr {
	var a uintptr
	_ = t.tr.Do(func() error { a = t.sc; return nil })
	return a
}

// UseSyscallAddr tells t to inject through the syscall instruction at addr (for example
// one remembered from an earlier Tracee of the same process, or of its fork parent:
// fork keeps the address space). The two bytes are checked.
func (t *Tracee) UseSyscallAddr(addr uintptr) error {
	return t.tr.Do(func() error {
		if err := t.usable(); err != nil {
			return err
		}
		ok, err := t.isSyscallInsn(addr)
		if err != nil {
			return err
		}
		if !ok {
			return fmt.Errorf("remote: pid %d: no syscall instruction at %#x", t.pid, addr)
		}
		t.sc = addr
		return nil
	})
}

// syscallAddr finds an executable 0f 05 pair. A tracee stopped in a syscall has one at
// rip-2 (the kernel's rip is past the instruction until its restart logic runs). One
// stopped in user code does not: any executable 0f 05 byte pair is a syscall instruction
// when jumped to, and the step trap comes at syscall exit, before the bytes after it run.
// The vDSO (whose clock_gettime fallbacks contain syscall instructions) is searched
// first, then the libc's text, then other executable mappings.
func (t *Tracee) syscallAddr() (uintptr, error) {
	if t.sc != 0 {
		return t.sc, nil
	}
	if t.InSyscall() && t.saved.Rip >= 2 {
		if ok, err := t.isSyscallInsn(uintptr(t.saved.Rip - 2)); err == nil && ok {
			t.sc = uintptr(t.saved.Rip - 2)
			return t.sc, nil
		}
	}
	addr, err := t.searchSyscallInsn()
	if err != nil {
		return 0, err
	}
	t.sc = addr
	return addr, nil
}

func (t *Tracee) isSyscallInsn(addr uintptr) (bool, error) {
	var b [2]byte
	if _, err := unix.PtracePeekText(t.pid, addr, b[:]); err != nil {
		return false, err
	}
	return b[0] == 0x0f && b[1] == 0x05, nil
}

func (t *Tracee) searchSyscallInsn() (uintptr, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(t.pid) + "/maps")
	if err != nil {
		return 0, err
	}
	type mapping struct {
		lo, hi uintptr
		rank   int
	}
	var ms []mapping
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) < 5 || len(f[1]) < 3 || f[1][0] != 'r' || f[1][2] != 'x' {
			continue
		}
		name := ""
		if len(f) >= 6 {
			name = f[5]
		}
		rank := 2
		switch {
		case name == "[vsyscall]":
			continue // emulated, not readable
		case name == "[vdso]":
			rank = 0
		case strings.Contains(name, "/libc.so") || strings.Contains(name, "/libc-"):
			rank = 1
		}
		lo, hi, ok := strings.Cut(f[0], "-")
		if !ok {
			continue
		}
		l, err1 := strconv.ParseUint(lo, 16, 64)
		h, err2 := strconv.ParseUint(hi, 16, 64)
		if err1 != nil || err2 != nil {
			continue
		}
		ms = append(ms, mapping{uintptr(l), uintptr(h), rank})
	}
	sort.SliceStable(ms, func(i, j int) bool { return ms[i].rank < ms[j].rank })
	const chunk = 64 << 10
	insn := []byte{0x0f, 0x05}
	buf := make([]byte, chunk+1)
	for _, m := range ms {
		end := m.hi
		if end-m.lo > 16<<20 {
			end = m.lo + 16<<20
		}
		for a := m.lo; a < end; a += chunk {
			n := end - a
			if n > chunk+1 {
				n = chunk + 1 // one byte of overlap with the next chunk
			}
			if err := t.readMem(a, buf[:n]); err != nil {
				break
			}
			if i := bytes.Index(buf[:n], insn); i >= 0 {
				return a + uintptr(i), nil
			}
		}
	}
	return 0, errors.New("no syscall instruction found in the executable mappings")
}

// ---- memory ----

// readMem reads the tracee's memory with process_vm_readv, falling back to
// PTRACE_PEEKDATA where that is not permitted.
func (t *Tracee) readMem(addr uintptr, buf []byte) error {
	if len(buf) == 0 {
		return nil
	}
	local := []unix.Iovec{{Base: &buf[0]}}
	local[0].SetLen(len(buf))
	n, err := unix.ProcessVMReadv(t.pid, local, []unix.RemoteIovec{{Base: addr, Len: len(buf)}}, 0)
	switch {
	case err == unix.EPERM || err == unix.ENOSYS:
		_, err = unix.PtracePeekData(t.pid, addr, buf)
		return err
	case err != nil:
		return err
	case n != len(buf):
		return unix.EFAULT
	}
	return nil
}

// writeMem writes the tracee's memory with process_vm_writev (which, unlike
// PTRACE_POKEDATA, respects page protections: it cannot write into a guard page),
// falling back to PTRACE_POKEDATA where it is not permitted.
func (t *Tracee) writeMem(addr uintptr, data []byte) error {
	if len(data) == 0 {
		return nil
	}
	local := []unix.Iovec{{Base: &data[0]}}
	local[0].SetLen(len(data))
	n, err := unix.ProcessVMWritev(t.pid, local, []unix.RemoteIovec{{Base: addr, Len: len(data)}}, 0)
	switch {
	case err == unix.EPERM || err == unix.ENOSYS:
		_, err = unix.PtracePokeData(t.pid, addr, data)
		return err
	case err != nil:
		return err
	case n != len(data):
		return unix.EFAULT
	}
	return nil
}

// ReadMem reads n bytes of the tracee's memory at addr (for example a struct a syscall
// wrote into scratch memory).
func (t *Tracee) ReadMem(addr uintptr, n int) ([]byte, error) {
	buf := make([]byte, n)
	err := t.tr.Do(func() error {
		if err := t.usable(); err != nil {
			return err
		}
		return t.readMem(addr, buf)
	})
	return buf, err
}

// WriteScratch overwrites bytes of scratch memory that Scratch returned (addr and data
// within that allocation): a structure whose pointers are addresses of other parts of
// the same allocation, known only once it is placed. Writing anywhere else would change
// the tracee's own memory, which Restore would not put back.
func (t *Tracee) WriteScratch(addr uintptr, data []byte) error {
	return t.tr.Do(func() error {
		if err := t.usable(); err != nil {
			return err
		}
		return t.writeMem(addr, data)
	})
}

// scratch is the memory used for syscall arguments. It grows down from below the red zone
// of the saved rsp, in the main stack, where the tracee keeps nothing: data there is dead
// (the ABI lets signal handlers overwrite it at any time). The original bytes are read
// before they are overwritten and written back by Restore, so the tracee finds its memory
// byte-identical (a test compares 64 KiB below rsp). Where the stack cannot be used (rsp
// not on the main stack: a thread or sigaltstack, whose neighbourhood may be live data; or
// the stack VMA not grown that far: remote access does not grow stacks since Linux 6.5)
// an anonymous mapping is injected (mmap) and removed by Restore (munmap).
type scratch struct {
	init    bool
	noStack bool
	top     uintptr // (rsp - redZone) &^ 15: allocations grow down from here
	cur     uintptr // lowest allocated byte
	savedLo uintptr // the original bytes of [savedLo, top) are in saved
	saved   []byte

	arena, arenaLen, arenaCur uintptr // the mmap fallback; allocations grow up
}

type scratchMark struct{ cur, arenaCur uintptr }

func (s *scratch) mark() scratchMark { return scratchMark{s.cur, s.arenaCur} }

// release frees what was allocated after m (the saved bytes stay saved).
func (s *scratch) release(m scratchMark) {
	if s.init && m.cur != 0 && m.cur <= s.top {
		s.cur = m.cur
	}
	if s.arena != 0 && m.arenaCur != 0 {
		s.arenaCur = m.arenaCur
	}
}

func (t *Tracee) initScratch() {
	s := &t.scr
	if s.init {
		return
	}
	s.init = true
	rsp := uintptr(t.saved.Rsp)
	s.top = (rsp - redZone) &^ 15
	s.cur, s.savedLo = s.top, s.top
	onMain := t.startStack != 0 && rsp <= t.startStack && t.startStack-rsp < mainStackSpan
	s.noStack = !onMain
}

// Scratch copies data into the tracee's scratch memory and returns its address there,
// 16-byte aligned. It stays valid until Restore or Detach, which put back what was there.
func (t *Tracee) Scratch(data []byte) (uintptr, error) {
	var addr uintptr
	err := t.tr.Do(func() error {
		if err := t.usable(); err != nil {
			return err
		}
		var err error
		addr, err = t.alloc(data)
		if err != nil {
			return t.failed("scratch memory", err)
		}
		return nil
	})
	return addr, err
}

// ScratchString copies s with a terminating NUL into scratch memory.
func (t *Tracee) ScratchString(s string) (uintptr, error) {
	return t.Scratch(append([]byte(s), 0))
}

// alloc places data in scratch memory: the stack if possible, else the arena.
func (t *Tracee) alloc(data []byte) (uintptr, error) {
	addr, ok, err := t.allocStack(data)
	if err != nil || ok {
		return addr, err
	}
	return t.allocArena(data)
}

// allocStack places data on the stack below the red zone; ok is false when the stack
// cannot hold it.
func (t *Tracee) allocStack(data []byte) (addr uintptr, ok bool, err error) {
	t.initScratch()
	s := &t.scr
	n := (uintptr(len(data)) + 15) &^ 15
	if n == 0 {
		n = 16
	}
	if s.noStack || s.cur < n || s.top-(s.cur-n) > maxStackScratch {
		return 0, false, nil
	}
	addr = s.cur - n
	if addr < s.savedLo {
		orig := make([]byte, s.savedLo-addr)
		if err := t.readMem(addr, orig); err != nil {
			if errors.Is(err, unix.EFAULT) {
				s.noStack = true // below the stack VMA
				return 0, false, nil
			}
			return 0, false, fmt.Errorf("saving stack bytes: %w", err)
		}
		s.saved = append(orig, s.saved...)
		s.savedLo = addr
	}
	if err := t.dirty(); err != nil {
		return 0, false, err
	}
	if err := t.writeMem(addr, data); err != nil {
		return 0, false, fmt.Errorf("writing scratch data: %w", err)
	}
	s.cur = addr
	return addr, true, nil
}

func (t *Tracee) allocArena(data []byte) (uintptr, error) {
	s := &t.scr
	n := (uintptr(len(data)) + 15) &^ 15
	if s.arena == 0 {
		size := uintptr(arenaMin)
		for size < n {
			size *= 2
		}
		a, errno, err := t.inject(unix.SYS_MMAP, []uintptr{0, size, unix.PROT_READ | unix.PROT_WRITE,
			unix.MAP_PRIVATE | unix.MAP_ANONYMOUS, ^uintptr(0), 0}, nil)
		if err != nil {
			return 0, err
		}
		if errno != 0 {
			return 0, fmt.Errorf("mmap of a scratch arena in the tracee: %w", errno)
		}
		s.arena, s.arenaLen, s.arenaCur = a, size, a
	}
	if s.arenaCur+n > s.arena+s.arenaLen {
		return 0, fmt.Errorf("scratch arena full (%d bytes): Restore frees it", s.arenaLen)
	}
	addr := s.arenaCur
	if err := t.writeMem(addr, data); err != nil {
		return 0, fmt.Errorf("writing scratch data: %w", err)
	}
	s.arenaCur += n
	return addr, nil
}

// ---- /proc ----

type procStat struct {
	state      byte
	threads    int
	startStack uintptr
}

// readStat parses /proc/PID/stat (fields after the command name, which may hold
// spaces). It reads into a stack buffer: this runs twice per Seize.
func readStat(pid int) (procStat, error) {
	var buf [1024]byte
	fd, err := unix.Open("/proc/"+strconv.Itoa(pid)+"/stat", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		if err == unix.ENOENT {
			return procStat{}, unix.ESRCH
		}
		return procStat{}, err
	}
	n, err := unix.Read(fd, buf[:])
	unix.Close(fd)
	if err != nil {
		return procStat{}, err
	}
	b := buf[:n]
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return procStat{}, errors.New("malformed /proc/PID/stat")
	}
	// f[0] is field 3 (state); num_threads is field 20, startstack field 28.
	var f [26][]byte
	nf := 0
	for _, w := range bytes.Fields(b[i+1:]) {
		if nf == len(f) {
			break
		}
		f[nf] = w
		nf++
	}
	if nf < len(f) {
		return procStat{}, errors.New("short /proc/PID/stat")
	}
	threads, _ := strconv.Atoi(string(f[17]))
	ss, _ := strconv.ParseUint(string(f[25]), 10, 64)
	return procStat{state: f[0][0], threads: threads, startStack: uintptr(ss)}, nil
}

func describe(ws unix.WaitStatus) string {
	switch {
	case ws.Exited():
		return fmt.Sprintf("exited with status %d", ws.ExitStatus())
	case ws.Signaled():
		return fmt.Sprintf("killed by %v", ws.Signal())
	case ws.Stopped():
		return fmt.Sprintf("stopped by %v, event %d", ws.StopSignal(), int(ws)>>16)
	}
	return fmt.Sprintf("wait status %#x", int(ws))
}

// SavedRegs returns the registers the tracee had when it was seized (a clone3 child: its
// parent's), which Restore and Detach put back.
func (t *Tracee) SavedRegs() unix.PtraceRegs { return t.saved }

// stopSettleWait bounds settleStop. A task woken on a loaded 2-core machine waits for a
// CPU for milliseconds, not seconds: past this it is taken for one that was continued.
const stopSettleWait = 2 * time.Second

// settleStop waits, stopSettleWait at most, while pid is runnable ('R') on its way into a
// group stop, and returns its state then: 'T' once stopped. always: a group stop is in
// effect for it (a detached tracee that was in one); else only while a SIGSTOP is pending
// for it.
//
// The kernel facts: PTRACE_DETACH of a tracee in a group stop re-arms the stop and wakes
// the tracee (__ptrace_unlink), which re-enters TASK_STOPPED only once scheduled. A tracer
// that seizes it meanwhile gets the group stop's trap and its own PTRACE_INTERRUPT's as
// one: CRIU then PTRACE_CONTs it out of the stop and waits for a second trap that never
// comes, until its 10 s freeze timeout ("SEIZE N: can't wait task: Interrupted system
// call": TestCheckCopyImage's dump of a stopped python just detached, 7 of 10 runs at load
// 18). A SIGSTOP queued before a detach (DetachStopped's, CRIU's when it restores a tree
// stopped) is taken the same way, once scheduled; CRIU seizes such a task correctly (its
// interrupt's trap, then the SIGSTOP's), but Seize finds it running (the interrupt's trap
// comes before any signal is dequeued), so WasStopped is false for a process about to
// stop. DetachStopped does not wait for it: that cost its copy's park about 1 ms at load
// 10, for no tracer that needs it.
func settleStop(pid int, always bool) byte {
	deadline := time.Now().Add(stopSettleWait)
	for {
		st, err := readStat(pid)
		if err != nil {
			return 0
		}
		if st.state != 'R' || time.Now().After(deadline) {
			return st.state
		}
		if !always && !sigstopPending(pid) {
			// The state read above may predate the SIGSTOP's dequeue: the kernel dequeues
			// it and sets TASK_STOPPED in one hold of the siglock (get_signal,
			// do_signal_stop), under which /proc reads the pending set, so a state read
			// after that shows the stop if the signal was what cleared it.
			if st, err = readStat(pid); err != nil {
				return 0
			}
			return st.state
		}
		time.Sleep(50 * time.Microsecond)
	}
}

// WaitQueuedStop waits, a few seconds at most, until pid (not traced by this package),
// runnable with a SIGSTOP pending, has taken it, and returns its state then ('T' once
// stopped): a process CRIU restored stopped, which gets SIGSTOP just before CRIU lets it
// go, must be seen in its group stop by a Seize (settleStop).
func WaitQueuedStop(pid int) byte { return settleStop(pid, false) }

// sigstopPending reports whether SIGSTOP is pending for pid (its thread's or its
// process's set: /proc/PID/status SigPnd, ShdPnd).
func sigstopPending(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return false
	}
	for _, l := range bytes.Split(b, []byte("\n")) {
		k, v, ok := bytes.Cut(l, []byte(":"))
		if !ok || (string(k) != "SigPnd" && string(k) != "ShdPnd") {
			continue
		}
		if m, err := strconv.ParseUint(string(bytes.TrimSpace(v)), 16, 64); err == nil && m&(1<<(unix.SIGSTOP-1)) != 0 {
			return true
		}
	}
	return false
}
