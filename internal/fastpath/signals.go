package fastpath

import (
	"strconv"

	"golang.org/x/sys/unix"

	"deltabox/internal/remote"
)

// Pending signals. fork(2) clears the child's pending signals, both its thread's queue
// and its process's (the shared queue of the new signal_struct); handlers and the signal
// mask are copied. A signal pending at the checkpoint (typically a blocked one, which
// stays pending until the program unblocks it) would be missing in every restored
// process.
//
// At a checkpoint, right after the fork, the pending signals are read whole without
// dequeuing them (PTRACE_PEEKSIGINFO on the stopped live process, thread's queue and
// process's, in order), with those package remote took from the process while injecting
// (a signal that was deliverable then: remote hands it back to the live process at
// detach) and, for a standard signal pending without a queue entry (sent while
// RLIMIT_SIGPENDING was exhausted), the siginfo the kernel would deliver for it
// (SI_USER from pid 0). At each restore the new child queues each of them to itself, last
// before it resumes, with its original siginfo (rt_tgsigqueueinfo for its thread's,
// rt_sigqueueinfo for the process's: a process may queue any si_code to itself). Sender
// pid and uid, si_code and si_value are kept, real-time signals keep their order and
// count, and a blocked signal is still pending until unblocked.
//
// Exceptions: a POSIX timer's own signal is re-made by its timer (timers.go), since a
// copy would not re-arm a periodic timer on delivery; a timer signal whose timer no longer
// exists is dropped, as the kernel drops it at delivery. SIGKILL and SIGSTOP are not
// carried (a process being killed or stopped during the checkpoint).

// siTimer is SI_TIMER, the si_code of a POSIX timer's signal.
const siTimer = -2

// pendingSignals returns the signals pending for the stopped process at its fork, and
// marks in timers those whose own signal is among them. masks are its SigPnd and ShdPnd
// (read while it was stopped: a standard signal pending without a queue entry shows
// only there). Precondition: inside Do, t stopped since the fork.
func pendingSignals(t *remote.Tracee, masks [2]uint64, timers []PosixTimer) ([]remote.PendingSignal, error) {
	var out []remote.PendingSignal
	for _, si := range t.HeldSignals() {
		out = append(out, remote.PendingSignal{Info: si})
	}
	queued, err := t.PendingSignals()
	if err != nil {
		return nil, err
	}
	var seen [2]uint64 // signals with a queue entry: [thread, process]
	for _, s := range queued {
		sig := s.Info.Signo()
		if sig < 1 || sig > 64 {
			continue
		}
		q := 0
		if s.Shared {
			q = 1
		}
		seen[q] |= 1 << (sig - 1)
		if s.Info.Code() == siTimer {
			i := timerOf(timers, &s.Info)
			if i < 0 {
				continue // its timer is gone: the kernel would drop it at delivery
			}
			if !timers[i].Pending {
				timers[i].Pending = true // re-made by the timer
				continue
			}
			// A second one for the same timer is a copy someone queued: kept as such.
		}
		out = append(out, s)
	}
	for q, mask := range masks {
		for sig := 1; sig <= 64; sig++ {
			if mask&(1<<(sig-1)) != 0 && seen[q]&(1<<(sig-1)) == 0 {
				out = append(out, remote.PendingSignal{Info: bare(sig), Shared: q == 1})
			}
		}
	}
	keep := out[:0]
	for _, s := range out {
		if sig := unix.Signal(s.Info.Signo()); sig != unix.SIGKILL && sig != unix.SIGSTOP {
			keep = append(keep, s)
		}
	}
	return keep, nil
}

// parsePending reads a SigPnd or ShdPnd line of /proc/PID/status (split in fields) into
// masks [thread, process].
func parsePending(f []string, masks *[2]uint64) {
	if len(f) != 2 || (f[0] != "SigPnd:" && f[0] != "ShdPnd:") {
		return
	}
	v, err := strconv.ParseUint(f[1], 16, 64)
	if err != nil {
		return
	}
	if f[0] == "SigPnd:" {
		masks[0] = v
	} else {
		masks[1] = v
	}
}

// timerOf returns the index in timers of the timer whose signal si is, or -1.
func timerOf(timers []PosixTimer, si *remote.Siginfo) int {
	for i := range timers {
		if timers[i].ID == si.TimerID() && int(timers[i].Signo) == si.Signo() {
			return i
		}
	}
	return -1
}

// bare is the siginfo the kernel delivers for a signal pending without a queue entry.
func bare(sig int) remote.Siginfo {
	var si remote.Siginfo
	si[0] = byte(sig) // si_signo; si_errno, si_code (SI_USER), si_pid, si_uid: 0
	return si
}
