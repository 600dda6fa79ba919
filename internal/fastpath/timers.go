package fastpath

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"

	"deltabox/internal/procfs"
	"deltabox/internal/remote"
)

// Timers. fork(2) does not copy interval timers (setitimer: ITIMER_REAL, ITIMER_VIRTUAL,
// ITIMER_PROF) or POSIX timers (timer_create) into the child: its signal_struct is new,
// with none armed and no timer list. A template is a fork, and so is the process a
// restore makes from it, so without help a restored process has lost every timer it had.
//
// At a checkpoint the live process, stopped, is asked (injected getitimer for each kind,
// timer_gettime for each POSIX timer /proc/PID/timers lists) how long each timer has left
// and its interval. At each restore the new child re-arms them with that time left: a
// template is time frozen at the checkpoint, so the restored process finds each timer as
// far from expiry as it was then (ITIMER_VIRTUAL and ITIMER_PROF count the process's CPU
// time, which does not pass in a template either). POSIX timers are re-created with the
// same ids, clock, signal, value and notification: Linux 6.16+ lets a process ask for
// the id (prctl PR_TIMER_CREATE_RESTORE_IDS_ON makes timer_create read the id from its
// timer_t argument; checkpoint/restore is what it was added for), and the child turns it
// off again.
//
// What is not carried, and why it is acceptable: a timer armed with TIMER_ABSTIME is
// re-armed relative to the restore (its deadline moves with the checkpoint's frozen
// time, like every other timer); timer_getoverrun() reads 0 until the next expiry; the
// next id timer_create hands out may differ (the kernel's counter moves past the highest
// id restored). A process CPU-time clock itself starts at zero in a fork (clock_gettime
// of CLOCK_PROCESS_CPUTIME_ID), which no interface can set; timers on it still fire
// after the same CPU time.
//
// A POSIX timer whose signal was queued and not yet delivered at the checkpoint (blocked,
// typically) is not re-made by queueing a copy of the signal: the kernel re-arms a
// periodic timer only when its own signal is delivered, so a copy would leave the new
// timer firing meanwhile. Instead the timer is set to an absolute expiry already past,
// chosen so that its period keeps the checkpoint's phase (now + left - interval): the
// kernel queues its own signal at once, with the timer waiting for that delivery to
// re-arm, as it was. Its si_overrun then counts the expiries since the restore only.
//
// Refused (the process is ineligible, with the timer named): timers on a clock the
// restored process could not name again (the CPU-time clock of another process, a
// dynamic POSIX clock behind an fd), timers signalling a thread that is not the process's
// one thread, and any POSIX timer on a kernel without PR_TIMER_CREATE_RESTORE_IDS (ids
// would change under the program).

// PosixTimer is one POSIX timer of the process (timer_create).
type PosixTimer struct {
	ID     int32
	Clock  int32
	Signo  int32
	Notify int32  // remote.SigevSignal, SigevNone, SigevThread, optionally | SigevThreadID
	Value  uint64 // sigev_value (the signal's si_value)
	// Setting is timer_gettime at the checkpoint: time to the next expiry (0: disarmed)
	// and interval.
	Setting unix.ItimerSpec
	// Pending: its own signal was queued and not yet delivered at the checkpoint.
	Pending bool
}

// itimerKinds are the interval timers of setitimer, by `which`.
var itimerKinds = [3]string{"ITIMER_REAL", "ITIMER_VIRTUAL", "ITIMER_PROF"}

// restoreIDs reports whether this kernel has PR_TIMER_CREATE_RESTORE_IDS (6.16+): its GET
// answers 0 or 1, older kernels EINVAL.
var restoreIDs = sync.OnceValue(func() bool {
	_, err := unix.PrctlRetInt(unix.PR_TIMER_CREATE_RESTORE_IDS, unix.PR_TIMER_CREATE_RESTORE_IDS_GET, 0, 0, 0)
	return err == nil
})

// cpuTick caches cpuTimerTick's answer (ns; 0 until measured).
var cpuTick atomic.Int64

// cpuTimerTick returns what setitimer adds to an ITIMER_VIRTUAL or ITIMER_PROF value: one
// tick (TICK_NSEC, so that the timer expires no earlier than asked, CPU time being
// sampled at ticks). Re-arming with the value getitimer read would make a timer a tick
// later at every restore; rearm takes it off. It is measured once, in the child c being
// restored: an ITIMER_VIRTUAL set and read back (a stopped child spends no user time in
// between), then disarmed; rearm sets the real one afterwards. Precondition: inside Do.
func cpuTimerTick(c *remote.Tracee) (int64, error) {
	if t := cpuTick.Load(); t != 0 {
		return max(t, 0), nil
	}
	probe := unix.Itimerval{Value: unix.Timeval{Sec: 1000}}
	if _, err := c.Setitimer(unix.ITIMER_VIRTUAL, probe); err != nil {
		return 0, fmt.Errorf("setitimer(ITIMER_VIRTUAL): %w", err)
	}
	got, err := c.Getitimer(unix.ITIMER_VIRTUAL)
	if err != nil {
		return 0, fmt.Errorf("getitimer(ITIMER_VIRTUAL): %w", err)
	}
	if _, err := c.Setitimer(unix.ITIMER_VIRTUAL, unix.Itimerval{}); err != nil {
		return 0, fmt.Errorf("setitimer(ITIMER_VIRTUAL): %w", err)
	}
	t := got.Value.Nano() - probe.Value.Nano()
	if t < 0 || t > 100e6 {
		return 0, fmt.Errorf("setitimer(ITIMER_VIRTUAL, 1000 s) reads back %v", got.Value)
	}
	if t == 0 {
		t = -1 // no rounding on this kernel; cached as "measured"
	}
	cpuTick.Store(t)
	return max(t, 0), nil
}

// posixTimers reads /proc/PID/timers of the process (host PID hostPid, pid in its
// namespace) and checks that each timer can be re-created in a restored child.
func posixTimers(base string, hostPid, pid int, buf []byte) ([]PosixTimer, error) {
	b, err := readProc(base+"/timers", buf)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, nil // a kernel without CONFIG_CHECKPOINT_RESTORE: no timers shown
		}
		return nil, err
	}
	timers, err := parseTimers(b)
	if err != nil {
		return nil, fmt.Errorf("process %d: /proc/PID/timers: %w", pid, err)
	}
	if len(timers) > 0 && !restoreIDs() {
		return nil, &Ineligible{Pid: pid, Reason: fmt.Sprintf("it has %d POSIX timers, and this kernel cannot re-create them with their ids (PR_TIMER_CREATE_RESTORE_IDS, Linux 6.16+)", len(timers))}
	}
	// A thread as the sandbox calls it (/proc shows host tids).
	name := func(tid int) string {
		ns, err := procfs.NSpid(hostPid)
		if n := innerPids([]string{strconv.Itoa(tid)}, len(ns)); err == nil && n != "?" {
			return n
		}
		return "(one that has exited)"
	}
	for _, tm := range timers {
		if reason := timerRefused(tm.PosixTimer, tm.target, hostPid, pid, name); reason != "" {
			return nil, &Ineligible{Pid: pid, Reason: fmt.Sprintf("POSIX timer %d %s", tm.ID, reason)}
		}
	}
	out := make([]PosixTimer, len(timers))
	for i := range timers {
		out[i] = timers[i].PosixTimer
	}
	return out, nil
}

// procTimer is a timer as /proc/PID/timers shows it, with the pid or tid it signals
// (in the reader's PID namespace; 0 if gone).
type procTimer struct {
	PosixTimer
	target int
}

// parseTimers parses /proc/PID/timers: blocks of
//
//	ID: 1
//	signal: 35/0000000000000abc
//	notify: signal/pid.1234        (none, thread; tid.N with SIGEV_THREAD_ID)
//	ClockID: 1
func parseTimers(b []byte) ([]procTimer, error) {
	var out []procTimer
	for _, l := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(l, ": ")
		if !ok {
			continue
		}
		if k == "ID" {
			id, err := strconv.ParseInt(v, 10, 32)
			if err != nil {
				return nil, fmt.Errorf("bad line %q", l)
			}
			out = append(out, procTimer{PosixTimer: PosixTimer{ID: int32(id)}})
			continue
		}
		if len(out) == 0 {
			return nil, fmt.Errorf("%q before an ID", l)
		}
		tm := &out[len(out)-1]
		switch k {
		case "signal":
			sig, val, ok := strings.Cut(v, "/")
			s, err1 := strconv.ParseInt(sig, 10, 32)
			x, err2 := strconv.ParseUint(val, 16, 64)
			if !ok || err1 != nil || err2 != nil {
				return nil, fmt.Errorf("bad line %q", l)
			}
			tm.Signo, tm.Value = int32(s), x
		case "notify":
			how, who, ok := strings.Cut(v, "/")
			kind, n, ok2 := strings.Cut(who, ".")
			target, err := strconv.Atoi(n)
			if !ok || !ok2 || err != nil {
				return nil, fmt.Errorf("bad line %q", l)
			}
			switch how {
			case "signal":
				tm.Notify = remote.SigevSignal
			case "none":
				tm.Notify = remote.SigevNone
			case "thread":
				tm.Notify = remote.SigevThread
			default:
				return nil, fmt.Errorf("unknown notification %q", how)
			}
			if kind == "tid" {
				tm.Notify |= remote.SigevThreadID
			}
			tm.target = target
		case "ClockID":
			c, err := strconv.ParseInt(v, 10, 32)
			if err != nil {
				return nil, fmt.Errorf("bad line %q", l)
			}
			tm.Clock = int32(c)
		}
	}
	return out, nil
}

// timerRefused says why a timer cannot be re-created faithfully in a restored child, or
// "" if it can. target is the pid/tid it signals as /proc showed it (host namespace);
// name says what the sandbox calls a host tid.
func timerRefused(tm PosixTimer, target, hostPid, pid int, name func(int) string) string {
	if tm.Notify&remote.SigevThreadID != 0 && target != hostPid {
		return fmt.Sprintf("signals thread %s, not the process's one thread", name(target))
	}
	if tm.Clock < 0 {
		// A CPU-time clock of a given process or thread (clock_getcpuclockid), encoded as
		// ~pid << 3 | perthread << 2 | which; which 3 is a dynamic clock (~fd << 3 | 3).
		if tm.Clock&3 == 3 {
			return "runs on a dynamic POSIX clock (an fd's clock), which is not carried"
		}
		if owner := int(^tm.Clock >> 3); owner != 0 && owner != pid {
			return fmt.Sprintf("runs on the CPU-time clock of process %d, another process", owner)
		}
	}
	return ""
}

// recordTimers asks the stopped process how long each of its timers has left.
// Precondition: inside Do.
func recordTimers(t *remote.Tracee, tmpl *Template) error {
	// One batch: getitimer of each kind, timer_gettime of each POSIX timer.
	var b remote.Batch
	var its []*remote.Out
	for which := range itimerKinds {
		o := b.Out(int(unsafe.Sizeof(unix.Itimerval{})))
		b.Add(fmt.Sprintf("getitimer(%s)", itimerKinds[which]), unix.SYS_GETITIMER, which, o)
		its = append(its, o)
	}
	var ts []*remote.Out
	for i := range tmpl.Timers {
		o := b.Out(int(unsafe.Sizeof(unix.ItimerSpec{})))
		b.Add(fmt.Sprintf("timer_gettime(%d)", tmpl.Timers[i].ID), unix.SYS_TIMER_GETTIME, tmpl.Timers[i].ID, o)
		ts = append(ts, o)
	}
	if _, err := t.RunBatch(&b); err != nil {
		return err
	}
	for which, o := range its {
		tmpl.Itimers[which] = *(*unix.Itimerval)(unsafe.Pointer(&o.Bytes()[0]))
	}
	for i, o := range ts {
		tmpl.Timers[i].Setting = *(*unix.ItimerSpec)(unsafe.Pointer(&o.Bytes()[0]))
	}
	return nil
}

// rearm gives the restored child the timers the process had at the checkpoint.
// Precondition: inside Do.
func rearm(c *remote.Tracee, tmpl *Template) error {
	for which, v := range tmpl.Itimers {
		if v.Value == (unix.Timeval{}) {
			continue // disarmed (an armed one reads at least 1 us)
		}
		if which != unix.ITIMER_REAL {
			tick, err := cpuTimerTick(c)
			if err != nil {
				return err
			}
			if left := v.Value.Nano() - tick; left > 1000 {
				v.Value = unix.NsecToTimeval(left)
			}
		}
		if _, err := c.Setitimer(which, v); err != nil {
			return fmt.Errorf("setitimer(%s): %w", itimerKinds[which], err)
		}
	}
	if len(tmpl.Timers) == 0 {
		return nil
	}
	if _, err := c.Prctl(unix.PR_TIMER_CREATE_RESTORE_IDS, unix.PR_TIMER_CREATE_RESTORE_IDS_ON, 0, 0, 0); err != nil {
		return fmt.Errorf("prctl(PR_TIMER_CREATE_RESTORE_IDS): %w", err)
	}
	for _, tm := range tmpl.Timers {
		ev := remote.Sigevent{Value: tm.Value, Signo: tm.Signo, Notify: tm.Notify}
		if tm.Notify&remote.SigevThreadID != 0 {
			ev.Tid = int32(tmpl.Pid) // the one thread, whose tid set_tid kept
		}
		id, err := c.TimerCreate(tm.Clock, ev, tm.ID)
		if err != nil {
			return fmt.Errorf("re-create POSIX timer %d: %w", tm.ID, err)
		}
		if id != tm.ID {
			return fmt.Errorf("re-create POSIX timer %d: got id %d", tm.ID, id)
		}
		switch {
		case tm.Pending:
			now, err := c.ClockGettime(tm.Clock)
			if err != nil {
				return fmt.Errorf("clock_gettime(%d) for POSIX timer %d: %w", tm.Clock, tm.ID, err)
			}
			at := now.Nano() + tm.Setting.Value.Nano() - tm.Setting.Interval.Nano()
			if at < 1 {
				at = 1 // a fresh CPU-time clock: as early as it can be, still past
			}
			v := unix.ItimerSpec{Interval: tm.Setting.Interval, Value: unix.NsecToTimespec(at)}
			if _, err := c.TimerSettime(id, unix.TIMER_ABSTIME, v); err != nil {
				return fmt.Errorf("arm POSIX timer %d: %w", tm.ID, err)
			}
		case tm.Setting.Value != (unix.Timespec{}):
			if _, err := c.TimerSettime(id, 0, tm.Setting); err != nil {
				return fmt.Errorf("arm POSIX timer %d: %w", tm.ID, err)
			}
		}
	}
	if _, err := c.Prctl(unix.PR_TIMER_CREATE_RESTORE_IDS, unix.PR_TIMER_CREATE_RESTORE_IDS_OFF, 0, 0, 0); err != nil {
		return fmt.Errorf("prctl(PR_TIMER_CREATE_RESTORE_IDS off): %w", err)
	}
	return nil
}
