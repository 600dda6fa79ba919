package fastpath

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"

	"deltabox/internal/procfs"
	"deltabox/internal/remote"
)

// A durable image of a template is made from a copy of it. CRIU must seize the process it
// dumps, and a template is held by its tracer from its fork on (Template.tr); letting the
// template go for the dump (0.2-0.5 s for a 50 MB python) would make a restore to its
// node wait for the dump. So CopyTemplate forks the template (as Fork forks a live
// process: clone3 injected, CLONE_PARENT, setsid, not dumpable) into a copy that no one
// traces, left in a group stop, and the template goes back to its parking at once. The
// copy shares the template's memory copy-on-write (its cost is a fork's: page tables);
// the caller dumps it and kills it. An image restored later is such a copy: stopped,
// not traced, in the sandbox's PID namespace, and AdoptStopped makes it the node's
// template again. The copy's registers are the template's saved ones (the live
// process's at its checkpoint): the injected clone3 is undone in it before the detach.

// A Copy is a template's copy (CopyTemplate) held by a pidfd, by which it is ended:
// never by its PID. Its parent is the template's (CLONE_PARENT), the sandbox's init, which
// reaps it once it dies (CRIU kills it after its dump) and whose PID namespace may then
// give the PID to another process. Its fields are fixed when CopyTemplate returns; the
// holder calls Kill once, from any goroutine.
type Copy struct {
	Pid   int             // its host PID
	Self  int             // its PID in the sandbox's PID namespace
	Regs  unix.PtraceRegs // its registers when it was left (see CopyTemplate)
	pidfd int
}

// Kill ends the copy (SIGKILL through its pidfd; nothing happens if it is gone already)
// and closes the pidfd. The sandbox's init reaps it.
func (c *Copy) Kill() {
	_ = unix.PidfdSendSignal(c.pidfd, unix.SIGKILL, nil, 0) // ESRCH: gone already
	unix.Close(c.pidfd)
}

// CopyTemplate returns a stopped, untraced copy of tmpl (above), held by a pidfd, with
// its PID in the sandbox and the registers it was left with: an image of it whose
// registers differ, or that CRIU found running (durable.CheckCopyImage), is of a copy
// that a SIGCONT from the sandbox continued (it ends a group stop), not of the template.
// The caller ends it with Kill. If the pidfd cannot be opened (the copy is gone already,
// or no descriptor is free) the copy is left as it is and an error returned; if its PID in
// the sandbox cannot be read it is killed. Precondition: tmpl is not being revived
// meanwhile (the caller holds the sandbox's template lock).
func CopyTemplate(tr *remote.Tracer, tmpl *Template) (*Copy, error) {
	pid, regs, err := copyTemplate(tr, tmpl)
	if err != nil {
		return nil, err
	}
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return nil, fmt.Errorf("pidfd of template %d's copy %d: %w", tmpl.HostPid, pid, err)
	}
	c := &Copy{Pid: pid, Regs: regs, pidfd: fd}
	if c.Self, err = procfs.InnerPid(pid); err != nil {
		c.Kill()
		return nil, fmt.Errorf("template %d's copy %d: %w", tmpl.HostPid, pid, err)
	}
	return c, nil
}

// copyTemplate forks the copy: its host PID and the registers it was left with.
func copyTemplate(tr *remote.Tracer, tmpl *Template) (int, unix.PtraceRegs, error) {
	var regs unix.PtraceRegs
	tt, err := holdTemplate(tr, tmpl)
	if err != nil {
		return 0, regs, err
	}
	pid := 0
	err = tr.Do(func() error {
		child, err := tt.Clone3(remote.CloneArgs{Flags: unix.CLONE_PARENT})
		if err != nil {
			if perr := tt.Restore(); perr != nil {
				return fmt.Errorf("fork a copy of template %d: %w (and put it back: %v)", tmpl.HostPid, err, perr)
			}
			return fmt.Errorf("fork a copy of template %d: %w", tmpl.HostPid, err)
		}
		err = tt.Restore()
		if err == nil {
			_, err = child.Setsid()
		}
		// Its terminal's fds become /dev/null: the terminal is its session's, which the
		// copy is not in (CRIU refuses a terminal whose session it does not dump: "ctty
		// inheritance detected"), and a revive gives the process its session's terminal
		// on those fds anyway (terminalCalls). Not closed: the revive's open of the
		// terminal would take the lowest free fd, one of them, and dup3 onto itself fails.
		if err == nil {
			var b remote.Batch
			var null remote.Ref = -1
			for _, f := range tmpl.Proc.FDs {
				if f.Kind != "pty" {
					continue
				}
				if null < 0 {
					null = b.Add("open /dev/null", unix.SYS_OPENAT, unix.AT_FDCWD, "/dev/null", unix.O_RDWR, 0)
				}
				b.Add(fmt.Sprintf("/dev/null on terminal fd %d", f.Num), unix.SYS_DUP3, null, f.Num, f.Flags&unix.O_CLOEXEC)
			}
			if null >= 0 {
				b.Close("close /dev/null", null)
				_, err = child.RunBatch(&b)
			}
		}
		if err == nil {
			regs = child.SavedRegs()
			err = child.DetachStopped()
		}
		if err != nil {
			kerr := child.Kill()
			return errors.Join(fmt.Errorf("copy of template %d: %w", tmpl.HostPid, err), kerr)
		}
		pid = child.Pid()
		return nil
	})
	return pid, regs, err
}

// AdoptStopped makes the stopped, untraced process at hostPid (a copy of a template:
// CopyTemplate's, or one restored from its durable image) a template with rec's
// contents (the record of the template it copies): seized with the usual options,
// required to be in its group stop, parked as Fork parks (ptrace-stop, SIGSTOP queued).
// Unlike Reattach it checks no identity: the caller made or restored the process.
func AdoptStopped(tr *remote.Tracer, rec TemplateRecord, hostPid, selfPid int) (*Template, error) {
	tmpl := &Template{Proc: rec.Proc, HostPid: hostPid, SelfPid: selfPid, sc: uintptr(rec.Syscall), tr: tr,
		Itimers: rec.Itimers, Signals: rec.Signals, Dumpable: rec.Dumpable}
	err := tr.Do(func() error {
		// CRIU queues SIGSTOP to a process it restores stopped just before it lets it
		// go: seized before it took it, the process would be found running, and killed.
		remote.WaitQueuedStop(hostPid)
		t, err := tr.Seize(hostPid)
		if err != nil {
			return fmt.Errorf("seize process %d: %w", hostPid, err)
		}
		if !t.WasStopped() {
			kerr := t.Kill()
			return errors.Join(fmt.Errorf("process %d was not stopped: killed", hostPid), kerr)
		}
		if rec.Syscall != 0 {
			if err := t.UseSyscallAddr(uintptr(rec.Syscall)); err != nil {
				kerr := t.Kill()
				return errors.Join(fmt.Errorf("process %d: recorded syscall address %#x: %w", hostPid, rec.Syscall, err), kerr)
			}
		}
		if err := t.KeepStopped(); err != nil {
			kerr := t.Kill()
			return errors.Join(fmt.Errorf("park process %d as a template: %w", hostPid, err), kerr)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	tmpl.watchExit()
	return tmpl, nil
}
