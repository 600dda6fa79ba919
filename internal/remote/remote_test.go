//go:build linux && amd64

package remote

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"deltabox/internal/testutil/skip"
)

// The tests really seize, inject into and fork processes, so they need root (or
// CAP_SYS_PTRACE plus CAP_CHECKPOINT_RESTORE for set_tid). Their subjects are a C helper
// (testdata/helper.c, compiled with gcc in TestMain) and python3.

var (
	helperPath string
	helperErr  error
	pythonPath string
)

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "remote-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	helperPath = filepath.Join(dir, "helper")
	if gcc, err := exec.LookPath("gcc"); err != nil {
		helperErr = fmt.Errorf("gcc not found: %w", err)
	} else if out, err := exec.Command(gcc, "-O1", "-Wall", "-o", helperPath, "testdata/helper.c").CombinedOutput(); err != nil {
		helperErr = fmt.Errorf("building testdata/helper.c: %v: %s", err, out)
	}
	// The distribution's python3 is exec'ed directly; a version manager's shim would be
	// a shell script that execs it later.
	for _, p := range []string{"/usr/bin/python3", "python3"} {
		if lp, err := exec.LookPath(p); err == nil {
			pythonPath = lp
			break
		}
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

func requireRoot(t *testing.T) {
	t.Helper()
	skip.Require(t, os.Geteuid() == 0, "needs root (ptrace of other processes, clone3 set_tid)")
}

func requireHelper(t *testing.T) {
	t.Helper()
	requireRoot(t)
	skip.Require(t, helperErr == nil, "C helper unavailable: %v", helperErr)
}

func requirePython(t *testing.T) {
	t.Helper()
	requireRoot(t)
	skip.Require(t, pythonPath != "", "python3 not found")
}

// proc is a subject process talking line by line on pipes.
type proc struct {
	t     *testing.T
	cmd   *exec.Cmd
	pid   int
	in    io.WriteCloser
	lines chan string
}

func start(t *testing.T, name string, args ...string) *proc {
	t.Helper()
	cmd := exec.Command(name, args...)
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &proc{t: t, cmd: cmd, pid: cmd.Process.Pid, in: in, lines: make(chan string, 100)}
	go readLines(out, p.lines)
	t.Cleanup(p.kill)
	if l := p.next(); !strings.HasPrefix(l, "ready") {
		t.Fatalf("%s: first line %q", name, l)
	}
	return p
}

func readLines(r io.Reader, ch chan<- string) {
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		ch <- sc.Text()
	}
	close(ch)
}

func (p *proc) next() string {
	p.t.Helper()
	return nextLine(p.t, p.lines)
}

func nextLine(t *testing.T, ch <-chan string) string {
	t.Helper()
	select {
	case l, ok := <-ch:
		if !ok {
			t.Fatal("subject closed its output")
		}
		return l
	case <-time.After(10 * time.Second):
		t.Fatal("no answer from the subject within 10 s")
	}
	return ""
}

func (p *proc) ask(line string) string {
	p.t.Helper()
	if _, err := fmt.Fprintln(p.in, line); err != nil {
		p.t.Fatal(err)
	}
	return p.next()
}

func (p *proc) kill() {
	_ = unix.Kill(p.pid, unix.SIGKILL)
	_ = p.cmd.Wait()
}

const pyREPL = `
import os, sys, signal
usr1 = 0
def on_usr1(s, f):
    global usr1
    usr1 += 1
signal.signal(signal.SIGUSR1, on_usr1)
n = 0
heap = [i * i for i in range(100000)]
print("ready", os.getpid(), flush=True)
while True:
    line = sys.stdin.readline()
    if not line:
        break
    w = line.split()
    if w and w[0] == "add":
        n += int(w[1])
        heap.append(n)
    print(os.getpid(), n, usr1, sum(heap) % 1000003, flush=True)
`

func startPython(t *testing.T) *proc {
	t.Helper()
	return start(t, pythonPath, "-c", pyREPL)
}

// answer parses the REPL's "pid n usr1 checksum".
func answer(t *testing.T, l string) (pid, n, usr1, sum int) {
	t.Helper()
	if _, err := fmt.Sscan(l, &pid, &n, &usr1, &sum); err != nil {
		t.Fatalf("bad answer %q: %v", l, err)
	}
	return
}

func procState(pid int) byte {
	st, err := readStat(pid)
	if err != nil {
		return 0
	}
	return st.state
}

// waitState waits until pid is in one of the states.
func waitState(t *testing.T, pid int, states string) {
	t.Helper()
	for i := 0; i < 500; i++ {
		if strings.IndexByte(states, procState(pid)) >= 0 {
			return
		}
		time.Sleep(2 * time.Millisecond)
	}
	t.Fatalf("pid %d in state %q, want one of %q", pid, procState(pid), states)
}

// waitBlocked waits until pid sleeps in syscall nr.
func waitBlocked(t *testing.T, pid int, nr int) {
	t.Helper()
	for i := 0; i < 500; i++ {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/syscall", pid))
		if f := strings.Fields(string(b)); len(f) > 0 && f[0] == strconv.Itoa(nr) && procState(pid) == 'S' {
			return
		}
		time.Sleep(2 * time.Millisecond)
	}
	t.Fatalf("pid %d not blocked in syscall %d", pid, nr)
}

func newTracer(t *testing.T) *Tracer {
	tr := NewTracer()
	t.Cleanup(func() {
		if err := tr.Close(); err != nil {
			t.Errorf("Tracer.Close: %v", err)
		}
	})
	return tr
}

func fdinfo(t *testing.T, pid, fd int) (pos int64, flags int) {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/fdinfo/%d", pid, fd))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) == 2 && f[0] == "pos:" {
			pos, _ = strconv.ParseInt(f[1], 10, 64)
		}
		if len(f) == 2 && f[0] == "flags:" {
			v, _ := strconv.ParseInt(f[1], 8, 64)
			flags = int(v)
		}
	}
	return
}

// TestInjectFileOps injects getpid/open/lseek/dup3/close into a python blocked in read and
// checks the result in /proc/PID/fdinfo; the python then goes on as before.
func TestInjectFileOps(t *testing.T) {
	requirePython(t)
	p := startPython(t)
	_, _, _, sum0 := answer(t, p.ask("add 3"))
	file := filepath.Join(t.TempDir(), "data")
	if err := os.WriteFile(file, []byte("0123456789"), 0o644); err != nil {
		t.Fatal(err)
	}
	tr := newTracer(t)
	waitBlocked(t, p.pid, unix.SYS_READ)
	tc, err := tr.Seize(p.pid)
	if err != nil {
		t.Fatal(err)
	}
	if !tc.InSyscall() || tc.Regs().Orig_rax != unix.SYS_READ {
		t.Fatalf("python not seized in read: orig_rax %d", int64(tc.Regs().Orig_rax))
	}
	const target = 77
	err = tr.Do(func() error {
		pid, err := tc.Getpid()
		if err != nil || pid != p.pid {
			return fmt.Errorf("getpid = %d, %v; want %d", pid, err, p.pid)
		}
		fd, err := tc.Open(file, unix.O_RDONLY, 0)
		if err != nil {
			return err
		}
		if off, err := tc.Lseek(fd, 5, io.SeekStart); err != nil || off != 5 {
			return fmt.Errorf("lseek = %d, %v", off, err)
		}
		if err := tc.Dup3(fd, target, unix.O_CLOEXEC); err != nil {
			return err
		}
		return tc.Close(fd)
	})
	if err != nil {
		t.Fatal(err)
	}
	pos, flags := fdinfo(t, p.pid, target)
	if pos != 5 || flags&unix.O_CLOEXEC == 0 || flags&unix.O_ACCMODE != unix.O_RDONLY {
		t.Errorf("fd %d: pos %d flags %o; want pos 5, O_RDONLY|O_CLOEXEC", target, pos, flags)
	}
	if l, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%d", p.pid, target)); err != nil || l != file {
		t.Errorf("fd %d -> %q, %v; want %s", target, l, err, file)
	}
	if err := tc.Detach(); err != nil {
		t.Fatal(err)
	}
	if _, n, _, sum := answer(t, p.ask("get")); n != 3 || sum != sum0 {
		t.Errorf("python after detach: n=%d sum=%d, want 3 %d", n, sum, sum0)
	}
	// A second session closes the fd again.
	tc, err = tr.Seize(p.pid)
	if err != nil {
		t.Fatal(err)
	}
	if err := tc.Close(target); err != nil {
		t.Fatal(err)
	}
	if err := tc.Detach(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(fmt.Sprintf("/proc/%d/fd/%d", p.pid, target)); !os.IsNotExist(err) {
		t.Errorf("fd %d still open: %v", target, err)
	}
	if _, n, _, _ := answer(t, p.ask("add 1")); n != 4 {
		t.Errorf("n = %d, want 4", n)
	}
}

func getFPRegs(pid int) (b [512]byte, err error) {
	_, _, e := unix.RawSyscall6(unix.SYS_PTRACE, unix.PTRACE_GETFPREGS, uintptr(pid), 0, uintptr(unsafe.Pointer(&b)), 0, 0)
	if e != 0 {
		err = e
	}
	return
}

// TestRestoreExact checks, on a C process blocked in read(2) on a pipe: the syscall is
// interrupted with -ERESTARTSYS; after injections, Restore gives back identical general
// and FP registers and identical stack memory below rsp (where the scratch data went); a
// re-seize after Detach sees the very same registers (the read was restarted and blocked
// again); and the read then completes with data written after the detach.
func TestRestoreExact(t *testing.T) {
	requireHelper(t)
	p := start(t, helperPath, "read")
	waitBlocked(t, p.pid, unix.SYS_READ)
	tr := newTracer(t)
	tc, err := tr.Seize(p.pid)
	if err != nil {
		t.Fatal(err)
	}
	regs := tc.Regs()
	if int64(regs.Orig_rax) != unix.SYS_READ || int64(regs.Rax) != -errRestartSys {
		t.Fatalf("seized with orig_rax %d rax %d; want read and -ERESTARTSYS", int64(regs.Orig_rax), int64(regs.Rax))
	}
	err = tr.Do(func() error {
		fp0, err := getFPRegs(p.pid)
		if err != nil {
			return err
		}
		// The stack the scratch memory may use: maxStackScratch below the red zone.
		lo := uintptr(regs.Rsp) - redZone - maxStackScratch
		mem0, err := tc.ReadMem(lo, maxStackScratch+redZone)
		if err != nil {
			return fmt.Errorf("reading the stack below rsp: %v", err)
		}
		if _, err := tc.Scratch(bytes.Repeat([]byte{0xa5}, 40<<10)); err != nil { // a big one
			return err
		}
		for i := 0; i < 5; i++ {
			fd, err := tc.Open("/proc/self/status", unix.O_RDONLY, 0)
			if err != nil {
				return err
			}
			if err := tc.Close(fd); err != nil {
				return err
			}
		}
		if _, err := tc.Open("/nonexistent/x", unix.O_RDONLY, 0); !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("open of a missing file: %v", err)
		}
		mem1, _ := tc.ReadMem(lo, maxStackScratch+redZone)
		if bytes.Equal(mem0, mem1) {
			return errors.New("scratch data did not go below the red zone")
		}
		if !bytes.Equal(mem0[len(mem0)-redZone:], mem1[len(mem1)-redZone:]) {
			return errors.New("the red zone was written")
		}
		if err := tc.Restore(); err != nil {
			return err
		}
		var now unix.PtraceRegs
		if err := unix.PtraceGetRegs(p.pid, &now); err != nil {
			return err
		}
		if now != regs {
			return fmt.Errorf("registers after Restore differ:\n got %+v\nwant %+v", now, regs)
		}
		fp1, err := getFPRegs(p.pid)
		if err != nil {
			return err
		}
		if fp0 != fp1 {
			return errors.New("FP registers changed")
		}
		mem2, _ := tc.ReadMem(lo, maxStackScratch+redZone)
		if !bytes.Equal(mem0, mem2) {
			return errors.New("stack memory not restored")
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := tc.Detach(); err != nil {
		t.Fatal(err)
	}
	waitBlocked(t, p.pid, unix.SYS_READ)
	tc, err = tr.Seize(p.pid)
	if err != nil {
		t.Fatal(err)
	}
	if again := tc.Regs(); again != regs {
		t.Errorf("registers at the second seize differ:\n got %+v\nwant %+v", again, regs)
	}
	if err := tc.Detach(); err != nil {
		t.Fatal(err)
	}
	if l := p.ask("hello"); l != "read 6 0 hello" {
		t.Errorf("after detach: %q, want the restarted read to return the data", l)
	}
}

// TestRestartSleep: a nanosleep interrupted by the seize shows -ERESTART_RESTARTBLOCK;
// after injections and a hold, it resumes through restart_syscall and ends at its
// original deadline.
func TestRestartSleep(t *testing.T) {
	requireHelper(t)
	p := start(t, helperPath, "sleep", "400")
	waitBlocked(t, p.pid, unix.SYS_NANOSLEEP)
	tr := newTracer(t)
	tc, err := tr.Seize(p.pid)
	if err != nil {
		t.Fatal(err)
	}
	if r := tc.Regs(); int64(r.Orig_rax) != unix.SYS_NANOSLEEP || int64(r.Rax) != -errRestartBlock {
		t.Fatalf("seized with orig_rax %d rax %d", int64(r.Orig_rax), int64(r.Rax))
	}
	for i := 0; i < 5; i++ {
		if _, err := tc.Getpid(); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := tc.Getitimer(unix.ITIMER_REAL); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	if err := tc.Detach(); err != nil {
		t.Fatal(err)
	}
	var ret, errno, ms int
	if _, err := fmt.Sscanf(p.next(), "sleep %d %d %d", &ret, &errno, &ms); err != nil {
		t.Fatal(err)
	}
	if ret != 0 || errno != 0 || ms < 400 || ms > 480 {
		t.Errorf("nanosleep(400ms) returned %d errno %d after %d ms; want 0 after ~400 ms", ret, errno, ms)
	}
}

// TestRestartPpoll: ppoll interrupted by the seize shows -ERESTARTNOHAND and completes
// (timeout, no EINTR) after the detach.
func TestRestartPpoll(t *testing.T) {
	requireHelper(t)
	p := start(t, helperPath, "ppoll", "300")
	waitBlocked(t, p.pid, unix.SYS_PPOLL)
	tr := newTracer(t)
	tc, err := tr.Seize(p.pid)
	if err != nil {
		t.Fatal(err)
	}
	if r := tc.Regs(); int64(r.Orig_rax) != unix.SYS_PPOLL || int64(r.Rax) != -errRestartNoHand {
		t.Fatalf("seized with orig_rax %d rax %d", int64(r.Orig_rax), int64(r.Rax))
	}
	if _, err := tc.Getpid(); err != nil {
		t.Fatal(err)
	}
	if err := tc.Detach(); err != nil {
		t.Fatal(err)
	}
	var ret, errno, ms int
	if _, err := fmt.Sscanf(p.next(), "ppoll %d %d %d", &ret, &errno, &ms); err != nil {
		t.Fatal(err)
	}
	if ret != 0 || errno != 0 || ms < 300 {
		t.Errorf("ppoll(300ms) returned %d errno %d after %d ms; want a timeout", ret, errno, ms)
	}
}

// TestGroupStop: a process seized in a group stop is injected into without being
// continued and stays stopped after Detach; a running one runs after Detach; DetachStopped
// leaves a running one stopped.
func TestGroupStop(t *testing.T) {
	requirePython(t)
	p := startPython(t)
	tr := newTracer(t)

	if err := unix.Kill(p.pid, unix.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	waitState(t, p.pid, "T")
	tc, err := tr.Seize(p.pid)
	if err != nil {
		t.Fatal(err)
	}
	if !tc.WasStopped() {
		t.Error("WasStopped = false for a SIGSTOPped process")
	}
	if pid, err := tc.Getpid(); err != nil || pid != p.pid {
		t.Fatalf("getpid in a group stop: %d, %v", pid, err)
	}
	if err := tc.Detach(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond)
	if s := procState(p.pid); s != 'T' {
		t.Fatalf("state %q after Detach of a stopped process, want T", s)
	}
	if err := unix.Kill(p.pid, unix.SIGCONT); err != nil {
		t.Fatal(err)
	}
	if _, n, _, _ := answer(t, p.ask("add 2")); n != 2 {
		t.Errorf("n = %d", n)
	}

	tc, err = tr.Seize(p.pid)
	if err != nil {
		t.Fatal(err)
	}
	if tc.WasStopped() {
		t.Error("WasStopped = true for a running process")
	}
	if _, err := tc.Getpid(); err != nil {
		t.Fatal(err)
	}
	if err := tc.Detach(); err != nil {
		t.Fatal(err)
	}
	if _, n, _, _ := answer(t, p.ask("add 2")); n != 4 {
		t.Errorf("n = %d", n)
	}

	tc, err = tr.Seize(p.pid)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tc.Getpid(); err != nil {
		t.Fatal(err)
	}
	if err := tc.DetachStopped(); err != nil {
		t.Fatal(err)
	}
	waitState(t, p.pid, "T")
	time.Sleep(30 * time.Millisecond)
	if s := procState(p.pid); s != 'T' {
		t.Fatalf("state %q after DetachStopped", s)
	}
	if err := unix.Kill(p.pid, unix.SIGCONT); err != nil {
		t.Fatal(err)
	}
	if _, n, _, _ := answer(t, p.ask("add 1")); n != 5 {
		t.Errorf("n = %d", n)
	}
}

// sigqueue sends sig with value val as sigqueue(3) does (si_code SI_QUEUE).
func sigqueue(pid int, sig unix.Signal, val int32) error {
	var si [128]byte
	put32 := func(off int, v uint32) {
		for i := 0; i < 4; i++ {
			si[off+i] = byte(v >> (8 * i))
		}
	}
	put32(0, uint32(sig))
	put32(8, uint32(0xffffffff)) // SI_QUEUE = -1
	put32(16, uint32(os.Getpid()))
	put32(24, uint32(val))
	_, _, e := unix.RawSyscall(unix.SYS_RT_SIGQUEUEINFO, uintptr(pid), uintptr(sig), uintptr(unsafe.Pointer(&si)))
	if e != 0 {
		return e
	}
	return nil
}

const sigRTMin = unix.Signal(34) // glibc's SIGRTMIN

// TestSignalsDuringInjection: signals that arrive while syscalls are injected are taken
// from the tracee and delivered after Detach exactly once, with their siginfo: a kill()
// SIGUSR1 (sender pid, SI_USER) and two queued real-time signals (values, in order).
func TestSignalsDuringInjection(t *testing.T) {
	requireHelper(t)
	p := start(t, helperPath, "sig")
	waitBlocked(t, p.pid, unix.SYS_READ)
	tr := newTracer(t)
	tc, err := tr.Seize(p.pid)
	if err != nil {
		t.Fatal(err)
	}
	err = tr.Do(func() error {
		if _, err := tc.Getpid(); err != nil {
			return err
		}
		if err := unix.Kill(p.pid, unix.SIGUSR1); err != nil {
			return err
		}
		if err := sigqueue(p.pid, sigRTMin, 7); err != nil {
			return err
		}
		if _, err := tc.Getpid(); err != nil { // takes the signals
			return err
		}
		if err := sigqueue(p.pid, sigRTMin, 8); err != nil {
			return err
		}
		for i := 0; i < 3; i++ {
			if _, err := tc.Open("/", unix.O_RDONLY, 0); err != nil {
				return err
			}
		}
		if len(tc.held) != 3 {
			return fmt.Errorf("%d signals held, want 3", len(tc.held))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := tc.Detach(); err != nil {
		t.Fatal(err)
	}
	// The handlers ran and interrupted the read (no SA_RESTART): one line per signal
	// delivery batch, then ours.
	want := fmt.Sprintf("sig usr1=1 usr1pid=%d usr1code=0 rt=2 rtvals=7,8 ", os.Getpid())
	var last string
	for i := 0; i < 4; i++ {
		last = p.next()
		if strings.HasPrefix(last, "sig usr1=1 ") && strings.Contains(last, "rt=2 ") {
			break
		}
	}
	if !strings.HasPrefix(last, want) || !strings.HasSuffix(last, "read=-1 errno=4") {
		t.Fatalf("after detach: %q, want %q... read=-1 errno=4", last, want)
	}
	if l := p.ask("x"); !strings.HasPrefix(l, want) || !strings.HasSuffix(l, "read=2 errno=0") {
		t.Errorf("signals delivered more than once? %q", l)
	}
}

// TestJobControlDuringInjection: a SIGSTOP that arrives while injecting stops the process
// after Detach; a SIGSTOP followed by SIGCONT leaves it running.
func TestJobControlDuringInjection(t *testing.T) {
	requirePython(t)
	p := startPython(t)
	tr := newTracer(t)

	tc, err := tr.Seize(p.pid)
	if err != nil {
		t.Fatal(err)
	}
	err = tr.Do(func() error {
		if err := unix.Kill(p.pid, unix.SIGSTOP); err != nil {
			return err
		}
		_, err := tc.Getpid()
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := tc.Detach(); err != nil {
		t.Fatal(err)
	}
	waitState(t, p.pid, "T")
	time.Sleep(20 * time.Millisecond)
	if s := procState(p.pid); s != 'T' {
		t.Fatalf("state %q: the SIGSTOP was lost", s)
	}
	unix.Kill(p.pid, unix.SIGCONT)
	if _, n, _, _ := answer(t, p.ask("add 1")); n != 1 {
		t.Errorf("n = %d", n)
	}

	tc, err = tr.Seize(p.pid)
	if err != nil {
		t.Fatal(err)
	}
	err = tr.Do(func() error {
		unix.Kill(p.pid, unix.SIGSTOP)
		if _, err := tc.Getpid(); err != nil {
			return err
		}
		unix.Kill(p.pid, unix.SIGCONT)
		_, err := tc.Getpid()
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := tc.Detach(); err != nil {
		t.Fatal(err)
	}
	if _, n, _, _ := answer(t, p.ask("add 1")); n != 2 {
		t.Errorf("n = %d", n)
	}
}

// TestFailedSyscall: an injected open of a missing file returns ENOENT (a plain errno, not
// a TraceeError) and the tracee goes on unharmed; refused syscalls are refused.
func TestFailedSyscall(t *testing.T) {
	requirePython(t)
	p := startPython(t)
	tr := newTracer(t)
	tc, err := tr.Seize(p.pid)
	if err != nil {
		t.Fatal(err)
	}
	_, err = tc.Open("/nonexistent/file", unix.O_RDONLY, 0)
	var te *TraceeError
	if !errors.Is(err, unix.ENOENT) || errors.As(err, &te) {
		t.Fatalf("open of a missing file: %v", err)
	}
	if _, err := tc.Syscall(unix.SYS_CLOSE, 12345); err != unix.EBADF {
		t.Errorf("close(12345) = %v, want EBADF", err)
	}
	if _, err := tc.Syscall(unix.SYS_EXECVE, 0, 0, 0); !errors.Is(err, ErrRefused) {
		t.Errorf("execve: %v, want ErrRefused", err)
	}
	if _, err := tc.Syscall(unix.SYS_GETPPID); err != nil {
		t.Error(err)
	}
	if err := tc.Detach(); err != nil {
		t.Fatal(err)
	}
	if _, n, _, _ := answer(t, p.ask("add 7")); n != 7 {
		t.Errorf("n = %d", n)
	}
}

// TestUserCode: a process spinning in user code (orig_rax -1, no syscall instruction at
// rip-2) is injected into through a syscall instruction found in its vDSO, and spins on.
func TestUserCode(t *testing.T) {
	requireHelper(t)
	p := start(t, helperPath, "spin")
	for i := 0; cpuTicks(p.pid) == 0; i++ { // past its last syscall, spinning
		if i == 1000 {
			t.Fatal("helper does not spin")
		}
		time.Sleep(time.Millisecond)
	}
	tr := newTracer(t)
	tc, err := tr.Seize(p.pid)
	if err != nil {
		t.Fatal(err)
	}
	if tc.InSyscall() {
		t.Fatalf("spinning process seized in syscall %d", int64(tc.Regs().Orig_rax))
	}
	if pid, err := tc.Getpid(); err != nil || pid != p.pid {
		t.Fatalf("getpid = %d, %v", pid, err)
	}
	if _, err := tc.Scratch([]byte("x")); err != nil {
		t.Fatal(err)
	}
	sc := tc.SyscallAddr()
	maps, _ := os.ReadFile(fmt.Sprintf("/proc/%d/maps", p.pid))
	in := ""
	for _, l := range strings.Split(string(maps), "\n") {
		var lo, hi uintptr
		if _, err := fmt.Sscanf(l, "%x-%x", &lo, &hi); err == nil && sc >= lo && sc < hi {
			in = l
		}
	}
	t.Logf("syscall instruction at %#x in %s", sc, in)
	if !strings.HasSuffix(in, "[vdso]") {
		t.Errorf("syscall instruction not taken from the vDSO")
	}
	if err := tc.Detach(); err != nil {
		t.Fatal(err)
	}
	t0 := cpuTicks(p.pid)
	time.Sleep(100 * time.Millisecond)
	if t1 := cpuTicks(p.pid); t1 <= t0 {
		t.Errorf("process does not run after Detach (utime %d -> %d)", t0, t1)
	}
}

func cpuTicks(pid int) int {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
	u, _ := strconv.Atoi(f[11])
	return u
}

// TestOffStack: a process whose rsp is not on its main stack gets its scratch data in an
// injected anonymous mapping, which Restore removes: /proc/PID/maps is the same after,
// and signals taken meanwhile are delivered after Detach.
func TestOffStack(t *testing.T) {
	requireHelper(t)
	p := start(t, helperPath, "offstack")
	waitBlocked(t, p.pid, unix.SYS_READ)
	maps0, _ := os.ReadFile(fmt.Sprintf("/proc/%d/maps", p.pid))
	tr := newTracer(t)
	tc, err := tr.Seize(p.pid)
	if err != nil {
		t.Fatal(err)
	}
	rsp := uintptr(tc.Regs().Rsp)
	mem0, err := tc.ReadMem(rsp-4096, 4096)
	if err != nil {
		t.Fatal(err)
	}
	fd, err := tc.Open("/proc/self/status", unix.O_RDONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	addr, err := tc.ScratchString("in the arena")
	if err != nil {
		t.Fatal(err)
	}
	if addr > rsp-4096 && addr < rsp {
		t.Errorf("scratch at %#x, just below rsp %#x on a stack that is not the main one", addr, rsp)
	}
	if maps1, _ := os.ReadFile(fmt.Sprintf("/proc/%d/maps", p.pid)); bytes.Equal(maps0, maps1) {
		t.Error("no arena mapping while injecting")
	}
	if err := tc.Close(fd); err != nil {
		t.Fatal(err)
	}
	// Signals taken while injecting are re-queued through the arena too.
	if err := unix.Kill(p.pid, unix.SIGUSR1); err != nil {
		t.Fatal(err)
	}
	if err := sigqueue(p.pid, sigRTMin, 9); err != nil {
		t.Fatal(err)
	}
	if _, err := tc.Getpid(); err != nil {
		t.Fatal(err)
	}
	if err := tc.Restore(); err != nil {
		t.Fatal(err)
	}
	if mem1, _ := tc.ReadMem(rsp-4096, 4096); !bytes.Equal(mem0, mem1) {
		t.Error("memory below rsp changed")
	}
	if err := tc.Detach(); err != nil {
		t.Fatal(err)
	}
	if maps2, _ := os.ReadFile(fmt.Sprintf("/proc/%d/maps", p.pid)); !bytes.Equal(maps0, maps2) {
		t.Errorf("maps differ after Detach:\n%s\n---\n%s", maps0, maps2)
	}
	want := fmt.Sprintf("sig usr1=1 usr1pid=%d usr1code=0 rt=1 rtvals=9 ", os.Getpid())
	if l := p.next(); l != want+"read=-1 errno=4" {
		t.Errorf("after detach: %q, want %q", l, want+"read=-1 errno=4")
	}
	if l := p.ask("hi"); l != want+"read=3 errno=0" {
		t.Errorf("after detach: %q", l)
	}
}

// redirect makes the stopped child c read its stdin from a new pipe and write its stdout
// to another, opened through this process's /proc/PID/fd; it returns the test's ends.
func redirect(t *testing.T, c *Tracee) (in io.WriteCloser, lines chan string) {
	t.Helper()
	inR, inW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { inR.Close(); inW.Close(); outR.Close(); outW.Close() })
	err = c.tr.Do(func() error {
		for _, r := range []struct {
			f      *os.File
			target int
			flags  int
		}{{inR, 0, unix.O_RDONLY}, {outW, 1, unix.O_WRONLY}} {
			fd, err := c.Open(fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), r.f.Fd()), r.flags, 0)
			if err != nil {
				return err
			}
			if err := c.Dup3(fd, r.target, 0); err != nil {
				return err
			}
			if err := c.Close(fd); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	lines = make(chan string, 100)
	go readLines(outR, lines)
	return inW, lines
}

// TestForkPython forks a live python with an injected clone3, both as its own child and as
// a sibling (CLONE_PARENT), and checks that the child has the parent's heap: the same
// answers to the same command, from another pid.
func TestForkPython(t *testing.T) {
	requirePython(t)
	p := startPython(t)
	_, n0, _, _ := answer(t, p.ask("add 40"))
	tr := newTracer(t)
	for _, args := range []CloneArgs{
		{ExitSignal: unix.SIGCHLD},
		{Flags: unix.CLONE_PARENT},
	} {
		tc, err := tr.Seize(p.pid)
		if err != nil {
			t.Fatal(err)
		}
		t0 := time.Now()
		child, err := tc.Clone3(args)
		if err != nil {
			t.Fatal(err)
		}
		d := time.Since(t0)
		if child.Regs() != tc.Regs() {
			t.Error("child's saved registers are not the parent's")
		}
		in, lines := redirect(t, child)
		if err := child.Detach(); err != nil {
			t.Fatal(err)
		}
		if err := tc.Detach(); err != nil {
			t.Fatal(err)
		}
		t.Logf("clone3 %+v: %v, child %d", args, d, child.Pid())
		fmt.Fprintln(in, "add 2")
		cpid, cn, _, csum := answer(t, nextLine(t, lines))
		if cpid != child.ClonedAs() {
			t.Errorf("child's getpid %d, ClonedAs %d", cpid, child.ClonedAs())
		}
		ppid, pn, _, psum := answer(t, p.ask("add 2"))
		if cpid != child.Pid() || ppid != p.pid {
			t.Errorf("answers from pids %d and %d, want %d and %d", cpid, ppid, child.Pid(), p.pid)
		}
		if cn != pn || csum != psum || cn != n0+2 {
			t.Errorf("child n=%d sum=%d, parent n=%d sum=%d: heaps differ", cn, csum, pn, psum)
		}
		n0 = pn
		unix.Kill(child.Pid(), unix.SIGKILL)
		ppar := parentOf(child.Pid())
		if args.Flags&unix.CLONE_PARENT != 0 {
			if ppar != os.Getpid() {
				t.Errorf("CLONE_PARENT child's parent %d, want the test process %d", ppar, os.Getpid())
			}
			var ws unix.WaitStatus
			unix.Wait4(child.Pid(), &ws, 0, nil)
		} else if ppar != p.pid && ppar != 0 {
			t.Errorf("fork child's parent %d, want python %d", ppar, p.pid)
		}
	}
}

func parentOf(pid int) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
	ppid, _ := strconv.Atoi(f[1])
	return ppid
}

// TestTemplateSetTID runs the fast path's checkpoint/restore with a python: checkpoint =
// clone3(CLONE_PARENT) child kept in a SIGSTOP group stop as the template while the
// original goes on; restore = kill and reap the original, re-seize the stopped template,
// clone3 with set_tid = the original's pid. The restored process has the original's pid
// and the checkpoint's heap, and the template stays stopped.
func TestTemplateSetTID(t *testing.T) {
	requirePython(t)
	p := startPython(t)
	_, _, _, sumAt5 := answer(t, p.ask("add 5"))
	tr := newTracer(t)

	ta, err := tr.Seize(p.pid)
	if err != nil {
		t.Fatal(err)
	}
	tmpl, err := ta.Clone3(CloneArgs{Flags: unix.CLONE_PARENT})
	if err != nil {
		t.Fatal(err)
	}
	tpid := tmpl.Pid()
	t.Cleanup(func() {
		unix.Kill(tpid, unix.SIGKILL)
		var ws unix.WaitStatus
		unix.Wait4(tpid, &ws, 0, nil)
	})
	if err := tmpl.DetachStopped(); err != nil {
		t.Fatal(err)
	}
	if err := ta.Detach(); err != nil {
		t.Fatal(err)
	}
	waitState(t, tpid, "T")
	if _, n, _, _ := answer(t, p.ask("add 10")); n != 15 {
		t.Fatalf("live process n = %d", n)
	}

	live := p.pid
	for round := 0; round < 3; round++ {
		t0 := time.Now()
		if err := unix.Kill(live, unix.SIGKILL); err != nil {
			t.Fatal(err)
		}
		var ws unix.WaitStatus
		if _, err := unix.Wait4(live, &ws, 0, nil); err != nil {
			t.Fatal(err)
		}
		t1 := time.Now()
		tt, err := tr.Seize(tpid)
		if err != nil {
			t.Fatal(err)
		}
		if !tt.WasStopped() {
			t.Error("template not in a group stop")
		}
		c, err := tt.Clone3(CloneArgs{Flags: unix.CLONE_PARENT, SetTID: []int{live}})
		if err != nil {
			t.Fatal(err)
		}
		if err := c.Detach(); err != nil {
			t.Fatal(err)
		}
		if err := tt.Detach(); err != nil {
			t.Fatal(err)
		}
		d := time.Since(t1)
		dk := t1.Sub(t0)
		if c.Pid() != live {
			t.Fatalf("restored pid %d, want %d", c.Pid(), live)
		}
		// The restored process talks on the original's pipes (the template holds them).
		pid, n, _, sum := answer(t, p.ask("add 1"))
		if pid != live || n != 6 || sum == sumAt5 {
			t.Errorf("restored process answers pid %d n %d; want pid %d n 6 (the checkpoint's 5 + 1)", pid, n, live)
		}
		time.Sleep(20 * time.Millisecond)
		if s := procState(tpid); s != 'T' {
			t.Fatalf("template in state %q after the restore, want T", s)
		}
		t.Logf("restore round %d: kill+reap of the live process %v; seize template + clone3 set_tid + detach both %v", round, dk, d)
	}
	unix.Kill(live, unix.SIGKILL)
	var ws unix.WaitStatus
	unix.Wait4(live, &ws, 0, nil)
}

// TestRestoreFailureKills: when the tracee cannot be restored it is killed, not left
// half-modified, and the error says so.
func TestRestoreFailureKills(t *testing.T) {
	requireHelper(t)
	p := start(t, helperPath, "read")
	tr := newTracer(t)
	tc, err := tr.Seize(p.pid)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tc.Getpid(); err != nil {
		t.Fatal(err)
	}
	tr.Do(func() error {
		testHookRestore = func(*Tracee) error { return errors.New("injected failure") }
		return nil
	})
	err = tc.Detach()
	tr.Do(func() error { testHookRestore = nil; return nil })
	var te *TraceeError
	if !errors.As(err, &te) || !te.Killed {
		t.Fatalf("Detach with a failing restore: %v, want a TraceeError with Killed", err)
	}
	t.Log(err)
	if _, err := os.Stat(fmt.Sprintf("/proc/%d", p.pid)); !os.IsNotExist(err) {
		t.Errorf("process still exists (state %q)", procState(p.pid))
	}
	if err := tc.Detach(); !errors.Is(err, ErrNotAttached) {
		t.Errorf("Detach after the kill: %v", err)
	}
}

// TestCloseRestores: closing a Tracer with a modified tracee restores and detaches it.
func TestCloseRestores(t *testing.T) {
	requirePython(t)
	p := startPython(t)
	tr := NewTracer()
	tc, err := tr.Seize(p.pid)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tc.Open("/", unix.O_RDONLY, 0); err != nil {
		t.Fatal(err)
	}
	if err := tr.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := tc.Getpid(); !errors.Is(err, ErrClosed) {
		t.Errorf("call after Close: %v", err)
	}
	if _, n, _, _ := answer(t, p.ask("add 9")); n != 9 {
		t.Errorf("n = %d", n)
	}
}

// TestManyTracees: one Tracer drives several tracees for goroutines calling concurrently.
func TestManyTracees(t *testing.T) {
	requirePython(t)
	tr := newTracer(t)
	var ps []*proc
	for i := 0; i < 3; i++ {
		ps = append(ps, startPython(t))
	}
	var wg sync.WaitGroup
	errs := make(chan error, len(ps))
	for _, p := range ps {
		wg.Add(1)
		go func(p *proc) {
			defer wg.Done()
			for i := 0; i < 30; i++ {
				tc, err := tr.Seize(p.pid)
				if err != nil {
					errs <- err
					return
				}
				if pid, err := tc.Getpid(); err != nil || pid != p.pid {
					errs <- fmt.Errorf("getpid %d: %d, %v", p.pid, pid, err)
				}
				if err := tc.Detach(); err != nil {
					errs <- err
					return
				}
			}
		}(p)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	for i, p := range ps {
		if _, n, _, _ := answer(t, p.ask(fmt.Sprintf("add %d", i))); n != i {
			t.Errorf("python %d: n = %d", i, n)
		}
	}
}

func median(ds []time.Duration) time.Duration {
	sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
	return ds[len(ds)/2]
}

// TestCosts measures (and logs) what injection costs on a live python: seize+detach, a
// 10-syscall sequence in one Do, one syscall per call from another goroutine, and a
// clone3 fork (seize, clone3, detach both).
func TestCosts(t *testing.T) {
	requirePython(t)
	p := startPython(t)
	tr := newTracer(t)
	file := filepath.Join(t.TempDir(), "f")
	os.WriteFile(file, []byte("abcdef"), 0o644)
	const rounds = 30
	var seize, seq, one, fork, forkAll []time.Duration
	for i := 0; i < rounds; i++ {
		t0 := time.Now()
		tc, err := tr.Seize(p.pid)
		if err != nil {
			t.Fatal(err)
		}
		t1 := time.Now()
		err = tr.Do(func() error {
			fd, err := tc.Open(file, unix.O_RDONLY, 0)
			if err != nil {
				return err
			}
			if _, err := tc.Lseek(fd, 3, io.SeekStart); err != nil {
				return err
			}
			if err := tc.Dup3(fd, 90, unix.O_CLOEXEC); err != nil {
				return err
			}
			if err := tc.Close(fd); err != nil {
				return err
			}
			if err := tc.Close(90); err != nil {
				return err
			}
			if _, err := tc.Getpid(); err != nil {
				return err
			}
			if _, err := tc.Getitimer(unix.ITIMER_REAL); err != nil {
				return err
			}
			if _, err := tc.Prctl(unix.PR_GET_DUMPABLE, 0, 0, 0, 0); err != nil {
				return err
			}
			if err := tc.Chdir("/"); err != nil {
				return err
			}
			_, err = tc.Getpid()
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		t2 := time.Now()
		if _, err := tc.Getpid(); err != nil {
			t.Fatal(err)
		}
		t3 := time.Now()
		if err := tc.Detach(); err != nil {
			t.Fatal(err)
		}
		t4 := time.Now()
		seize = append(seize, t1.Sub(t0)+t4.Sub(t3))
		seq = append(seq, t2.Sub(t1))
		one = append(one, t3.Sub(t2))
	}
	for i := 0; i < rounds; i++ {
		t0 := time.Now()
		tc, err := tr.Seize(p.pid)
		if err != nil {
			t.Fatal(err)
		}
		t1 := time.Now()
		c, err := tc.Clone3(CloneArgs{Flags: unix.CLONE_PARENT})
		if err != nil {
			t.Fatal(err)
		}
		t2 := time.Now()
		if err := c.DetachStopped(); err != nil {
			t.Fatal(err)
		}
		if err := tc.Detach(); err != nil {
			t.Fatal(err)
		}
		t3 := time.Now()
		fork = append(fork, t2.Sub(t1))
		forkAll = append(forkAll, t3.Sub(t0))
		unix.Kill(c.Pid(), unix.SIGKILL)
		var ws unix.WaitStatus
		unix.Wait4(c.Pid(), &ws, 0, nil)
	}
	st, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", p.pid))
	rss := ""
	for _, l := range strings.Split(string(st), "\n") {
		if strings.HasPrefix(l, "VmRSS") {
			rss = strings.Join(strings.Fields(l)[1:], " ")
		}
	}
	t.Logf("python (RSS %s), medians of %d: seize+detach %v; 10 injected syscalls in one Do %v (%v each); one syscall from another goroutine %v; clone3 %v; seize+clone3+detach both %v",
		rss, rounds, median(seize), median(seq), median(seq)/10, median(one), median(fork), median(forkAll))
	if _, n, _, _ := answer(t, p.ask("add 1")); n != 1 {
		t.Errorf("n = %d", n)
	}
}

// TestWrappers exercises the remaining helpers on a fork child of a python (so the
// python itself keeps its session, name and cwd).
func TestWrappers(t *testing.T) {
	requirePython(t)
	p := startPython(t)
	tr := newTracer(t)
	tc, err := tr.Seize(p.pid)
	if err != nil {
		t.Fatal(err)
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
	in, lines := redirect(t, c)
	dir := t.TempDir()
	err = tr.Do(func() error {
		// setsid: the child is not a process group leader.
		if sid, err := c.Setsid(); err != nil || sid != cpid {
			return fmt.Errorf("setsid = %d, %v", sid, err)
		}
		// interval timers
		v := unix.Itimerval{Value: unix.Timeval{Sec: 100}}
		if old, err := c.Setitimer(unix.ITIMER_REAL, v); err != nil || old != (unix.Itimerval{}) {
			return fmt.Errorf("setitimer: old %+v, %v", old, err)
		}
		if cur, err := c.Getitimer(unix.ITIMER_REAL); err != nil || cur.Value.Sec < 99 || cur.Value.Sec > 100 {
			return fmt.Errorf("getitimer: %+v, %v", cur, err)
		}
		if old, err := c.Setitimer(unix.ITIMER_REAL, unix.Itimerval{}); err != nil || old.Value.Sec < 99 {
			return fmt.Errorf("setitimer(0): old %+v, %v", old, err)
		}
		// ioctl on a new pty master
		fd, err := c.Open("/dev/ptmx", unix.O_RDWR|unix.O_NOCTTY, 0)
		if err != nil {
			return err
		}
		if err := c.IoctlSetWinsize(fd, unix.Winsize{Row: 33, Col: 111}); err != nil {
			return err
		}
		if ws, err := c.IoctlGetWinsize(fd); err != nil || ws.Row != 33 || ws.Col != 111 {
			return fmt.Errorf("winsize %+v, %v", ws, err)
		}
		tio, err := c.IoctlGetTermios(fd)
		if err != nil {
			return err
		}
		tio.Lflag &^= unix.ECHO
		if err := c.IoctlSetTermios(fd, unix.TCSETS, tio); err != nil {
			return err
		}
		if got, err := c.IoctlGetTermios(fd); err != nil || got.Lflag&unix.ECHO != 0 {
			return fmt.Errorf("termios not set: %v", err)
		}
		if _, err := c.Ioctl(fd, unix.TIOCGPTN, 0); !errors.Is(err, unix.EFAULT) {
			return fmt.Errorf("ioctl with a bad pointer: %v, want EFAULT", err)
		}
		if err := c.Close(fd); err != nil {
			return err
		}
		// setns into its own UTS namespace, fchdir, chdir
		nsfd, err := c.Open("/proc/self/ns/uts", unix.O_RDONLY, 0)
		if err != nil {
			return err
		}
		if err := c.Setns(nsfd, unix.CLONE_NEWUTS); err != nil {
			return err
		}
		if err := c.Close(nsfd); err != nil {
			return err
		}
		dfd, err := c.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY, 0)
		if err != nil {
			return err
		}
		if err := c.Fchdir(dfd); err != nil {
			return err
		}
		if cwd, _ := os.Readlink(fmt.Sprintf("/proc/%d/cwd", cpid)); cwd != dir {
			return fmt.Errorf("cwd after fchdir %q", cwd)
		}
		c.Close(dfd)
		if err := c.Chdir("/"); err != nil {
			return err
		}
		// mmap, madvise(MADV_POPULATE_WRITE), munmap
		a, err := c.Mmap(0, 1<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS, -1, 0)
		if err != nil {
			return err
		}
		if err := c.Madvise(a, 1<<20, unix.MADV_POPULATE_WRITE); err != nil {
			return err
		}
		if err := c.Munmap(a, 1<<20); err != nil {
			return err
		}
		// prctl with a string in scratch memory
		name, err := c.ScratchString("tmpl-child")
		if err != nil {
			return err
		}
		if _, err := c.Prctl(unix.PR_SET_NAME, name, 0, 0, 0); err != nil {
			return err
		}
		// a signal the tracee sends itself arrives after Detach, once
		if err := c.Signal(0, unix.SIGUSR1); err != nil {
			return err
		}
		_, err = c.Getpid()
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Detach(); err != nil {
		t.Fatal(err)
	}
	if comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", cpid)); string(comm) != "tmpl-child\n" {
		t.Errorf("comm %q", comm)
	}
	fmt.Fprintln(in, "add 0")
	if pid, _, usr1, _ := answer(t, nextLine(t, lines)); pid != cpid || usr1 != 1 {
		t.Errorf("child answers pid %d usr1 %d; want %d and 1", pid, usr1, cpid)
	}
	if _, _, usr1, _ := answer(t, p.ask("add 0")); usr1 != 0 {
		t.Errorf("parent got %d SIGUSR1", usr1)
	}
}

// TestTraceeKilled: a tracee killed by someone else while held gives a TraceeError with
// Exited, and the Tracer goes on with its other tracees.
func TestTraceeKilled(t *testing.T) {
	requireHelper(t)
	p1 := start(t, helperPath, "read")
	p2 := start(t, helperPath, "read")
	tr := newTracer(t)
	t1, err := tr.Seize(p1.pid)
	if err != nil {
		t.Fatal(err)
	}
	t2, err := tr.Seize(p2.pid)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := t1.Getpid(); err != nil {
		t.Fatal(err)
	}
	unix.Kill(p1.pid, unix.SIGKILL)
	_, err = t1.Getpid()
	var te *TraceeError
	if !errors.As(err, &te) || !te.Exited {
		t.Fatalf("getpid in a killed tracee: %v", err)
	}
	if _, err := t2.Getpid(); err != nil {
		t.Fatal(err)
	}
	if err := t2.Detach(); err != nil {
		t.Fatal(err)
	}
	if l := p2.ask("ok"); l != "read 3 0 ok" {
		t.Errorf("other tracee: %q", l)
	}
}

// TestHoldMM: the holder shares the tracee's address space (same mm: kcmp KCMP_VM),
// never runs (stopped, no CPU time), keeps the memory when the tracee is killed (its
// RSS stays), and is in a session and group of its own, so that the tracee's PID is
// free once the tracee is reaped, holder alive.
func TestHoldMM(t *testing.T) {
	requirePython(t)
	p := startPython(t)
	answer(t, p.ask("add 1"))
	tr := newTracer(t)
	tc, err := tr.Seize(p.pid)
	if err != nil {
		t.Fatal(err)
	}
	host, pid, err := tc.HoldMM()
	if err != nil {
		t.Fatal(err)
	}
	if host != pid { // same PID namespace as the test
		t.Errorf("holder host pid %d, pid %d: want equal here", host, pid)
	}
	if parentOf(host) != os.Getpid() {
		t.Errorf("holder's parent %d, want the tracee's parent %d (CLONE_PARENT)", parentOf(host), os.Getpid())
	}
	if r, _, errno := unix.Syscall6(unix.SYS_KCMP, uintptr(p.pid), uintptr(host), 1 /* KCMP_VM */, 0, 0, 0); errno != 0 || r != 0 {
		t.Errorf("kcmp(KCMP_VM) of tracee and holder: %d %v, want 0 (same address space)", r, errno)
	}
	waitState(t, host, "T")
	// pgrp and session are fields 5 and 6 of stat: the holder's own, so that the
	// tracee's PID, which names its group and session, is free once it is reaped.
	if st, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", host)); err == nil {
		f := strings.Fields(string(st[strings.LastIndexByte(string(st), ')')+2:]))
		if f[2] != strconv.Itoa(host) || f[3] != strconv.Itoa(host) {
			t.Errorf("holder %d in group %s, session %s: want its own (the tracee's PID must not stay taken)", host, f[2], f[3])
		}
	}
	if err := tc.Detach(); err != nil {
		t.Fatal(err)
	}
	// The tracee still works (its registers and scratch were put back).
	if _, n, _, _ := answer(t, p.ask("add 2")); n != 3 {
		t.Errorf("tracee after HoldMM: n=%d, want 3", n)
	}
	rss := func(pid int) int {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
		for _, l := range strings.Split(string(b), "\n") {
			if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
				n, _ := strconv.Atoi(f[1])
				return n
			}
		}
		return -1
	}
	before := rss(host)
	p.kill() // kill and reap
	if _, err := os.Stat(fmt.Sprintf("/proc/%d", p.pid)); err == nil {
		t.Errorf("the tracee's pid %d is still taken after it was reaped", p.pid)
	}
	if after := rss(host); after < before/2 || before < 1000 {
		t.Errorf("holder RSS %d kB after the tracee died (was %d): the memory was torn down", after, before)
	}
	if procState(host) != 'T' || cpuTicks(host) != 0 {
		t.Errorf("holder state %c, %d CPU ticks: want stopped, never run", procState(host), cpuTicks(host))
	}
	unix.Kill(host, unix.SIGKILL)
	var ws unix.WaitStatus
	if _, err := unix.Wait4(host, &ws, 0, nil); err != nil || !ws.Signaled() {
		t.Errorf("holder: wait %v, status %v", err, ws)
	}
}

// TestForgetLaterEndsBeforeClose: the goroutine that collects a killed tracee
// (ForgetLater, as fastpath's Template.Kill uses it) is the Tracer's: once Close has
// returned, none is left running (a bare go tr.Forget outlived it).
func TestForgetLaterEndsBeforeClose(t *testing.T) {
	requirePython(t)
	for i := 0; i < 10; i++ {
		p := startPython(t)
		tr := NewTracer()
		if _, err := tr.Seize(p.pid); err != nil {
			t.Fatal(err)
		}
		unix.Kill(p.pid, unix.SIGKILL)
		for j := 0; j < 20; j++ {
			tr.ForgetLater(p.pid)
		}
		tr.Close() // may say the process is gone: its Forget came after the detach
		buf := make([]byte, 1<<20)
		if st := string(buf[:runtime.Stack(buf, true)]); strings.Contains(st, "remote.(*Tracer).Forget") {
			t.Fatalf("a Forget goroutine runs after Close returned:\n%s", st)
		}
	}
}

// TestDetachReturnsStopped: Detach and DetachStopped of a tracee seized in a group stop
// return once the tracee is back in TASK_STOPPED (a tracer that seizes it earlier, CRIU,
// gets the group stop's trap and its interrupt's as one), and WaitQueuedStop once a
// process given SIGSTOP before its detach (as CRIU leaves the processes it restores
// stopped) has taken it. The tracee is pinned to the tracer thread's CPU at SCHED_IDLE, so that it cannot
// run between the detach and the state read unless the call waits for it.
func TestDetachReturnsStopped(t *testing.T) {
	requirePython(t)
	p := startPython(t)
	tr := newTracer(t)
	err := tr.Do(func() error {
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
		if err := unix.SchedSetaffinity(p.pid, &one); err != nil {
			return err
		}
		return unix.SchedSetAttr(p.pid, &unix.SchedAttr{Size: unix.SizeofSchedAttr, Policy: unix.SCHED_IDLE}, 0)
	})
	if err != nil {
		t.Fatal(err)
	}
	// afterDetach runs detach on the tracer's thread and reads the state right after it.
	afterDetach := func(detach func() error) byte {
		t.Helper()
		var st byte
		if err := tr.Do(func() error {
			if err := detach(); err != nil {
				return err
			}
			st = procState(p.pid)
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		return st
	}
	running := func() {
		t.Helper()
		if err := unix.Kill(p.pid, unix.SIGCONT); err != nil {
			t.Fatal(err)
		}
		if _, n, _, _ := answer(t, p.ask("add 1")); n == 0 {
			t.Fatal("the REPL did not answer")
		}
	}

	runnable := 0
	for i := range 20 {
		// Seized in a group stop.
		if err := unix.Kill(p.pid, unix.SIGSTOP); err != nil {
			t.Fatal(err)
		}
		waitState(t, p.pid, "T")
		tc, err := tr.Seize(p.pid)
		if err != nil {
			t.Fatal(err)
		}
		if st := afterDetach(tc.Detach); st != 'T' {
			t.Fatalf("round %d: state %q when Detach of a tracee seized stopped returned, want T", i, st)
		}
		running()

		// The same, let go with DetachStopped.
		if err := unix.Kill(p.pid, unix.SIGSTOP); err != nil {
			t.Fatal(err)
		}
		waitState(t, p.pid, "T")
		if tc, err = tr.Seize(p.pid); err != nil {
			t.Fatal(err)
		}
		if st := afterDetach(tc.DetachStopped); st != 'T' {
			t.Fatalf("round %d: state %q when DetachStopped of a tracee seized stopped returned, want T", i, st)
		}
		running()

		// SIGSTOP queued before a plain detach, as CRIU's restore does.
		if tc, err = tr.Seize(p.pid); err != nil {
			t.Fatal(err)
		}
		st := afterDetach(func() error {
			if err := unix.Kill(p.pid, unix.SIGSTOP); err != nil {
				return err
			}
			if err := tc.Detach(); err != nil {
				return err
			}
			return nil
		})
		if st == 'R' {
			runnable++
		}
		if st = tr0(tr, func() byte { return WaitQueuedStop(p.pid) }); st != 'T' {
			t.Fatalf("round %d: state %q when WaitQueuedStop returned, want T", i, st)
		}
		running()
	}
	// How often the window was there to be waited out (the pinning's evidence).
	t.Logf("a SIGSTOP queued before the detach was still pending after it in %d of 20 rounds", runnable)
}

// tr0 runs f on the tracer's thread (pinned by the caller) and returns its answer.
func tr0(tr *Tracer, f func() byte) (b byte) {
	_ = tr.Do(func() error { b = f(); return nil })
	return b
}
