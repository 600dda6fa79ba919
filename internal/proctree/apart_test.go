package proctree

import (
	"bufio"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

// A process in the session and group of another (its leader), each in a tree of its
// own or outliving the move, keeps the leader's PID taken: IDsTaken refuses, naming
// both; in one tree they move together.
func TestIDsTaken(t *testing.T) {
	c := exec.Command("sh", "-c", "sleep 60 </dev/null >/dev/null 2>&1 & echo $!; exec sleep 60")
	c.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	out, err := c.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Start(); err != nil {
		t.Fatal(err)
	}
	leader := c.Process.Pid
	line, err := bufio.NewReader(out).ReadString('\n')
	member, _ := strconv.Atoi(strings.TrimSpace(line))
	t.Cleanup(func() {
		syscall.Kill(member, syscall.SIGKILL)
		c.Process.Kill()
		c.Wait()
	})
	if err != nil || member == 0 {
		t.Fatalf("the member's PID: %q, %v", line, err)
	}
	if sid, pgid := ids(member, 0); sid != leader || pgid != leader {
		t.Fatalf("member's session %d, group %d; want the leader's %d", sid, pgid, leader)
	}
	L, M := strconv.Itoa(leader), strconv.Itoa(member)
	for _, tc := range []struct {
		name    string
		trees   [][]int
		staying []int
		want    string // in the error, "" for none
	}{
		{"one tree", [][]int{{leader, member}}, nil, ""},
		{"the member stays", [][]int{{leader}}, []int{member}, "process " + M + " is in the session of process " + L + ", which CRIU took"},
		{"two trees", [][]int{{leader}, {member}}, nil, "process " + M + " is in the session of process " + L},
		{"the leader stays", [][]int{{member}}, []int{leader}, "process " + M + " is in the session of process " + L + ", which the fast path carries"},
		{"both stay", nil, []int{leader, member}, ""},
	} {
		err := IDsTaken(tc.trees, tc.staying, 1)
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("%s: %v, want %q", tc.name, err, tc.want)
		}
	}
}
