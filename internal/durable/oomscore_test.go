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
