package durable

import (
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
)

// TestSetOOMScores: a process is given the oom_score_adj it had, as setOOMScores gives it
// at a restore (found by its PID in its namespace, here the test's own).
func TestSetOOMScores(t *testing.T) {
	cmd := exec.Command("sleep", "1000")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	ns, err := os.Open("/proc/self/ns/pid")
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	if err := setOOMScores(ns, map[int]int32{cmd.Process.Pid: 400}); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile("/proc/" + strconv.Itoa(cmd.Process.Pid) + "/oom_score_adj")
	if err != nil || strings.TrimSpace(string(b)) != "400" {
		t.Fatalf("oom_score_adj %q %v, want 400", b, err)
	}
	if err := setOOMScores(ns, map[int]int32{1 << 30: 400}); err == nil {
		t.Fatal("a process not in the namespace: no error")
	}
}

// TestSetOOMScoresNotToAReusedPid: the process found in the namespace ends between
// setOOMScores' scan and its write, and another process takes its PID: the write fails,
// and the other process (here a process of the host, as it could be) keeps its
// oom_score_adj. (The race a sandbox would have to win; made certain here: the PID is
// given again through ns_last_pid.)
func TestSetOOMScoresNotToAReusedPid(t *testing.T) {
	a := exec.Command("sleep", "1000")
	if err := a.Start(); err != nil {
		t.Fatal(err)
	}
	pid := a.Process.Pid
	t.Cleanup(func() { a.Process.Kill(); a.Wait() })
	ns, err := os.Open("/proc/self/ns/pid")
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	var b *exec.Cmd
	beforeOOMWrite = func() {
		a.Process.Kill()
		a.Wait()
		b = startWithPid(t, pid)
	}
	defer func() { beforeOOMWrite = nil }()
	before := oomScoreOf(t, 0)
	if err := setOOMScores(ns, map[int]int32{pid: 400}); err == nil {
		t.Error("the process ended before the write: no error")
	}
	if got := oomScoreOf(t, b.Process.Pid); got != before {
		t.Fatalf("the process that took pid %d has oom_score_adj %s, want %s (untouched)", pid, got, before)
	}
}

// startWithPid starts a sleep with host PID pid (free), through ns_last_pid; it tries
// again while other processes of the machine take the PID first.
func startWithPid(t *testing.T, pid int) *exec.Cmd {
	for range 50 {
		if err := os.WriteFile("/proc/sys/kernel/ns_last_pid", []byte(strconv.Itoa(pid-1)), 0); err != nil {
			t.Fatal(err)
		}
		c := exec.Command("sleep", "1000")
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Process.Kill(); c.Wait() })
		if c.Process.Pid == pid {
			return c
		}
		c.Process.Kill()
		c.Wait()
	}
	t.Fatalf("pid %d could not be given again", pid)
	return nil
}

// oomScoreOf is process pid's oom_score_adj (0: the test's own).
func oomScoreOf(t *testing.T, pid int) string {
	p := "/proc/self/oom_score_adj"
	if pid != 0 {
		p = "/proc/" + strconv.Itoa(pid) + "/oom_score_adj"
	}
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}
