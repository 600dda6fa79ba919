package fastpath

import (
	"errors"
	"fmt"
	"strconv"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/procfs"
	"deltabox/internal/remote"
)

// The state manager makes a checkpoint or a restore of files and processes one atomic
// step, so it takes a process through phases that can each be undone until the step is
// published (internal/state/checkpoint.go and restore.go number them):
//
//	checkpoint: Hold (seize, inspect) -> Fork (the template) -> ... files ... ->
//	            Move (onto the new state) -> Release (resume);
//	            undo, in reverse: MoveBack, DropTemplate, Release: the process is exactly
//	            as it was (same open file descriptions, namespace and cwd), and it ran no
//	            instruction of its own in between.
//	restore:    SeizeTemplate -> ... EndLive (the live process) ... -> Revive (fork
//	            with its PID, moved, terminal) -> Commit (resume); undo: Abort (kill the
//	            revived child, the template stays as it was).

// Held is a live process seized for a checkpoint. From Hold to Release it executes only
// injected syscalls, none of its own code.
type Held struct {
	P    *Proc
	Tmpl *Template // set by Fork

	Times HoldTimes // Hold's parts

	tr     *remote.Tracer
	t      *remote.Tracee
	moved  bool // Move started: MoveBack has something to undo
	killed bool // MoveBack failed and killed it
}

// Hold seizes the process hostPid and inspects it while it is stopped (so that what is
// inspected is what is forked), in one hand-off to the tracer's thread. An ineligible
// process is let go untouched and the error is an *Ineligible.
func Hold(tr *remote.Tracer, hostPid int) (*Held, error) {
	var h *Held
	var times HoldTimes
	t0 := time.Now()
	var t3 time.Time
	err := tr.Do(func() error {
		t1 := time.Now()
		times.Handoff = t1.Sub(t0)
		t, err := tr.Seize(hostPid)
		if err != nil {
			return seizeRefusal(hostPid, err)
		}
		t2 := time.Now()
		times.Seize = t2.Sub(t1)
		probe := probeMayWrite(t)
		p, err := inspect(hostPid, func(start, end uint64, prot int) (bool, error) {
			tp := time.Now()
			defer func() { times.Probe += time.Since(tp) }()
			return probe(start, end, prot)
		}, lookupIn(t))
		t3 = time.Now()
		times.Inspect = t3.Sub(t2)
		if err != nil {
			if derr := t.Detach(); derr != nil {
				err = errors.Join(err, derr)
			}
			return err
		}
		h = &Held{P: p, tr: tr, t: t}
		return nil
	})
	if h != nil {
		times.Handoff += time.Since(t3)
		h.Times = times
	}
	return h, err
}

// HoldTimes are where Hold's time went, for the checkpoint's phases: the hand-offs to
// the tracer's thread and back, the seizure (PTRACE_SEIZE, the interrupt stop, the
// /proc/PID/stat reads around it), the inspection, and of it the injected probes of
// read-only shared mappings (probeMayWrite).
type HoldTimes struct {
	Handoff, Seize, Inspect, Probe time.Duration
}

// seizeRefusal turns what remote.Tracer.Seize refuses about the process itself into an
// *Ineligible (a refusal, not a failure of the daemon), named by the process's PID in
// its own namespace; other errors stay as they are.
func seizeRefusal(hostPid int, err error) error {
	var reason string
	switch {
	case errors.Is(err, remote.ErrMultiThreaded):
		reason = "it has more than one thread, and a fork copies only one (set OMP_NUM_THREADS/OPENBLAS_NUM_THREADS=1, or end the threads before the checkpoint)"
	case errors.Is(err, remote.ErrUninterruptible):
		reason = "it stays in uninterruptible sleep (a vfork parent, a hung device or filesystem); try again once it returns"
	default:
		return fmt.Errorf("seize %d: %w", hostPid, err)
	}
	pid, perr := procfs.InnerPid(hostPid)
	if perr != nil {
		return fmt.Errorf("seize %d: %w", hostPid, err) // gone meanwhile
	}
	return &Ineligible{Pid: pid, Reason: reason, CRIU: errors.Is(err, remote.ErrMultiThreaded)}
}

// Fork forks the held process into its template: the child calls setsid (so the live
// PID's session can end with the live process) and is kept seized in a ptrace-stop with
// a SIGSTOP queued (remote.Tracee.KeepStopped; Template.tr says why).
// The template is on the state the process is on (nothing has moved yet). On error no
// template exists; a template that did not get all of the process's memory
// (MADV_DONTFORK, MADV_WIPEONFORK: checkForkCopy) is an *Ineligible.
func (h *Held) Fork() (*Template, error) {
	tmpl := &Template{Proc: *h.P, tr: h.tr}
	var child *remote.Tracee
	err := h.tr.Do(func() error {
		// What fork will not copy (timers.go, signals.go) is read around it.
		if err := recordLive(h.t, tmpl); err != nil {
			return fmt.Errorf("process %d: %w", h.P.Pid, err)
		}
		var err error
		if child, err = h.t.Clone3(remote.CloneArgs{Flags: unix.CLONE_PARENT}); err != nil {
			return fmt.Errorf("fork the template of %d: %w", h.P.Pid, err)
		}
		// Memory the fork did not copy (MADV_DONTFORK) or wiped (MADV_WIPEONFORK):
		// read from /proc before anything is injected into either (forkcopy.go).
		if err := checkForkCopy(h.P, child.Pid()); err != nil {
			return err
		}
		if err := recordForked(h.t, tmpl); err != nil {
			return fmt.Errorf("process %d: %w", h.P.Pid, err)
		}
		if _, err := child.Setsid(); err != nil {
			return fmt.Errorf("template setsid: %w", err)
		}
		if tmpl.Dumpable, err = child.Prctl(unix.PR_GET_DUMPABLE, 0, 0, 0, 0); err != nil {
			return fmt.Errorf("template PR_GET_DUMPABLE: %w", err)
		}
		if _, err := child.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0); err != nil {
			return fmt.Errorf("template not dumpable (Template.Dumpable): %w", err)
		}
		// SelfPid is the template's PID as the live process sees it (MoveBack opens its
		// /proc entries from there; the sandbox's PID namespace).
		tmpl.HostPid, tmpl.SelfPid, tmpl.sc = child.Pid(), child.ClonedAs(), child.SyscallAddr()
		// Kept seized from birth (Template.tr says why), SIGSTOP queued for a detach.
		if err := child.KeepStopped(); err != nil {
			kerr := child.Kill()
			child = nil
			return errors.Join(fmt.Errorf("park the template of %d: %w", h.P.Pid, err), kerr)
		}
		return nil
	})
	if err != nil {
		if child != nil {
			_ = child.Kill() // a fresh child: Kill fails only if it is gone already
		}
		return nil, err
	}
	tmpl.watchExit()
	h.Tmpl = tmpl
	return tmpl, nil
}

// Move puts the held process onto the state whose namespace is ns (the daemon's fd)
// (setns, chdir, every file and directory fd reopened at the same offset and flags), so
// that it shares no open file description with its template. On error it is moved
// back (MoveBack) before Move returns, or killed if even that fails (the error says so).
func (h *Held) Move(ns int) error {
	h.moved = true
	err := h.tr.Do(func() error { return move(h.t, h.P, ns) })
	if err == nil {
		return nil
	}
	if berr := h.MoveBack(); berr != nil {
		return fmt.Errorf("move %d: %w; moving it back: %v", h.P.Pid, err, berr)
	}
	return fmt.Errorf("move %d: %w", h.P.Pid, err)
}

// MoveBack undoes Move exactly: the process re-enters its template's mount namespace
// and working directory (the ones it had: the template forked before the move and never
// ran), and takes back, with pidfd_getfd, the very open file descriptions it shared
// with the template, at the same fd numbers. If that fails the process is killed: it is
// never left half-moved. Precondition: the template is alive (it is killed after).
func (h *Held) MoveBack() error {
	if !h.moved {
		return nil
	}
	if h.Tmpl == nil {
		kerr := h.t.Kill()
		return errors.Join(fmt.Errorf("process %d was moved without a template to move back from: killed", h.P.Pid), kerr)
	}
	base := "/proc/" + strconv.Itoa(h.Tmpl.SelfPid)
	tt, err := holdTemplate(h.tr, h.Tmpl)
	if err != nil {
		kerr := h.t.Kill()
		h.killed = true
		return errors.Join(fmt.Errorf("%w: process %d killed rather than left half-moved", err, h.P.Pid), kerr)
	}
	err = h.tr.Do(func() error {
		// The process reads its template's /proc entries below: the template is made
		// dumpable again for that (Template.Dumpable). No code of the sandbox runs
		// meanwhile (this is the undo of a checkpoint, every process held or ended),
		// and the template is killed after (DropTemplate).
		if _, err := tt.Prctl(unix.PR_SET_DUMPABLE, 1, 0, 0, 0); err != nil {
			return fmt.Errorf("template dumpable for the move back: %w", err)
		}
		ns, err := h.t.Open(base+"/ns/mnt", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("open the template's namespace: %w", err)
		}
		err = h.t.Setns(ns, unix.CLONE_NEWNS)
		_ = h.t.Close(ns) // a failed injected close kills the tracee (remote)
		if err != nil {
			return fmt.Errorf("setns back: %w", err)
		}
		if err := h.t.Chdir(base + "/cwd"); err != nil {
			return fmt.Errorf("chdir back: %w", err)
		}
		// Shared mappings: the files the template still maps (mappings.go).
		if err := remapBack(h.t, h.P.Maps, h.Tmpl.SelfPid); err != nil {
			return fmt.Errorf("map back: %w", err)
		}
		var files []FD
		for _, f := range h.P.FDs {
			if reopened(f.Kind) {
				files = append(files, f)
			}
		}
		if len(files) == 0 {
			return nil
		}
		pfd, err := h.t.Syscall(unix.SYS_PIDFD_OPEN, uintptr(h.Tmpl.SelfPid), 0)
		if err != nil {
			return fmt.Errorf("pidfd_open of the template: %w", err)
		}
		defer func() { _ = h.t.Close(int(pfd)) }() // a failed injected close kills the tracee (remote)
		for _, f := range files {
			nfd, err := h.t.Syscall(unix.SYS_PIDFD_GETFD, pfd, uintptr(f.Num), 0)
			if err != nil {
				return fmt.Errorf("take back fd %d: %w", f.Num, err)
			}
			err = h.t.Dup3(int(nfd), f.Num, f.Flags&unix.O_CLOEXEC)
			_ = h.t.Close(int(nfd)) // a failed injected close kills the tracee (remote)
			if err != nil {
				return fmt.Errorf("dup3 fd %d back: %w", f.Num, err)
			}
		}
		// Every lock is set again once every fd is back (locks.go): the POSIX ones,
		// which the move's dup3s dropped, and the flock and OFD ones, which the move
		// released from these very descriptions (again on a description that kept one
		// is a no-op).
		var b remote.Batch
		if lockCalls(&b, h.P); b.Len() > 0 {
			if _, err := h.t.RunBatch(&b); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		kerr := h.t.Kill()
		h.killed = true
		return errors.Join(fmt.Errorf("%w: process %d killed rather than left half-moved", err, h.P.Pid), kerr)
	}
	h.moved = false
	return nil
}

// DropTemplate kills the template Fork made, if any (the undo of Fork). Precondition:
// MoveBack is done or was not needed: it takes the open file descriptions back from the
// template.
func (h *Held) DropTemplate() {
	if h.Tmpl != nil {
		h.Tmpl.Kill()
		h.Tmpl = nil
	}
}

// Release lets the held process go (registers and scratch memory restored): it resumes
// where it was, on whatever state it was moved to.
func (h *Held) Release() error {
	if h.killed {
		return fmt.Errorf("process %d was killed", h.P.Pid)
	}
	return h.t.Detach()
}

// Killed reports whether MoveBack had to kill the process.
func (h *Held) Killed() bool { return h.killed }

// Undo moves the held process back (MoveBack) and kills its template, leaving it seized:
// Release then lets it run exactly as it was. If it could not be moved back it was
// killed, and Undo says so.
func (h *Held) Undo() error {
	err := h.MoveBack()
	h.DropTemplate()
	return err
}

// Abort is Undo then Release.
func (h *Held) Abort() error {
	if err := h.Undo(); err != nil {
		return err
	}
	return h.Release()
}

// WaitStopped reports whether the template is there, waiting up to d for it to be back in
// its stop. A template its tracer resumes for an injection (a fork from it, Park) runs
// in the kernel until it stops again, and is not seen stopped meanwhile (Alive is false):
// on a loaded machine that lasts milliseconds. One that has exited is gone at once.
func (t *Template) WaitStopped(d time.Duration) bool {
	deadline := time.Now().Add(d)
	for {
		if t.collected() {
			return false
		}
		switch s := procfs.State(t.HostPid); {
		case s == 'T' || s == 't':
			return true
		case s == 0 || s == 'Z' || s == 'X' || time.Now().After(deadline):
			return false
		}
		time.Sleep(200 * time.Microsecond)
	}
}

// Revival is a template seized for a restore.
type Revival struct {
	Tmpl    *Template
	tr      *remote.Tracer
	tt      *remote.Tracee // the template, while seized
	child   *remote.Tracee // the revived process, until Commit
	HostPid int            // the revived process's host PID
}

// SeizeTemplate takes tmpl from tr, which holds it from its fork on (it is seized again
// only if tr let it go: a Tracer closed and made anew): it stays in its stop and runs
// nothing. This checks, before anything irreversible, that the template is there and can
// be forked.
func SeizeTemplate(tr *remote.Tracer, tmpl *Template) (*Revival, error) {
	if !tmpl.WaitStopped(time.Second) {
		tr.Forget(tmpl.HostPid) // a zombie while traced: collect it
		return nil, fmt.Errorf("the template (pid %d) is gone", tmpl.Pid)
	}
	t, err := holdTemplate(tr, tmpl)
	if err != nil {
		return nil, err
	}
	return &Revival{Tmpl: tmpl, tr: tr, tt: t}, nil
}

// holdTemplate returns tmpl seized by tr: the tracee tr holds, or a new seizure.
func holdTemplate(tr *remote.Tracer, tmpl *Template) (*remote.Tracee, error) {
	var t *remote.Tracee
	err := tr.Do(func() error {
		if t = tr.Attached(tmpl.HostPid); t != nil {
			return nil
		}
		var err error
		if t, err = tr.Seize(tmpl.HostPid); err != nil {
			return fmt.Errorf("seize the template: %w", err)
		}
		if tmpl.sc != 0 {
			_ = t.UseSyscallAddr(tmpl.sc) // a hint: refused, the tracee finds its own
		}
		return nil
	})
	return t, err
}

// Revive forks the template into a process with the PID the live process had (which
// must be free: killed and reaped), moves it onto the state whose namespace is ns and gives it
// ptyPath as its session's controlling terminal. The process stays stopped (traced)
// until Commit; the template is parked again. On error the child is killed and the
// template parked as it was.
func (r *Revival) Revive(ns int, ptyPath string) error {
	var child *remote.Tracee
	err := r.tr.Do(func() error {
		var err error
		child, err = r.fork(ns, ptyPath)
		// The template is put back as it was in the same hand-off, still held.
		if perr := r.tt.Restore(); err == nil && perr != nil {
			err = fmt.Errorf("put the template back: %w", perr)
		}
		return err
	})
	r.tt = nil
	if err != nil {
		if child != nil {
			_ = child.Kill() // a fresh child: Kill fails only if it is gone already
		}
		return err
	}
	r.child, r.HostPid = child, child.Pid()
	return nil
}

// cloneRetries bounds cloneAt's tries again: 8, 1 ms apart doubling, 0.26 s in all.
const cloneRetries = 8

// cloneAt forks tt (CLONE_PARENT) into its current PID namespace at pid, again while
// clone3 answers EEXIST, a bounded number of times. A PID just reaped is freed after
// the reaping thread drops tasklist_lock (since Linux 6.15, release_task's free_pid
// runs outside it), and on a loaded machine that thread can be preempted between the
// two for milliseconds: clone3's set_tid of that PID fails with EEXIST meanwhile (the
// CRIU path's case: internal/state/durable.go's restoreFreeingPid). Seen in bench rl at
// B = 64 at load average 20-50, a restore after its processes were ended and reaped. A
// failed clone3 makes nothing, so trying again is safe; a PID a live process holds
// fails after the tries. Precondition: inside the tracer's Do.
func cloneAt(tt *remote.Tracee, pid int) (*remote.Tracee, error) {
	delay := time.Millisecond
	for attempt := 0; ; attempt++ {
		child, err := tt.Clone3(remote.CloneArgs{Flags: unix.CLONE_PARENT, SetTID: []int{pid}})
		if err == nil || !errors.Is(err, unix.EEXIST) || attempt == cloneRetries {
			return child, err
		}
		time.Sleep(delay)
		delay *= 2
	}
}

// fork is Revive's work on the tracer's thread; the child, if made, is returned with
// the error. Precondition: inside Do.
func (r *Revival) fork(ns int, ptyPath string) (*remote.Tracee, error) {
	child, err := cloneAt(r.tt, r.Tmpl.Pid)
	if err != nil {
		return nil, fmt.Errorf("fork the template with pid %d: %w", r.Tmpl.Pid, err)
	}
	// Moved onto the state, a new session, the terminal: one batch.
	h, err := handFD(child, ns)
	if err != nil {
		return child, err
	}
	var b remote.Batch
	h.recvCalls(&b)
	maps := moveCalls(&b, &r.Tmpl.Proc, h.tx)
	dumpable := r.Tmpl.Dumpable
	if dumpable != 1 {
		dumpable = 0 // 2 (root-only, suid_dumpable) cannot be set by prctl: the stricter
	}
	b.Add("dumpable as it was", unix.SYS_PRCTL, unix.PR_SET_DUMPABLE, dumpable, 0, 0, 0)
	b.Add("setsid", unix.SYS_SETSID)
	terminalCalls(&b, &r.Tmpl.Proc, ptyPath)
	lockCalls(&b, &r.Tmpl.Proc)
	res, err := child.RunBatch(&b)
	if err != nil {
		h.cleanup(child)
		return child, err
	}
	if err := checkMaps(res, maps, r.Tmpl.Maps); err != nil {
		return child, err
	}
	// Timers and pending signals, last: Commit only lets it run.
	return child, giveBack(child, r.Tmpl)
}

// Commit lets the revived process run.
func (r *Revival) Commit() error {
	if r.child == nil {
		return errors.New("nothing revived")
	}
	err := r.child.Detach()
	r.child = nil
	return err
}

// Abort kills the revived process, if any, and parks the template as it was. Its error
// says what it could not: a template that could not be restored was killed (remote).
func (r *Revival) Abort() error {
	var errs []error
	if r.child != nil {
		errs = append(errs, r.child.Kill())
		r.child = nil
	}
	if r.tt != nil {
		errs = append(errs, r.tt.Restore()) // still held, as it was
		r.tt = nil
	}
	return errors.Join(errs...)
}

// HasTerminal reports whether the held process has a terminal among its fds.
func (h *Held) HasTerminal() bool {
	for _, f := range h.P.FDs {
		if f.Kind == "pty" {
			return true
		}
	}
	return false
}

// Ended is what EndLive did with one live process.
type Ended struct {
	HostPid int
	// Killed: the process is dead (its parent, the sandbox's init, reaps it).
	Killed bool
	// The holder of its address space (remote.HoldMM), when one could be made: host and
	// sandbox PIDs. It must be killed later (never resumed); its exit frees the memory.
	HolderHost, HolderPid int
	HolderErr             error // why no holder was made
}

// EndLive kills the live processes hostPids for a restore, each after giving its address
// space to a holder (remote.HoldMM: a stopped CLONE_VM sibling that never runs): the
// process's exit then skips exit_mmap (1.3-2 ms of freeing for a 63 MB python on these
// VMs, on the restore's critical path, since clone3 set_tid waits for the PID), and the
// holder, killed after the answer, frees the memory off that path. A process that cannot
// be given a holder is killed all the same (the holder is an optimisation: the process
// is being ended either way); one that cannot be seized is left (Killed false: the
// restore's kill-all ends it). One hand-off to the tracer's thread for all of them.
func EndLive(tr *remote.Tracer, hostPids []int) []Ended {
	out := make([]Ended, len(hostPids))
	_ = tr.Do(func() error { // fn never fails; a closed tracer leaves every Killed false, as said above
		for i, host := range hostPids {
			out[i].HostPid = host
			t, err := tr.Seize(host)
			if err != nil {
				continue
			}
			out[i].HolderHost, out[i].HolderPid, out[i].HolderErr = t.HoldMM()
			out[i].Killed = t.Kill() == nil
		}
		return nil
	})
	return out
}
