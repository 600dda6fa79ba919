package fastpath

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/errdefs"
	"deltabox/internal/procfs"
	"deltabox/internal/remote"
)

// The daemon that forks a template is played by a child process of the test binary
// (TestReattachHelper): it holds the live process, forks its template, lets the live
// process go, writes the template's record and exits without closing its Tracer, so
// that the kernel detaches the template at its thread's exit, as when a daemon is
// killed. The live process (testdata/mapper.c) is the test's child, and so is the
// template (CLONE_PARENT), as both are the sandbox init's in a sandbox.

const (
	helperPidEnv = "DELTABOX_REATTACH_PID"
	helperOutEnv = "DELTABOX_REATTACH_OUT"
)

// TestReattachHelper is the dying daemon (above); it does nothing in a normal run.
func TestReattachHelper(t *testing.T) {
	pid, _ := strconv.Atoi(os.Getenv(helperPidEnv))
	if pid == 0 {
		return
	}
	fail := func(err error) {
		fmt.Fprintln(os.Stderr, "helper:", err)
		os.Exit(3)
	}
	tr := remote.NewTracer()
	h, err := Hold(tr, pid)
	if err != nil {
		fail(err)
	}
	tmpl, err := h.Fork()
	if err != nil {
		h.Abort()
		fail(err)
	}
	if err := h.Release(); err != nil {
		fail(err)
	}
	rec, err := tmpl.Record()
	if err != nil {
		fail(err)
	}
	b, err := json.Marshal(rec)
	if err != nil {
		fail(err)
	}
	if err := os.WriteFile(os.Getenv(helperOutEnv), b, 0o600); err != nil {
		fail(err)
	}
	os.Exit(0) // the Tracer's thread dies holding the template
}

// forkInDyingDaemon runs TestReattachHelper on the live process pid and returns the
// template's record, decoded from its JSON. The template is killed and reaped at the
// test's end.
func forkInDyingDaemon(t *testing.T, pid int) TemplateRecord {
	t.Helper()
	out := filepath.Join(t.TempDir(), "record.json")
	cmd := exec.Command(os.Args[0], "-test.run=^TestReattachHelper$", "-test.count=1")
	cmd.Env = append(os.Environ(), helperPidEnv+"="+strconv.Itoa(pid), helperOutEnv+"="+out)
	done := make(chan error, 1)
	var output []byte
	go func() {
		var err error
		output, err = cmd.CombinedOutput()
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("the helper daemon: %v: %s", err, output)
		}
	case <-time.After(20 * time.Second):
		cmd.Process.Kill()
		t.Fatal("the helper daemon did not exit within 20 s")
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	var rec TemplateRecord
	if err := json.Unmarshal(b, &rec); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { reap(rec.HostPid) })
	return rec
}

// reap kills pid, the test's child, and waits for it (up to 5 s).
func reap(pid int) {
	unix.Kill(pid, unix.SIGKILL)
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		var ws unix.WaitStatus
		if n, err := unix.Wait4(pid, &ws, unix.WNOHANG|unix.WALL, nil); n == pid || err != nil {
			return
		}
		time.Sleep(time.Millisecond)
	}
}

// waitState waits up to d for pid's state letter to be one of want, and returns the
// last one read (0: gone).
func waitState(pid int, want string, d time.Duration) byte {
	deadline := time.Now().Add(d)
	for {
		s := procfs.State(pid)
		if s == 0 || strings.IndexByte(want, s) >= 0 || time.Now().After(deadline) {
			return s
		}
		time.Sleep(time.Millisecond)
	}
}

func tracerPid(t *testing.T, pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) == 2 && f[0] == "TracerPid:" {
			return f[1]
		}
	}
	return "?"
}

func fdList(t *testing.T, pid int) []string {
	t.Helper()
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		l, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, e.Name()))
		out = append(out, e.Name()+"->"+l)
	}
	sort.Strings(out)
	return out
}

// shdPnd returns pid's ShdPnd: the signals pending for its whole thread group.
func shdPnd(t *testing.T, pid int) uint64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	var m [2]uint64
	for _, l := range strings.Split(string(b), "\n") {
		parsePending(strings.Fields(l), &m)
	}
	return m[1]
}

// detachedTemplate starts a mapper and forks its template in a daemon that dies (a child
// of the test binary), and returns both once the template is in its group stop.
func detachedTemplate(t *testing.T) (*mapper, TemplateRecord) {
	t.Helper()
	file := filepath.Join(t.TempDir(), "data")
	if err := os.WriteFile(file, make([]byte, 4096), 0o644); err != nil {
		t.Fatal(err)
	}
	sub := startMapper(t, file)
	rec := forkInDyingDaemon(t, sub.pid)
	if s := waitState(rec.HostPid, "T", 5*time.Second); s != 'T' {
		t.Fatalf("template state %q, want T", s)
	}
	return sub, rec
}

// TestReattachRevive: a template whose daemon died is found in a SIGSTOP group stop,
// untraced, having been scheduled in at most once more than at its parking (the
// detach's wake-up); a new Tracer reattaches it, and a restore from it gives back the
// process as it was: same PID (set_tid), memory, pending signal, fds, terminal.
func TestReattachRevive(t *testing.T) {
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

	// The experiment: what the kernel left when the daemon's tracer thread died.
	if s := waitState(rec.HostPid, "T", 5*time.Second); s != 'T' {
		t.Fatalf("template after its tracer's death: state %q, want T (group stop)", s)
	}
	if tp := tracerPid(t, rec.HostPid); tp != "0" {
		t.Fatalf("template still traced by %s", tp)
	}
	id, err := readIdentity(rec.HostPid)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("since its parking, the detach scheduled the template in %d time(s), for %v on a CPU; it slept %d time(s), was preempted %d time(s)",
		id.mark.Runs-rec.Mark.Runs, time.Duration(id.mark.Runtime-rec.Mark.Runtime), id.mark.Voluntary-rec.Mark.Voluntary, id.mark.Involuntary-rec.Mark.Involuntary)
	if err := ranSince(rec, id.mark); err != nil {
		t.Fatalf("a template only detached counts as having run: %v", err)
	}
	if m := shdPnd(t, rec.HostPid); m != 0 {
		t.Errorf("template's ShdPnd %#x after the detach, want 0 (SIGSTOP taken)", m)
	}

	// The next daemon.
	tr := remote.NewTracer()
	defer tr.Close()
	start := time.Now()
	tmpl, err := Reattach(tr, rec)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("Reattach: %v", time.Since(start))
	if tp := tracerPid(t, rec.HostPid); tp == "0" {
		t.Fatal("template not traced after Reattach")
	}
	// Parked as Fork parks: ptrace-stop (t), SIGSTOP queued.
	if s := procfs.State(rec.HostPid); s != 't' {
		t.Errorf("template state %q after Reattach, want t (ptrace-stop)", s)
	}
	if m := shdPnd(t, rec.HostPid); m != 1<<(unix.SIGSTOP-1) {
		t.Errorf("template's ShdPnd %#x after Reattach, want SIGSTOP only", m)
	}
	// A record of the reattached template is the same, but for its counters.
	rec2, err := tmpl.Record()
	if err != nil {
		t.Fatal(err)
	}
	rec2.Mark = rec.Mark
	if !reflect.DeepEqual(rec, rec2) {
		t.Errorf("record after Reattach\n%+v\nwant\n%+v", rec2, rec)
	}

	// A SIGCONT from the sandbox does not end a ptrace-stop.
	unix.Kill(rec.HostPid, unix.SIGCONT)
	time.Sleep(20 * time.Millisecond)
	if s := procfs.State(rec.HostPid); s != 't' {
		t.Fatalf("template state %q after SIGCONT, want t", s)
	}

	// Restore: the live process ends, the template forks it again.
	if err := unix.Kill(sub.pid, unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	var ws unix.WaitStatus
	if _, err := unix.Wait4(sub.pid, &ws, 0, nil); err != nil {
		t.Fatal(err)
	}
	rv, err := SeizeTemplate(tr, tmpl)
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
	// The template is parked again, with fresh counters, and can be recorded again.
	if s := procfs.State(rec.HostPid); s != 't' {
		t.Errorf("template state %q after the revive, want t", s)
	}
	if _, err := tmpl.Record(); err != nil {
		t.Error(err)
	}
}

// TestReattachRefusesTemplateThatRan: a SIGCONT that reaches a template while no daemon
// holds it lets it run its own code: found running or blocked (state S), it is refused
// with ErrTemplateRan and killed. One stopped again after it ran is found by its
// counters: here the record says it was parked two sleeps earlier than it was (a real
// SIGCONT then SIGSTOP is not used: a template continued after its tracer's death died
// of SIGTRAP once stopped again, in 2 runs out of 2; likely the single-step flag of the
// injections, which PTRACE_DETACH clears and the implicit detach of an exiting tracer
// does not).
func TestReattachRefusesTemplateThatRan(t *testing.T) {
	for _, continued := range []bool{true, false} {
		t.Run(fmt.Sprintf("continued=%v", continued), func(t *testing.T) {
			_, rec := detachedTemplate(t)
			if continued {
				unix.Kill(rec.HostPid, unix.SIGCONT)
				if s := waitState(rec.HostPid, "S", 5*time.Second); s != 'S' {
					t.Fatalf("continued template state %q, want S (back in its read)", s)
				}
			} else {
				rec.Mark.Voluntary -= 2
				rec.Mark.Runs -= 2
			}
			tr := remote.NewTracer()
			defer tr.Close()
			_, err := Reattach(tr, rec)
			if !errors.Is(err, ErrTemplateRan) || !errors.Is(err, errdefs.ErrConflict) {
				t.Fatalf("Reattach: %v, want ErrTemplateRan (a conflict)", err)
			}
			t.Log(err)
			if s := waitState(rec.HostPid, "Z", 5*time.Second); s != 'Z' && s != 0 {
				t.Errorf("refused template state %q, want killed", s)
			}
		})
	}
}

// TestReattachRefusesReusedPid: a process at the recorded PID with another start time
// is not the template: ErrTemplateGone, and that process is left alone.
func TestReattachRefusesReusedPid(t *testing.T) {
	_, rec := detachedTemplate(t)
	other := rec
	other.Start-- // as a record of an earlier process at that PID would say
	tr := remote.NewTracer()
	defer tr.Close()
	_, err := Reattach(tr, other)
	if !errors.Is(err, ErrTemplateGone) || !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("Reattach: %v, want ErrTemplateGone (a conflict)", err)
	}
	t.Log(err)
	if s := procfs.State(rec.HostPid); s != 'T' {
		t.Errorf("the process at the reused PID: state %q, want T, untouched", s)
	}
	if tp := tracerPid(t, rec.HostPid); tp != "0" {
		t.Errorf("the process at the reused PID is traced by %s", tp)
	}
	// And the record of a PID that is free.
	reap(rec.HostPid)
	if _, err := Reattach(tr, rec); !errors.Is(err, ErrTemplateGone) {
		t.Fatalf("Reattach of a dead template: %v, want ErrTemplateGone", err)
	}
}

// TestTemplateRecordRoundTrip: every field a revive reads survives JSON.
func TestTemplateRecordRoundTrip(t *testing.T) {
	var si remote.Siginfo
	for i := range si {
		si[i] = byte(i * 7)
	}
	rec := TemplateRecord{
		Proc: Proc{HostPid: 4321, Pid: 12, Cwd: "/work dir",
			FDs: []FD{{Num: 3, Kind: "file", Path: "/a", Flags: unix.O_RDWR | unix.O_APPEND, Pos: 1 << 40,
				Locks: []Lock{{Kind: "posix", Write: true, Start: 5, End: -1}}}, {Num: 4, Kind: "file", Path: "/a", Dup: true, DupOf: 3}},
			Maps:   []Mapping{{Start: 0x7f0000000000, End: 0x7f0000001000, Prot: 3, Offset: 4096, Path: "/m"}},
			Timers: []PosixTimer{{ID: 2, Clock: 1, Signo: 34, Notify: 4, Value: 1<<63 + 5, Setting: unix.ItimerSpec{Interval: unix.Timespec{Sec: 1}, Value: unix.Timespec{Nsec: 999}}, Pending: true}}},
		HostPid: 4400, SelfPid: 13, Start: 123456789, Mark: parkMark{1 << 50, 77, 40, 3}, Syscall: 0x7ffc00001234,
		Itimers:  [3]unix.Itimerval{{Interval: unix.Timeval{Sec: 3}, Value: unix.Timeval{Usec: 5}}, {}, {Value: unix.Timeval{Sec: 9}}},
		Signals:  []remote.PendingSignal{{Info: si, Shared: true}, {Info: si}},
		Dumpable: 2,
	}
	b, err := json.Marshal(rec)
	if err != nil {
		t.Fatal(err)
	}
	var got TemplateRecord
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, rec) {
		t.Fatalf("round trip\n%+v\nwant\n%+v", got, rec)
	}
	t.Logf("%d bytes of JSON", len(b))
}

// BenchmarkReattach: the cost per template of taking it back (checks, seize, park), one
// template detached (Tracer.Close, as a daemon's death detaches it) before each round.
func BenchmarkReattach(b *testing.B) {
	pid := startInspectSubject(b)
	tr := remote.NewTracer()
	h, err := Hold(tr, pid)
	if err != nil {
		b.Fatal(err)
	}
	tmpl, err := h.Fork()
	if err != nil {
		h.Abort()
		b.Fatal(err)
	}
	if err := h.Release(); err != nil {
		b.Fatal(err)
	}
	defer reap(tmpl.HostPid)
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		rec, err := tmpl.Record()
		if err != nil {
			b.Fatal(err)
		}
		tr.Close() // detaches the template: it goes into its group stop
		if s := waitState(rec.HostPid, "T", 5*time.Second); s != 'T' {
			b.Fatalf("template state %q, want T", s)
		}
		tr = remote.NewTracer()
		b.StartTimer()
		if tmpl, err = Reattach(tr, rec); err != nil {
			b.Fatalf("round %d of %d: %v", i, b.N, err)
		}
	}
	b.StopTimer()
	tr.Close()
}
