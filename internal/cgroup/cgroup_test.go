package cgroup

import (
	"os"
	"os/exec"
	"slices"
	"strconv"
	"testing"
	"time"

	"deltabox/internal/testutil/skip"
)

// Pids lists exactly the group's processes, and Destroy kills them and removes it.
func TestPidsAndDestroy(t *testing.T) {
	skip.Require(t, os.Geteuid() == 0, "needs root to make cgroups")
	_, err := os.Stat("/sys/fs/cgroup/unified/cgroup.controllers")
	skip.Require(t, err == nil, "no cgroup2 at /sys/fs/cgroup/unified (run scripts/setup.sh)")
	old := Root
	Root = old + "-unittest-" + strconv.Itoa(os.Getpid())
	defer func() { RemoveRoot(); Root = old }()

	g, err := Create("t")
	if err != nil {
		t.Fatal(err)
	}
	if pids, err := g.Pids(); err != nil || len(pids) != 0 {
		t.Fatalf("Pids of a new group = %v, %v", pids, err)
	}
	var want []int
	for i := 0; i < 3; i++ {
		cmd := exec.Command("sleep", "60")
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		defer cmd.Process.Kill()
		if err := os.WriteFile(g.Path+"/cgroup.procs", []byte(strconv.Itoa(cmd.Process.Pid)), 0); err != nil {
			t.Fatal(err)
		}
		want = append(want, cmd.Process.Pid)
		go cmd.Wait()
	}
	got, err := g.Pids()
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("Pids = %v, want %v", got, want)
	}
	if err := g.Destroy(5 * time.Second); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(g.Path); !os.IsNotExist(err) {
		t.Fatalf("group still there after Destroy: %v", err)
	}
	if _, err := g.Pids(); !os.IsNotExist(err) {
		t.Fatalf("Pids of a removed group: err %v, want not-exist", err)
	}
}
