package durable

import (
	"os/exec"
	"syscall"
	"testing"
	"time"

	"deltabox/internal/procfs"
)

// TestPacerYieldsBounded: a pacer stops its process group while its caller is busy,
// continues it when the caller is not, and never holds it stopped longer than maxYield
// at a time: a caller that stays busy still lets it run minRun between stops.
func TestPacerYieldsBounded(t *testing.T) {
	cmd := exec.Command("sleep", "60")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pid := cmd.Process.Pid
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	waitState := func(want byte, within time.Duration, what string) time.Duration {
		t.Helper()
		start := time.Now()
		for procfs.State(pid) != want {
			if time.Since(start) > within {
				t.Fatalf("%s: state %c after %v, want %c", what, procfs.State(pid), within, want)
			}
			time.Sleep(time.Millisecond)
		}
		return time.Since(start)
	}
	waitState('S', 5*time.Second, "started")
	p := &pacer{pgid: pid}
	p.set(true)
	waitState('T', time.Second, "busy")
	// Still busy: continued within maxYield (and some slack for a loaded machine).
	waitState('S', maxYield+time.Second, "busy for longer than maxYield")
	// ... and stopped again once minRun has passed.
	waitState('T', minRun+time.Second, "busy after minRun")
	p.set(false)
	waitState('S', time.Second, "not busy")
	p.set(true)
	waitState('T', time.Second, "busy again")
	p.end()
	waitState('S', time.Second, "ended")
	p.set(true)
	time.Sleep(20 * time.Millisecond)
	if st := procfs.State(pid); st != 'S' {
		t.Fatalf("after end: state %c, want S (an ended pacer stops nothing)", st)
	}
}
