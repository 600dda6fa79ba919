package fastpath

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strconv"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/errdefs"
	"deltabox/internal/procfs"
	"deltabox/internal/remote"
)

// A template outlives the daemon that made it. The tracer that forked it keeps it in a
// ptrace-stop with a SIGSTOP queued (Template.tr); when that tracer's thread exits (the
// daemon killed, or Tracer.Close) the kernel detaches it (__ptrace_unlink), wakes it
// once, and it takes the queued SIGSTOP into a group stop (state T) before returning to
// user space: it ran kernel code only (TestReattachDetachedTemplateIsGroupStopped
// measures this). A TemplateRecord, written in the index with its node, lets the next
// daemon find it and seize it again (Reattach), after checking that it is the same
// process (PID and start time) and that it never ran an instruction of its own since the
// record was taken (its scheduler counters). The record is read on demand (Record), not
// at every parking: nothing is added to a checkpoint's or a restore's critical path, and
// the counters of a template held in its ptrace-stop do not move between the two.
//
// Why the counters prove it. A task in a ptrace-stop is never scheduled (a signal other
// than SIGKILL does not wake a TASK_TRACED task), so its counters are fixed from its
// parking on: /proc/PID/schedstat's third field (sched_info.pcount, the times it was
// scheduled in) and /proc/PID/status's voluntary_ctxt_switches (the times it went to
// sleep). The tracer's death wakes it once and it sleeps once, in its group stop:
// one more voluntary switch, one more run (measured: 40 of 40 detaches; a preemption on
// the way adds a run and an involuntary switch, seen about once in 10 detaches in a
// tight benchmark loop). A SIGCONT from inside the sandbox while nobody traces it wakes
// it from the group stop and it runs its own code; to be found stopped again it must
// have gone to sleep again (a second voluntary switch), or it is found not stopped.
// So: state T, at most detachSleeps voluntary switches more than recorded, and no run
// more than those and the preemptions explain. The only way to run user code within
// those counts is a SIGCONT that arrives in the microseconds between the tracer's death
// and the template's wake-up, followed by a SIGSTOP before the template first blocks;
// the runtime bound (detachRuntime) narrows that further. A template refused for having
// run is killed: its process state is no longer the checkpoint's.

// detachSleeps is how many times a template may have gone to sleep since it was parked
// and still be known not to have run: into its group stop, after the tracer's detach.
const detachSleeps = 1

// detachRuntime bounds the CPU time the detach's wake-up may cost (kernel only: return
// from ptrace_stop, dequeue SIGSTOP, do_signal_stop). Measured at 5-20 us on these VMs
// (TestReattachRevive logs it); 2 ms leaves room for a loaded
// host and is still far less than a program's run after a SIGCONT usually takes.
const detachRuntime = 2 * time.Millisecond

// ErrTemplateGone is returned by Reattach for a template that is no longer there (its
// PID is free or now another process's): nothing was done to the process at that PID.
var ErrTemplateGone = errors.New("the template is gone")

// ErrTemplateRan is returned by Reattach for a template that ran since it was parked (a
// SIGCONT reached it while no daemon held it): it was killed.
var ErrTemplateRan = errors.New("the template ran since its checkpoint")

// parkMark is what a template's scheduler counters read when its record was taken, while
// its tracer held it: the reference of Reattach's check.
type parkMark struct {
	Runtime     uint64 // /proc/PID/schedstat field 1: ns spent on a CPU
	Runs        uint64 // /proc/PID/schedstat field 3: times scheduled in
	Voluntary   uint64 // /proc/PID/status voluntary_ctxt_switches: times it slept
	Involuntary uint64 // /proc/PID/status nonvoluntary_ctxt_switches: preemptions
}

// TemplateRecord is what the next daemon needs to take a template back and revive from
// it exactly as the daemon that forked it would: everything in Template, and the
// template's identity. It is encoded as JSON (encoding/json: every field is exported and
// round-trips; TestTemplateRecordRoundTrip).
type TemplateRecord struct {
	Proc     Proc                   // the process at the checkpoint: fds, mappings, POSIX timers
	HostPid  int                    // the template's PID on the host
	SelfPid  int                    // the template's PID in the sandbox
	Start    uint64                 // /proc/PID/stat field 22 (starttime, clock ticks since boot)
	Mark     parkMark               // its counters when the record was taken
	Syscall  uint64                 // a syscall instruction's address in it (Template.sc)
	Itimers  [3]unix.Itimerval      // Template.Itimers
	Signals  []remote.PendingSignal // Template.Signals
	Dumpable uintptr                // Template.Dumpable
}

// Record returns t's record, its counters read now, on its tracer's thread: there the
// template is in its ptrace-stop (state t) and not being revived, so they are those of
// its last parking. A template's record must be taken again after each revive from it
// (the clone ran in it, in the kernel) and after a Reattach.
func (t *Template) Record() (TemplateRecord, error) {
	var id identity
	err := t.tr.Do(func() error {
		var err error
		if id, err = readIdentity(t.HostPid); err != nil {
			return err
		}
		if id.state != 't' {
			return fmt.Errorf("state %c, not in its tracer's stop", id.state)
		}
		return nil
	})
	if err != nil {
		return TemplateRecord{}, fmt.Errorf("record template %d: %w", t.HostPid, err)
	}
	return TemplateRecord{
		Proc: t.Proc, HostPid: t.HostPid, SelfPid: t.SelfPid, Start: id.start,
		Mark: id.mark, Syscall: uint64(t.sc),
		Itimers: t.Itimers, Signals: t.Signals, Dumpable: t.Dumpable,
	}, nil
}

// identity is what /proc says of a process for Reattach.
type identity struct {
	state byte
	start uint64
	mark  parkMark
}

// readIdentity reads /proc/pid/stat (state, field 3; starttime, field 22),
// /proc/pid/schedstat and the context switch counts of /proc/pid/status.
func readIdentity(pid int) (identity, error) {
	var id identity
	base := "/proc/" + strconv.Itoa(pid)
	f, err := procfs.Stat(pid)
	if err != nil {
		return id, err
	}
	if len(f) < 20 {
		return id, fmt.Errorf("%s/stat: %d fields", base, len(f)+2)
	}
	id.state = f[0][0]
	if id.start, err = strconv.ParseUint(string(f[19]), 10, 64); err != nil {
		return id, fmt.Errorf("%s/stat: starttime: %w", base, err)
	}
	b, err := os.ReadFile(base + "/schedstat")
	if err != nil {
		return id, fmt.Errorf("%w (schedstat needs CONFIG_SCHED_INFO)", err)
	}
	s := bytes.Fields(b)
	if len(s) != 3 {
		return id, fmt.Errorf("%s/schedstat: %q", base, b)
	}
	if id.mark.Runtime, err = strconv.ParseUint(string(s[0]), 10, 64); err == nil {
		id.mark.Runs, err = strconv.ParseUint(string(s[2]), 10, 64)
	}
	if err != nil {
		return id, fmt.Errorf("%s/schedstat: %w", base, err)
	}
	if b, err = os.ReadFile(base + "/status"); err != nil {
		return id, err
	}
	if id.mark.Voluntary, err = procfs.StatusUint(b, "voluntary_ctxt_switches"); err == nil {
		id.mark.Involuntary, err = procfs.StatusUint(b, "nonvoluntary_ctxt_switches")
	}
	if err != nil {
		return id, fmt.Errorf("%s/status: %w", base, err)
	}
	return id, nil
}

// Reattach takes back, with tr, the template rec describes, left by a daemon that died
// (or closed its Tracer): it checks that the process at rec.HostPid is that template
// (start time, else ErrTemplateGone, and the process is left alone) and that it did not
// run since it was parked (stopped, scheduler counters: else ErrTemplateRan, and it is
// killed), seizes it (the options Hold and SeizeTemplate use, PTRACE_O_SUSPEND_SECCOMP
// included), checks that it was seized in its group stop, and parks it again in a
// ptrace-stop with SIGSTOP queued (remote.Tracee.KeepStopped), as Fork left it: Revive
// works on the result as on a template that never left its tracer. Both errors are
// conflicts (errdefs.ErrConflict): that node's process state is lost.
func Reattach(tr *remote.Tracer, rec TemplateRecord) (*Template, error) {
	pid := rec.HostPid
	gone := func(why string) error {
		return fmt.Errorf("template %d of process %d: %s: %w (%w)", pid, rec.Proc.Pid, why, ErrTemplateGone, errdefs.ErrConflict)
	}
	// The pidfd is opened before the start time is read: if they agree, it names the
	// template, and a kill through it cannot reach a process that took the PID since
	// (a kill by PID could: the sandbox can end a template that ran and fork until the
	// PID comes round again).
	pidfd, err := unix.PidfdOpen(pid, 0)
	if errors.Is(err, unix.ESRCH) {
		return nil, gone("no such process")
	} else if err != nil {
		return nil, fmt.Errorf("reattach template %d: pidfd_open: %w", pid, err)
	}
	defer unix.Close(pidfd)
	ran := func(why string) error {
		_ = unix.PidfdSendSignal(pidfd, unix.SIGKILL, nil, 0) // ESRCH: gone already
		return fmt.Errorf("template %d of process %d: %s; killed: %w (%w)", pid, rec.Proc.Pid, why, ErrTemplateRan, errdefs.ErrConflict)
	}
	id, err := readIdentity(pid)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return nil, gone("no such process")
	case err != nil:
		return nil, fmt.Errorf("reattach template %d: %w", pid, err)
	case id.start != rec.Start:
		return nil, gone(fmt.Sprintf("pid reused (start time %d, recorded %d)", id.start, rec.Start))
	case id.state == 'Z' || id.state == 'X':
		return nil, gone("it exited")
	case id.state != 'T':
		return nil, ran(fmt.Sprintf("found in state %c, not stopped", id.state))
	}
	if err := ranSince(rec, id.mark); err != nil {
		return nil, ran(err.Error())
	}
	tmpl := &Template{Proc: rec.Proc, HostPid: pid, SelfPid: rec.SelfPid, sc: uintptr(rec.Syscall), tr: tr,
		Itimers: rec.Itimers, Signals: rec.Signals, Dumpable: rec.Dumpable}
	err = tr.Do(func() error {
		t, err := tr.Seize(pid)
		if err != nil {
			return fmt.Errorf("seize template %d: %w", pid, err)
		}
		// Seized: it can no longer exit unseen, so its PID cannot be reused from here on.
		after, err := readIdentity(pid)
		if err == nil && after.start != rec.Start {
			err = fmt.Errorf("pid reused while seizing (start time %d, recorded %d)", after.start, rec.Start)
		}
		if err != nil {
			_ = t.Detach() // not the template: its identity check's error is the one reported
			return gone(err.Error())
		}
		// In a group stop the interrupt trap carries the stop signal: a SIGCONT between
		// the check above and the seize would have ended it.
		if !t.WasStopped() {
			kerr := t.Kill()
			return errors.Join(ran("seized out of its group stop (continued meanwhile)"), kerr)
		}
		if rec.Syscall != 0 {
			if err := t.UseSyscallAddr(uintptr(rec.Syscall)); err != nil {
				kerr := t.Kill()
				return errors.Join(fmt.Errorf("template %d: recorded syscall address %#x: %w", pid, rec.Syscall, err), kerr)
			}
		}
		if err := t.KeepStopped(); err != nil {
			kerr := t.Kill()
			return errors.Join(fmt.Errorf("park template %d again: %w", pid, err), kerr)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	tmpl.watchExit()
	return tmpl, nil
}

// ranSince says why counters now show that a template parked at rec ran, or nil.
func ranSince(rec TemplateRecord, now parkMark) error {
	was := rec.Mark
	sleeps, preempted := now.Voluntary-was.Voluntary, now.Involuntary-was.Involuntary
	switch {
	case now.Voluntary < was.Voluntary || now.Involuntary < was.Involuntary || now.Runs < was.Runs || now.Runtime < was.Runtime:
		return fmt.Errorf("its counters went back (%+v, recorded %+v)", now, was)
	case sleeps > detachSleeps:
		return fmt.Errorf("it went to sleep %d times since it was parked (a detach accounts for %d)", sleeps, detachSleeps)
	case now.Runs-was.Runs > sleeps+preempted:
		return fmt.Errorf("scheduled in %d times since it was parked, for %d sleeps and %d preemptions", now.Runs-was.Runs, sleeps, preempted)
	case now.Runtime-was.Runtime > uint64(detachRuntime):
		return fmt.Errorf("%v on a CPU since it was parked (a detach accounts for under %v)", time.Duration(now.Runtime-was.Runtime), detachRuntime)
	}
	return nil
}
