package proctree

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/procfs"
)

// sleeper starts a child that sleeps until the test ends.
func sleeper(t *testing.T) *exec.Cmd {
	t.Helper()
	c := exec.Command("sleep", "60")
	if err := c.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Process.Kill(); c.Wait() })
	return c
}

// pidOfFD reads the process a pidfd of this process refers to (fdinfo's Pid).
func pidOfFD(t *testing.T, fd int) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/fdinfo/" + strconv.Itoa(fd))
	if err != nil {
		t.Fatalf("fd %d: %v", fd, err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "Pid:"); ok {
			n, _ := strconv.Atoi(strings.TrimSpace(v))
			return n
		}
	}
	t.Fatalf("fd %d is no pidfd: %s", fd, b)
	return 0
}

// waitState waits up to 5 s for process pid to be in state st.
func waitState(t *testing.T, pid int, st byte) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for procfs.State(pid) != st {
		if time.Now().After(deadline) {
			t.Fatalf("process %d: state %c, want %c after 5 s", pid, procfs.State(pid), st)
		}
		time.Sleep(time.Millisecond)
	}
}

// A descendant that ended between the listing of the tree and its pidfd is left out,
// and the pidfds of the others stay open, each on its own process: a pidfd closed and
// its number reused by the next would send a signal to another process than the one
// recorded.
func TestHoldLeavesOutEnded(t *testing.T) {
	a, b := sleeper(t), sleeper(t)
	gone := exec.Command("true")
	if err := gone.Run(); err != nil {
		t.Fatal(err)
	}
	var tr Tree
	defer tr.Close()
	if err := tr.hold([]int{a.Process.Pid, gone.Process.Pid, b.Process.Pid}, 1); err != nil {
		t.Fatal(err)
	}
	want := []int{a.Process.Pid, b.Process.Pid}
	if len(tr.fds) != 2 || len(tr.Pids) != 2 || len(tr.Host) != 2 {
		t.Fatalf("held %d fds, %d pids, %d hosts; want 2 each (the ended process left out)", len(tr.fds), len(tr.Pids), len(tr.Host))
	}
	for i, fd := range tr.fds {
		if got := pidOfFD(t, fd); got != want[i] {
			t.Errorf("pidfd %d (fd %d) is process %d's, want %d's", i, fd, got, want[i])
		}
		if tr.Pids[i] != want[i] || int(tr.Host[i][0]) != want[i] {
			t.Errorf("process %d recorded as %d (host %d), want %d", i, tr.Pids[i], tr.Host[i][0], want[i])
		}
	}
	// The root ended: an error, and nothing held.
	var tr2 Tree
	if err := tr2.hold([]int{gone.Process.Pid, a.Process.Pid}, 1); err == nil || len(tr2.fds) != 0 {
		t.Fatalf("hold with an ended root: %v, %d fds held; want an error and none", err, len(tr2.fds))
	}
}

// Continue lets run what it holds but the processes stopped before (Stopped); Kill
// ends them all.
func TestContinueLeavesStoppedAndKill(t *testing.T) {
	a, b := sleeper(t), sleeper(t)
	for _, c := range []*exec.Cmd{a, b} {
		c.Process.Signal(syscall.SIGSTOP)
		waitState(t, c.Process.Pid, 'T')
	}
	var tr Tree
	if err := tr.hold([]int{a.Process.Pid, b.Process.Pid}, 1); err != nil {
		t.Fatal(err)
	}
	tr.Stopped = []int{b.Process.Pid}
	tr.Continue()
	waitState(t, a.Process.Pid, 'S')
	time.Sleep(20 * time.Millisecond)
	if st := procfs.State(b.Process.Pid); st != 'T' {
		t.Fatalf("process stopped before the checkpoint: state %c after Continue, want T", st)
	}
	if len(tr.fds) != 0 {
		t.Fatalf("Continue kept %d pidfds", len(tr.fds))
	}
	if err := tr.hold([]int{a.Process.Pid, b.Process.Pid}, 1); err != nil {
		t.Fatal(err)
	}
	tr.Kill()
	for _, c := range []*exec.Cmd{a, b} {
		err := c.Wait()
		if ws, ok := c.ProcessState.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != unix.SIGKILL {
			t.Fatalf("process %d after Kill: %v, want killed by SIGKILL", c.Process.Pid, err)
		}
	}
}

// A record is written whole with the fields of the Tree at its top level, is read back,
// and ContinueCut lets run only a process still under the recorded start time.
func TestRecordAndContinueCut(t *testing.T) {
	a, b := sleeper(t), sleeper(t)
	for _, c := range []*exec.Cmd{a, b} {
		c.Process.Signal(syscall.SIGSTOP)
		waitState(t, c.Process.Pid, 'T')
	}
	type rec struct {
		Why string `json:"why"`
		Tree
	}
	dir := t.TempDir()
	r := rec{Why: "children"}
	if err := r.hold([]int{a.Process.Pid, b.Process.Pid}, 1); err != nil {
		t.Fatal(err)
	}
	r.Close()
	r.Host[1][1]++ // b: another process under its PID, as after a reuse
	if err := WriteRecord(dir, &r); err != nil {
		t.Fatal(err)
	}
	raw, _ := os.ReadFile(filepath.Join(dir, RecordFile))
	if !strings.Contains(string(raw), `"pids":[`) || !strings.Contains(string(raw), `"host":[`) {
		t.Fatalf("record %s: want pids and host at its top level", raw)
	}
	if _, err := os.Stat(filepath.Join(dir, RecordFile+".tmp")); !os.IsNotExist(err) {
		t.Fatalf("temporary record left: %v", err)
	}
	var back rec
	if err := ReadRecord(dir, &back); err != nil || back.Why != "children" || len(back.Pids) != 2 || back.Host[0] != r.Host[0] {
		t.Fatalf("read back %+v, %v; want %+v", back, err, r)
	}
	ContinueCut(filepath.Join(dir, RecordFile))
	waitState(t, a.Process.Pid, 'S')
	time.Sleep(20 * time.Millisecond)
	if st := procfs.State(b.Process.Pid); st != 'T' {
		t.Fatalf("process whose start time differs from the record's: state %c, want T (not continued)", st)
	}
}
