package fastpath

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/procfs"
	"deltabox/internal/remote"
)

// TestCopyTemplateRevives: a copy of a template (what a durable image is dumped from) is
// a stopped, untraced process with the template's memory and fds, while the template
// stays parked; adopted as a template (AdoptStopped), with the original gone, it revives
// the process as the original would: same PID, memory, fds, pending signal.
func TestCopyTemplateRevives(t *testing.T) {
	file := filepath.Join(t.TempDir(), "data")
	if err := os.WriteFile(file, make([]byte, 4096), 0o644); err != nil {
		t.Fatal(err)
	}
	sub := startMapper(t, file)
	if l := sub.ask("write before"); l != "ok" {
		t.Fatalf("subject says %q", l)
	}
	if err := unix.Kill(sub.pid, unix.SIGUSR1); err != nil { // blocked: stays pending
		t.Fatal(err)
	}
	pts, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/0", sub.pid))
	if err != nil {
		t.Fatal(err)
	}
	fds := fdList(t, sub.pid)
	rec := forkInDyingDaemon(t, sub.pid)
	if s := waitState(rec.HostPid, "T", 5*time.Second); s != 'T' {
		t.Fatalf("template state %q, want T", s)
	}
	tr := remote.NewTracer()
	defer tr.Close()
	tmpl, err := Reattach(tr, rec)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	c, err := CopyTemplate(tr, tmpl)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("CopyTemplate: %v", time.Since(start))
	cp := c.Pid
	t.Cleanup(func() { c.Kill(); reap(cp) })
	if s := waitState(cp, "T", 5*time.Second); s != 'T' {
		t.Fatalf("copy state %q, want T (group stop)", s)
	}
	if tp := tracerPid(t, cp); tp != "0" {
		t.Fatalf("copy traced by %s", tp)
	}
	if s := procfs.State(tmpl.HostPid); s != 't' {
		t.Errorf("template state %q after the copy, want t (parked)", s)
	}
	// The copy's terminal fds are /dev/null (CopyTemplate says why), the others the
	// template's.
	want := fdList(t, tmpl.HostPid)
	for i, f := range want {
		if strings.Contains(f, "/dev/pts/") {
			want[i] = f[:strings.Index(f, "->")+2] + "/dev/null"
		}
	}
	if got := fdList(t, cp); !reflect.DeepEqual(got, want) {
		t.Errorf("copy's fds %v, want %v", got, want)
	}
	// The copy becomes the template; the original goes.
	inner, err := procfs.InnerPid(cp)
	if err != nil {
		t.Fatal(err)
	}
	if c.Self != inner {
		t.Errorf("copy's PID in the sandbox %d, want %d", c.Self, inner)
	}
	tmpl2, err := AdoptStopped(tr, rec, cp, inner)
	if err != nil {
		t.Fatal(err)
	}
	// The original stays until the end: it holds the terminal's slave open, without
	// which the test's reader of the master sees the terminal hang up (a daemon's new
	// terminal keeps its slave open until the revived process has it: session.NewDetached).
	defer tmpl.Kill()
	if err := unix.Kill(sub.pid, unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	var ws unix.WaitStatus
	if _, err := unix.Wait4(sub.pid, &ws, 0, nil); err != nil {
		t.Fatal(err)
	}
	rv, err := SeizeTemplate(tr, tmpl2)
	if err != nil {
		t.Fatal(err)
	}
	if err := rv.Revive(ownMountNS(t), pts); err != nil {
		t.Fatal(err)
	}
	if rv.HostPid != sub.pid {
		t.Fatalf("revived with pid %d, want %d", rv.HostPid, sub.pid)
	}
	t.Cleanup(func() { reap(sub.pid) })
	if got := shdPnd(t, sub.pid); got&(1<<(unix.SIGUSR1-1)) == 0 {
		t.Errorf("revived ShdPnd %#x: SIGUSR1 lost", got)
	}
	if got := fdList(t, sub.pid); !reflect.DeepEqual(got, fds) {
		t.Errorf("revived fds %v, want %v", got, fds)
	}
	if err := rv.Commit(); err != nil {
		t.Fatal(err)
	}
	if l := sub.ask("read"); l != "map=before" {
		t.Errorf("revived process reads %q, want map=before", l)
	}
}

// TestAdoptStoppedWaitsForQueuedStop: a process CRIU restores stopped gets SIGSTOP just
// before CRIU lets it go, and is runnable until it has taken it. AdoptStopped must take it
// as the stopped process it is about to be, not kill it as one that runs ("process M was
// not stopped: killed", which lost a node's processes after its eviction). The copy is put
// in that state (SIGCONT, then SIGSTOP, from the tracer's thread) pinned to the tracer
// thread's CPU at SCHED_IDLE, so that it cannot take the SIGSTOP before the seize unless
// AdoptStopped waits for it. The two kills are raw system calls: a Go system call can
// hand the thread's P away and park the thread on its way out. A round whose copy still
// ran before its SIGSTOP (a copy runs with the registers of the clone that made it, and
// dies: state Z in a CI run) is set up again, 20 times at most; with a busy loop on each
// CPU one run in three needs it.
func TestAdoptStoppedWaitsForQueuedStop(t *testing.T) {
	file := filepath.Join(t.TempDir(), "data")
	if err := os.WriteFile(file, make([]byte, 4096), 0o644); err != nil {
		t.Fatal(err)
	}
	sub := startMapper(t, file)
	rec := forkInDyingDaemon(t, sub.pid)
	if s := waitState(rec.HostPid, "T", 5*time.Second); s != 'T' {
		t.Fatalf("template state %q, want T", s)
	}
	tr := remote.NewTracer()
	defer tr.Close()
	tmpl, err := Reattach(tr, rec)
	if err != nil {
		t.Fatal(err)
	}
	defer tmpl.Kill()
	lost := 0
	for i := 0; i < 5; i++ {
		c, err := CopyTemplate(tr, tmpl)
		if err != nil {
			t.Fatal(err)
		}
		cp := c.Pid
		if s := waitState(cp, "T", 5*time.Second); s != 'T' {
			t.Fatalf("copy state %q, want T (group stop)", s)
		}
		inner, err := procfs.InnerPid(cp)
		if err != nil {
			t.Fatal(err)
		}
		var adopted *Template
		var queued byte
		err = tr.Do(func() error {
			var set, one unix.CPUSet
			if err := unix.SchedGetaffinity(0, &set); err != nil {
				return err
			}
			for c := 0; c < 1024; c++ {
				if set.IsSet(c) {
					one.Set(c)
					break
				}
			}
			if err := unix.SchedSetaffinity(0, &one); err != nil {
				return err
			}
			if err := unix.SchedSetaffinity(cp, &one); err != nil {
				return err
			}
			if err := unix.SchedSetAttr(cp, &unix.SchedAttr{Size: unix.SizeofSchedAttr, Policy: unix.SCHED_IDLE}, 0); err != nil {
				return err
			}
			if _, _, e := unix.RawSyscall(unix.SYS_KILL, uintptr(cp), uintptr(unix.SIGCONT), 0); e != 0 {
				return e
			}
			if _, _, e := unix.RawSyscall(unix.SYS_KILL, uintptr(cp), uintptr(unix.SIGSTOP), 0); e != 0 {
				return e
			}
			queued = procfs.State(cp)
			if queued == 'Z' || queued == 'X' {
				return errCopyRan
			}
			var err error
			adopted, err = AdoptStopped(tr, rec, cp, inner)
			return err
		})
		if errors.Is(err, errCopyRan) && lost < 20 {
			c.Kill() // gone already: closes its pidfd
			reap(cp)
			lost++
			t.Logf("round %d: the copy ran between SIGCONT and SIGSTOP (state %q): set up again", i, queued)
			i--
			continue
		}
		if err != nil {
			c.Kill()
			reap(cp)
			t.Fatalf("round %d: adopt a copy with its SIGSTOP queued (state %q then): %v", i, queued, err)
		}
		if s := procfs.State(cp); s != 't' {
			t.Errorf("round %d: adopted copy's state %q, want t (parked)", i, s)
		}
		adopted.Kill()
		c.Kill() // gone already: closes its pidfd
		reap(cp)
	}
}

// errCopyRan: TestAdoptStoppedWaitsForQueuedStop's copy was scheduled between its SIGCONT
// and its SIGSTOP and ran (and died): the round's setup, not AdoptStopped, failed.
var errCopyRan = errors.New("the copy ran before its SIGSTOP was queued")
