package fastpath

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/remote"
	"deltabox/internal/testutil"
)

// Choose's decision for each kind of process a checkpoint finds outside the sessions,
// with and without end_background. hold stands for the seizure and inspection.
func TestChoose(t *testing.T) {
	carried := &Held{P: &Proc{Pid: 5}}
	criu := &Ineligible{Pid: 5, Reason: "it has child processes", CRIU: true}
	notCRIU := &Ineligible{Pid: 5, Reason: "fd 3 is /dev/x, a special file"}
	cases := []struct {
		name   string
		c      Candidate
		held   *Held
		err    error // hold's
		gone   bool  // exists says no
		want   Choice
		wantBg Choice // with end_background
		why    string // in the refusal, or the reason left
		holds  bool   // hold is called
	}{
		{"outside the cgroup", Candidate{Pid: 5, OutsideCgroup: true}, nil, nil, false, Refuse, Leave, "not in the sandbox's cgroup", false},
		{"zombie", Candidate{Host: 105, Pid: 5, Kind: Zombie}, nil, nil, false, Leave, Leave, "zombie", false},
		{"memory holder", Candidate{Host: 105, Pid: 5, Kind: Traced}, nil, nil, false, Leave, Leave, "daemon traces it", false},
		{"in a session's tree", Candidate{Host: 105, Pid: 5, InSessionTree: true}, nil, nil, false, Leave, Leave, "session's CRIU tree", false},
		{"a tracer", Candidate{Host: 105, Pid: 5, Traces: 7}, nil, nil, false, Refuse, Leave, "traces process 7", false},
		{"own PID namespace", Candidate{Host: 105, Pid: 5, OwnPidNS: true}, nil, nil, false, Refuse, Leave, "PID namespace of its own", false},
		{"carried", Candidate{Host: 105, Pid: 5}, carried, nil, false, Carry, Carry, "", true},
		{"children: CRIU", Candidate{Host: 105, Pid: 5}, nil, criu, false, ToCRIU, Leave, "child processes", true},
		{"inspection refused: CRIU", Candidate{Host: 105, Pid: 5}, nil, notCRIU, false, ToCRIU, Leave, "special file", true},
		{"not seizable", Candidate{Host: 105, Pid: 5}, nil, unix.EPERM, false, Refuse, Leave, "cannot be seized", true},
		{"ended meanwhile", Candidate{Host: 105, Pid: 5}, nil, unix.ESRCH, true, Leave, Leave, "ended meanwhile", true},
	}
	for _, tc := range cases {
		for _, bg := range []bool{false, true} {
			held := false
			hold := func(host int) (*Held, error) {
				held = true
				if host != tc.c.Host {
					t.Errorf("%s: hold(%d), want hold(%d)", tc.name, host, tc.c.Host)
				}
				return tc.held, tc.err
			}
			exists := func(int) bool { return !tc.gone }
			d := Choose(tc.c, bg, hold, nil, exists)
			want := tc.want
			if bg {
				want = tc.wantBg
			}
			if d.Choice != want {
				t.Errorf("%s (end_background %v): %v (%v %q), want %v", tc.name, bg, d.Choice, d.Err, d.Why, want)
				continue
			}
			if held != tc.holds {
				t.Errorf("%s: hold called %v, want %v", tc.name, held, tc.holds)
			}
			switch d.Choice {
			case Carry:
				if d.Held != tc.held {
					t.Errorf("%s: carries %v, want the process held", tc.name, d.Held)
				}
			case ToCRIU, Refuse:
				var in *Ineligible
				if !errors.As(d.Err, &in) || in.Pid != 5 || !strings.Contains(d.Err.Error(), tc.why) {
					t.Errorf("%s: %v: %v, want an *Ineligible for process 5 saying %q", tc.name, d.Choice, d.Err, tc.why)
				}
			case Leave:
				if !bg || tc.want == Leave {
					if !strings.Contains(d.Why, tc.why) {
						t.Errorf("%s: left because %q, want %q", tc.name, d.Why, tc.why)
					}
				}
			}
		}
	}
}

// A seized process that the inspection took still refuses, and is let go untouched
// (no longer traced), when it holds a session's terminal or shares a locked open file
// description with a process carried before it.
func TestChooseRefusesAfterHold(t *testing.T) {
	testutil.Require(t, os.Geteuid() == 0, "needs root (ptrace, kcmp of another user's process)")
	dir := t.TempDir()
	lock, err := os.Create(filepath.Join(dir, "lock"))
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	// The child inherits the locked description as its fd 3, and no fd this test process
	// inherited (a pipe would refuse it for another reason).
	if err := unix.CloseRange(3, ^uint(0), unix.CLOSE_RANGE_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("sleep", "60")
	cmd.ExtraFiles = []*os.File{lock}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	pid := cmd.Process.Pid
	waitExe(t, pid, "sleep")
	tr := remote.NewTracer()
	defer tr.Close()
	hold := func(host int) (*Held, error) { return Hold(tr, host) }
	me := Carried{What: "session main", P: &Proc{HostPid: os.Getpid(), FDs: []FD{
		{Num: int(lock.Fd()), Kind: "file", Path: lock.Name(), Locks: []Lock{{Kind: "flock", Write: true}}}}}}
	c := Candidate{Host: pid, Pid: pid}
	d := Choose(c, false, hold, []Carried{me}, Exists)
	if d.Choice != Refuse || !strings.Contains(d.Err.Error(), "open file description of session main's fd") {
		t.Fatalf("shared locked description: %v (%v), want a refusal naming session main", d.Choice, d.Err)
	}
	if tp := tracerPid(t, pid); tp != "0" {
		t.Fatalf("refused process still traced by %s", tp)
	}
	// Without the carried process, it is carried; then, as if it held a session's
	// terminal, refused.
	d = Choose(c, false, hold, nil, Exists)
	if d.Choice != Carry {
		t.Fatalf("alone: %v (%v), want carry", d.Choice, d.Err)
	}
	if err := d.Held.Release(); err != nil {
		t.Fatal(err)
	}
	withPty := func(host int) (*Held, error) {
		h, err := Hold(tr, host)
		if err == nil {
			h.P.FDs = append(h.P.FDs, FD{Num: 9, Kind: "pty", Path: "/dev/pts/0"})
		}
		return h, err
	}
	d = Choose(c, false, withPty, nil, Exists)
	if d.Choice != Refuse || !strings.Contains(d.Err.Error(), "session's terminal") {
		t.Fatalf("holding a terminal: %v (%v), want a refusal", d.Choice, d.Err)
	}
	if tp := tracerPid(t, pid); tp != "0" {
		t.Fatalf("refused process still traced by %s", tp)
	}
}

// waitExe waits up to 1 s for pid to run the program name (its exec done).
func waitExe(t *testing.T, pid int, name string) {
	t.Helper()
	for range 200 {
		if exe, _ := os.Readlink("/proc/" + strconv.Itoa(pid) + "/exe"); filepath.Base(exe) == name {
			time.Sleep(50 * time.Millisecond) // exec closes close-on-exec fds after it sets exe
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatalf("process %d did not exec %s within 1 s", pid, name)
}
