package durable

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"deltabox/internal/procfs"
)

// startGroup starts script under sh leading a process group of its own, as CRIU leads
// one (deadline.Command), and reaps it in the background.
func startGroup(t *testing.T, script string) (pid int, done <-chan struct{}) {
	t.Helper()
	cmd := exec.Command("sh", "-c", script)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	ch := make(chan struct{})
	go func() { _ = cmd.Wait(); close(ch) }()
	t.Cleanup(func() { _ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL); <-ch })
	return cmd.Process.Pid, ch
}

// TestLeftRunsEnded: a run still going at the next start is waited for until its
// recorded deadline and, past it, killed with its process group; one that finishes
// before is not killed; records of runs gone, of another process under the same PID,
// of another boot and cut before their rename are removed and never signalled.
func TestLeftRunsEnded(t *testing.T) {
	dir := t.TempDir()
	// Past its deadline: killed, with the child in its group.
	hang, hangDone := startGroup(t, "sleep 1000 & echo $! > "+filepath.Join(dir, "child")+"; wait")
	// Neither record is removed here: that is the next start's (LeftRuns, End).
	if _, err := recordRun(dir, hang, "hanging run", time.Now().Add(300*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	// Finishing before its deadline: waited for.
	quick, _ := startGroup(t, "sleep 0.3")
	if _, err := recordRun(dir, quick, "quick run", time.Now().Add(20*time.Second)); err != nil {
		t.Fatal(err)
	}
	// A record whose process is gone, and one whose PID names another process now.
	gone, goneDone := startGroup(t, "exit 0")
	<-goneDone
	other, _ := startGroup(t, "sleep 1000")
	write := func(name string, r runRecord) {
		t.Helper()
		b, _ := json.Marshal(r)
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	boot, _ := bootID()
	start, err := procfs.StartTime(other)
	if err != nil {
		t.Fatal(err)
	}
	write("criu-gone.json", runRecord{Pid: gone, Start: 1, Boot: boot, Deadline: time.Now().Add(time.Hour)})
	write("criu-reused.json", runRecord{Pid: other, Start: start + 1, Boot: boot, Deadline: time.Now().Add(time.Hour)})
	write("criu-otherboot.json", runRecord{Pid: other, Start: start, Boot: "another boot", Deadline: time.Now().Add(time.Hour)})
	write("criu-cut.json.tmp", runRecord{Pid: other, Start: start, Boot: boot})

	runs, err := LeftRuns(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, r := range runs {
		names = append(names, r.What)
	}
	if len(runs) != 2 || !strings.Contains(strings.Join(names, ","), "hanging run") || !strings.Contains(strings.Join(names, ","), "quick run") {
		t.Fatalf("left runs: %v, want the hanging and the quick one", names)
	}
	for _, r := range runs {
		begin := time.Now()
		killed, err := r.End()
		took := time.Since(begin)
		if err != nil {
			t.Fatalf("%s: %v", r.What, err)
		}
		t.Logf("%s: killed %v after %v", r.What, killed, took)
		if want := r.Pid == hang; killed != want {
			t.Errorf("%s: killed %v, want %v", r.What, killed, want)
		}
	}
	select {
	case <-hangDone:
	case <-time.After(5 * time.Second):
		t.Fatal("the hanging run was not reaped within 5 s of End")
	}
	b, err := os.ReadFile(filepath.Join(dir, "child"))
	if err != nil {
		t.Fatal(err)
	}
	child, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	for deadline := time.Now().Add(5 * time.Second); procfs.State(child) != 0 && procfs.State(child) != 'Z'; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the hanging run's child %d (its process group) still runs after End", child)
		}
	}
	if st := procfs.State(other); st == 0 || st == 'Z' {
		t.Errorf("process %d, named by records that are not its own, was ended (state %q)", other, st)
	}
	if left, _ := os.ReadDir(dir); len(left) != 1 || left[0].Name() != "child" {
		t.Errorf("left in the runs' directory: %v, want every record removed", left)
	}
}
