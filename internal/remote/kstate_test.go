//go:build linux && amd64

package remote

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/testutil/skip"
)

// The tests of this file check the wrappers for what fork does not copy into a child
// (POSIX timers, pending signals) on testdata/kstate.c: a forked child gets them back.

// startKstate builds testdata/kstate.c and starts it.
func startKstate(t *testing.T) *proc {
	t.Helper()
	requireRoot(t)
	gcc, err := exec.LookPath("gcc")
	skip.Require(t, err == nil, "gcc not found")
	bin := filepath.Join(t.TempDir(), "kstate")
	if out, err := exec.Command(gcc, "-O1", "-Wall", "-o", bin, "testdata/kstate.c").CombinedOutput(); err != nil {
		t.Fatalf("building testdata/kstate.c: %v: %s", err, out)
	}
	return start(t, bin)
}

// forkStopped forks p by injected clone3 (a sibling, as the fast path's templates are) and
// returns the child, still attached, and the parent detached again.
func forkStopped(t *testing.T, tr *Tracer, p *proc, inspect func(parent *Tracee)) *Tracee {
	t.Helper()
	waitBlocked(t, p.pid, unix.SYS_READ)
	tc, err := tr.Seize(p.pid)
	if err != nil {
		t.Fatal(err)
	}
	if inspect != nil {
		inspect(tc)
	}
	c, err := tc.Clone3(CloneArgs{Flags: unix.CLONE_PARENT})
	if err != nil {
		t.Fatal(err)
	}
	if err := tc.Detach(); err != nil {
		t.Fatal(err)
	}
	cpid := c.Pid()
	t.Cleanup(func() {
		unix.Kill(cpid, unix.SIGKILL)
		var ws unix.WaitStatus
		unix.Wait4(cpid, &ws, 0, nil)
	})
	return c
}

// statusMask reads a signal mask line (SigPnd, ShdPnd...) of /proc/PID/status.
func statusMask(t *testing.T, pid int, key string) uint64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) == 2 && f[0] == key+":" {
			v, _ := strconv.ParseUint(f[1], 16, 64)
			return v
		}
	}
	t.Fatalf("no %s in /proc/%d/status", key, pid)
	return 0
}

func bit(s unix.Signal) uint64 { return 1 << (uint(s) - 1) }

// TestPendingSignalsToChild: blocked signals pending in a process (a kill()ed SIGUSR1 and
// two sigqueue()d real-time signals for the process, a tgkill()ed SIGUSR2 for its thread)
// are read without dequeuing them (the process still gets them), and queued in a forked
// child, where fork had cleared them: same queues, same siginfo, same order.
func TestPendingSignalsToChild(t *testing.T) {
	p := startKstate(t)
	if l := p.ask("block"); l != "ok" {
		t.Fatalf("block: %q", l)
	}
	if err := unix.Kill(p.pid, unix.SIGUSR1); err != nil {
		t.Fatal(err)
	}
	for _, v := range []int32{7, 8} {
		if err := sigqueue(p.pid, sigRTMin, v); err != nil {
			t.Fatal(err)
		}
	}
	if err := unix.Tgkill(p.pid, p.pid, unix.SIGUSR2); err != nil {
		t.Fatal(err)
	}
	tr := newTracer(t)
	var pending []PendingSignal
	c := forkStopped(t, tr, p, func(parent *Tracee) {
		var err error
		if pending, err = parent.PendingSignals(); err != nil {
			t.Fatal(err)
		}
		if h := parent.HeldSignals(); len(h) != 0 {
			t.Errorf("held signals of a process whose signals are blocked: %d", len(h))
		}
	})
	var got []string
	for _, s := range pending {
		got = append(got, fmt.Sprintf("%d/%d/%v", s.Info.Signo(), s.Info.Code(), s.Shared))
	}
	want := "[12/-6/false 10/0/true 34/-1/true 34/-1/true]" // SIGUSR2 by tgkill, then the process's
	if fmt.Sprint(got) != want {
		t.Fatalf("pending signals %v, want %s", got, want)
	}
	if m := statusMask(t, c.Pid(), "ShdPnd") | statusMask(t, c.Pid(), "SigPnd"); m != 0 {
		t.Fatalf("fork left signals pending in the child: %#x", m)
	}
	in, lines := redirect(t, c)
	if err := c.QueueSignals(pending); err != nil {
		t.Fatal(err)
	}
	if err := c.QueueSignals([]PendingSignal{{Info: Siginfo{byte(unix.SIGKILL)}}}); err == nil {
		t.Error("QueueSignals took SIGKILL")
	}
	if err := c.Detach(); err != nil {
		t.Fatal(err)
	}
	if m := statusMask(t, c.Pid(), "SigPnd"); m != bit(unix.SIGUSR2) {
		t.Errorf("child's SigPnd %#x, want SIGUSR2", m)
	}
	if m := statusMask(t, c.Pid(), "ShdPnd"); m != bit(unix.SIGUSR1)|bit(sigRTMin) {
		t.Errorf("child's ShdPnd %#x, want SIGUSR1 and SIGRTMIN", m)
	}
	wantState := fmt.Sprintf("usr1=1 usr1pid=%d usr1code=0 usr2=1 usr2code=-6 rt=7,8 rt1=0 rt1tid=0 rt1val=0 pend=0", os.Getpid())
	fmt.Fprintln(in, "unblock")
	if l := nextLine(t, lines); l != wantState {
		t.Errorf("child after unblock: %q, want %q", l, wantState)
	}
	if l := p.ask("unblock"); l != wantState {
		t.Errorf("parent after unblock: %q, want %q", l, wantState)
	}
}

// TestTimersToChild: a POSIX timer (id 1: the first was deleted) is read with
// timer_gettime and re-created in a forked child, where fork had dropped it, with the same
// id (PR_TIMER_CREATE_RESTORE_IDS), clock, signal and value; it fires there.
func TestTimersToChild(t *testing.T) {
	p := startKstate(t)
	var id int32
	if _, err := fmt.Sscanf(p.ask("timer"), "timer %d", &id); err != nil || id != 1 {
		t.Fatalf("timer id %d, %v", id, err)
	}
	tr := newTracer(t)
	var setting unix.ItimerSpec
	c := forkStopped(t, tr, p, func(parent *Tracee) {
		var err error
		if setting, err = parent.TimerGettime(id); err != nil {
			t.Fatal(err)
		}
		if _, err := parent.TimerGettime(0); !errors.Is(err, unix.EINVAL) {
			t.Errorf("timer_gettime of the deleted timer 0: %v, want EINVAL", err)
		}
	})
	if setting.Interval.Sec != 100 || setting.Value.Sec < 98 || setting.Value.Sec > 100 {
		t.Fatalf("timer_gettime in the parent: %+v", setting)
	}
	if b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/timers", c.Pid())); len(b) != 0 {
		t.Fatalf("fork copied timers: %s", b)
	}
	in, lines := redirect(t, c)
	err := tr.Do(func() error {
		if _, err := c.Prctl(unix.PR_TIMER_CREATE_RESTORE_IDS, unix.PR_TIMER_CREATE_RESTORE_IDS_ON, 0, 0, 0); err != nil {
			return err
		}
		ev := Sigevent{Value: 0xabc, Signo: int32(sigRTMin + 1), Notify: SigevSignal}
		got, err := c.TimerCreate(unix.CLOCK_MONOTONIC, ev, id)
		if err != nil || got != id {
			return fmt.Errorf("timer_create asking for id %d: %d, %v", id, got, err)
		}
		if _, err := c.TimerCreate(unix.CLOCK_MONOTONIC, ev, id); !errors.Is(err, unix.EBUSY) {
			return fmt.Errorf("timer_create of a taken id: %v, want EBUSY", err)
		}
		if _, err := c.Prctl(unix.PR_TIMER_CREATE_RESTORE_IDS, unix.PR_TIMER_CREATE_RESTORE_IDS_OFF, 0, 0, 0); err != nil {
			return err
		}
		// A scratch timer, deleted again: ids are handed out past the restored one.
		if tmp, err := c.TimerCreate(unix.CLOCK_MONOTONIC, ev, 0); err != nil || tmp <= id {
			return fmt.Errorf("timer_create after restoring ids: %d, %v", tmp, err)
		} else if err := c.TimerDelete(tmp); err != nil {
			return err
		}
		now, err := c.ClockGettime(unix.CLOCK_MONOTONIC)
		if err != nil {
			return err
		}
		var host unix.Timespec
		unix.ClockGettime(unix.CLOCK_MONOTONIC, &host)
		if d := time.Duration(host.Nano() - now.Nano()); d < 0 || d > time.Second {
			return fmt.Errorf("clock_gettime in the child %v, here %v", now, host)
		}
		// Fire in 20 ms, as an absolute expiry (the way a pending timer signal is re-made).
		abs := unix.NsecToTimespec(now.Nano() + 20e6)
		if _, err := c.TimerSettime(id, unix.TIMER_ABSTIME, unix.ItimerSpec{Value: abs}); err != nil {
			return err
		}
		cur, err := c.TimerGettime(id)
		if err != nil || cur.Value.Nano() <= 0 || cur.Value.Nano() > 20e6 {
			return fmt.Errorf("timer_gettime in the child: %+v, %v", cur, err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Detach(); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/timers", c.Pid()))
	if !strings.Contains(string(b), "ID: 1\nsignal: 35/0000000000000abc\nnotify: signal/pid.") {
		t.Errorf("child's /proc/PID/timers:\n%s", b)
	}
	time.Sleep(50 * time.Millisecond)
	fmt.Fprintln(in, "state")
	if l := nextLine(t, lines); !strings.Contains(l, "rt1=1 rt1tid=1 rt1val=abc ") {
		t.Errorf("child after its timer expired: %q", l)
	}
	if l := p.ask("state"); !strings.Contains(l, "rt1=0 ") {
		t.Errorf("parent's timer fired: %q", l)
	}
}
