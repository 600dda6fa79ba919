package remote

import (
	"errors"
	"fmt"
)

// Errors returned before anything was done to a process.
var (
	// ErrClosed: the Tracer was closed.
	ErrClosed = errors.New("remote: tracer closed")
	// ErrNotAttached: the Tracee was detached, killed, or exited.
	ErrNotAttached = errors.New("remote: tracee is not attached")
	// ErrMultiThreaded: Seize refuses processes with more than one thread (other threads
	// would keep running, and a fork copies only the calling thread).
	ErrMultiThreaded = errors.New("remote: process has more than one thread")
	// ErrUninterruptible: the process stayed in uninterruptible sleep (state D, e.g. a
	// parent waiting in vfork); seizing it would block the Tracer's thread. Retry later.
	ErrUninterruptible = errors.New("remote: process is in uninterruptible sleep")
	// ErrNot64Bit: the process runs 32-bit code; only x86-64 is supported.
	ErrNot64Bit = errors.New("remote: process is not running 64-bit code")
	// ErrRefused: the syscall would change the tracee in a way this package cannot
	// undo or follow (fork family, execve, exit, rt_sigreturn, restart-block users).
	ErrRefused = errors.New("remote: syscall not allowed by injection")
)

// TraceeError reports that driving the tracee failed (a ptrace call failed, the tracee
// died, or it stopped unexpectedly), as opposed to an injected syscall that ran and
// returned an errno (those are returned as unix.Errno, wrapped with context by the
// helpers). It does not unwrap to Err on purpose: errors.Is(err, unix.ESRCH) must mean
// "the remote kill() said ESRCH", never "ptrace said ESRCH".
//
// After a TraceeError the tracee is in one of three states, never half-modified:
// restored and still attached (Killed and Exited false), killed by this package because
// it could not be restored (Killed), or gone on its own (Exited).
type TraceeError struct {
	Pid    int
	Op     string // what was being done
	Err    error  // the underlying failure
	Exited bool   // the tracee exited or was killed by someone else while traced
	Killed bool   // this package killed it because its state could not be restored
}

func (e *TraceeError) Error() string {
	s := fmt.Sprintf("remote: pid %d: %s: %v", e.Pid, e.Op, e.Err)
	switch {
	case e.Killed:
		s += " (its registers or memory could not be restored, so it was killed)"
	case e.Exited:
		s += " (the process is gone)"
	default:
		s += " (the process was restored and is still attached)"
	}
	return s
}
