package sandbox

import (
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/sbinit"
)

// A killed command that never exits (uninterruptible sleep) ends the wait at killWait
// with an error naming it; one that exits gives its status.
func TestExitAfterKillHasADeadline(t *testing.T) {
	defer func(d time.Duration) { killWait = d }(killWait)
	killWait = 50 * time.Millisecond
	never := make(chan unix.WaitStatus)
	t0 := time.Now()
	_, _, err := exitAfterKill(&sbinit.Process{Pid: 42, Exit: never}, "sleep")
	if err == nil || !strings.Contains(err.Error(), `"sleep" (pid 42 in the sandbox) did not exit`) {
		t.Fatalf("err = %v, want one naming the command and its pid", err)
	}
	if d := time.Since(t0); d > time.Second {
		t.Fatalf("waited %v for a 50ms deadline", d)
	}
	exited := make(chan unix.WaitStatus, 1)
	exited <- unix.WaitStatus(9) // killed by SIGKILL
	ws, ok, err := exitAfterKill(&sbinit.Process{Pid: 42, Exit: exited}, "sleep")
	if err != nil || !ok || !ws.Signaled() || ws.Signal() != unix.SIGKILL {
		t.Fatalf("got %v %v %v, want the SIGKILL status", ws, ok, err)
	}
}
