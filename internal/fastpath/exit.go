package fastpath

import (
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// A template killed from inside the sandbox (kill -9 -1) exits while its Tracer holds it
// in a ptrace-stop, and a traced process that exits stays a zombie until its tracer has
// waited for it; only then can its parent, the sandbox's init, reap it. The tracer waits
// only when it next drives the template, which for a node nobody restores is never: the
// zombies stayed under init, their PIDs taken. So each template's exit is watched
// (a pidfd in the runtime's poller: a parked goroutine, no thread) and collected at once.
//
// Once collected, its PID may be reused by any process: from then on the template is
// dead for good (Alive, WaitStopped) and Kill signals nothing, and while it is not, Kill
// signals through the pidfd, which names this process and no later one.

// exitWatch is a template's pidfd and whether it has been collected.
type exitWatch struct {
	mu sync.Mutex
	// +checklocks:mu
	pidfd int // the template's pidfd; -1 before watchExit, or once dead
	// +checklocks:mu
	dead bool
	// +checklocks:mu
	set bool // watchExit ran
}

// watchExit opens t's pidfd and, if its Tracer holds it, collects it once it has exited.
// Precondition: t is alive and seized (its PID cannot have been reused), or gone.
func (t *Template) watchExit() {
	if t.tr == nil {
		return // untraced: init reaps it, and Kill signals its PID as before
	}
	fd, err := unix.PidfdOpen(t.HostPid, 0)
	if err != nil {
		return // gone already: found so by the next restore
	}
	t.exit.mu.Lock()
	t.exit.pidfd, t.exit.set = fd, true
	t.exit.mu.Unlock()
	// The pidfd, opened above while the template is seized, is what names the process.
	// The rest (dup, the poller's registration, the wait) is off the caller's path, a
	// checkpoint's fork: done inline it took 14-49 µs per template here, under load.
	go func() {
		t.exit.mu.Lock()
		wfd := -1
		if t.exit.pidfd >= 0 {
			wfd, _ = unix.FcntlInt(uintptr(t.exit.pidfd), unix.F_DUPFD_CLOEXEC, 0)
		}
		t.exit.mu.Unlock()
		if wfd < 0 {
			return // collected already, or out of fds: found gone by the next restore
		}
		if err := unix.SetNonblock(wfd, true); err != nil {
			unix.Close(wfd)
			return
		}
		f := os.NewFile(uintptr(wfd), "template pidfd") // non-blocking: in the poller
		defer func() { _ = f.Close() }()                // a pidfd: nothing written
		rc, err := f.SyscallConn()
		if err != nil {
			return
		}
		// A pidfd polls readable once its process has exited.
		_ = rc.Read(func(fd uintptr) bool { // returns once the pidfd polls readable; f stays open until then
			n, _ := unix.Poll([]unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}, 0)
			return n > 0
		})
		t.exit.mu.Lock()
		t.exit.dead = true
		if t.exit.pidfd >= 0 {
			unix.Close(t.exit.pidfd)
			t.exit.pidfd = -1
		}
		t.exit.mu.Unlock()
		t.tr.Forget(t.HostPid) // its wait: init reaps it next
	}()
}

// collected reports whether t exited and was collected (its PID may be another's).
func (t *Template) collected() bool {
	t.exit.mu.Lock()
	defer t.exit.mu.Unlock()
	return t.exit.dead
}

// signal sends sig to t unless it was collected: through its pidfd when it has one.
func (t *Template) signal(sig unix.Signal) {
	t.exit.mu.Lock()
	defer t.exit.mu.Unlock()
	switch {
	case t.exit.dead:
	case t.exit.set && t.exit.pidfd >= 0:
		_ = unix.PidfdSendSignal(t.exit.pidfd, sig, nil, 0) // ESRCH: it exited meanwhile
	case !t.exit.set:
		_ = unix.Kill(t.HostPid, sig) // ESRCH: it exited meanwhile
	}
}
