//go:build linux && amd64

package remote

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// textAround reads the page at addr (where a batch's code goes) through /proc/PID/mem.
func textAround(t *testing.T, pid int, addr uintptr) []byte {
	t.Helper()
	f, err := os.Open(fmt.Sprintf("/proc/%d/mem", pid))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, pageSize)
	if _, err := f.ReadAt(b, int64(addr&^(pageSize-1))); err != nil {
		t.Fatal(err)
	}
	return b
}

// seizeBlocked seizes the python p once it is blocked reading its input.
func seizeBlocked(t *testing.T, p *proc) *Tracee {
	t.Helper()
	tr := newTracer(t)
	waitBlocked(t, p.pid, unix.SYS_READ)
	tc, err := tr.Seize(p.pid)
	if err != nil {
		t.Fatal(err)
	}
	return tc
}

func fdList(t *testing.T, pid int) string {
	t.Helper()
	es, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range es {
		names = append(names, e.Name())
	}
	return strings.Join(names, ",")
}

// TestBatch runs open, lseek, dup3 and close (the later calls taking the open's result)
// and a getpid in one batch in a python blocked in read; the fd is there at its offset,
// the code went to the vDSO's page, which is byte-identical afterwards, and the python
// goes on as before.
func TestBatch(t *testing.T) {
	requirePython(t)
	p := startPython(t)
	_, _, _, sum0 := answer(t, p.ask("add 3"))
	file := filepath.Join(t.TempDir(), "data")
	if err := os.WriteFile(file, []byte("0123456789"), 0o644); err != nil {
		t.Fatal(err)
	}
	tc := seizeBlocked(t, p)
	var b Batch
	fd := b.Add("open", unix.SYS_OPENAT, unix.AT_FDCWD, file, unix.O_RDONLY, 0)
	b.Add("lseek", unix.SYS_LSEEK, fd, 5, 0)
	b.Add("dup3", unix.SYS_DUP3, fd, 77, unix.O_CLOEXEC)
	b.Close("close", fd)
	b.Add("getpid", unix.SYS_GETPID)
	vdso := vdsoBase(p.pid)
	if vdso == 0 {
		t.Fatal("no AT_SYSINFO_EHDR in the python's auxv")
	}
	before := textAround(t, p.pid, vdso)
	res, err := tc.RunBatch(&b)
	if err != nil {
		t.Fatal(err)
	}
	if len(res) != 5 || res[1] != 5 || res[2] != 77 || res[3] != 0 || int(res[4]) != p.pid {
		t.Errorf("results %v; want [fd 5 77 0 %d]", res, p.pid)
	}
	if tc.codePage != vdso {
		t.Errorf("the batch's code went to %#x, not the vDSO at %#x", tc.codePage, vdso)
	}
	if after := textAround(t, p.pid, vdso); !bytes.Equal(before, after) {
		t.Errorf("the vDSO page differs after the batch")
	}
	pos, flags := fdinfo(t, p.pid, 77)
	if pos != 5 || flags&unix.O_CLOEXEC == 0 {
		t.Errorf("fd 77: pos %d flags %o; want pos 5 and O_CLOEXEC", pos, flags)
	}
	if _, err := os.Stat(fmt.Sprintf("/proc/%d/fd/%d", p.pid, res[0])); !os.IsNotExist(err) {
		t.Errorf("the batch's temporary fd %d is still open", res[0])
	}
	if err := tc.Detach(); err != nil {
		t.Fatal(err)
	}
	if _, n, _, sum := answer(t, p.ask("get")); n != 3 || sum != sum0 {
		t.Errorf("python after detach: n=%d sum=%d, want 3 %d", n, sum, sum0)
	}
}

// TestBatchFailure: a call that fails stops the batch there (the calls after it do not
// run), the descriptor opened for a close that was not reached is closed, and the error
// names the call and wraps its errno; the python goes on as before.
func TestBatchFailure(t *testing.T) {
	requirePython(t)
	p := startPython(t)
	answer(t, p.ask("add 1"))
	tr := newTracer(t)
	waitBlocked(t, p.pid, unix.SYS_READ)
	fds := fdList(t, p.pid)
	cwd, _ := os.Readlink(fmt.Sprintf("/proc/%d/cwd", p.pid))
	dir := t.TempDir()
	tc, err := tr.Seize(p.pid)
	if err != nil {
		t.Fatal(err)
	}
	var b Batch
	fd := b.Add("open /", unix.SYS_OPENAT, unix.AT_FDCWD, "/", unix.O_RDONLY|unix.O_DIRECTORY, 0)
	b.Add("open the missing file", unix.SYS_OPENAT, unix.AT_FDCWD, "/nonexistent/x", unix.O_RDONLY, 0)
	b.Add("chdir", unix.SYS_CHDIR, dir)
	b.Close("close", fd)
	res, err := tc.RunBatch(&b)
	var be *BatchError
	if !errors.As(err, &be) || be.Index != 1 || be.Name != "open the missing file" || !errors.Is(err, unix.ENOENT) {
		t.Fatalf("RunBatch = %v, %v; want a BatchError at call 1 wrapping ENOENT", res, err)
	}
	if len(res) != 1 {
		t.Errorf("%d results, want the 1 call before the failure", len(res))
	}
	if got := fdList(t, p.pid); got != fds {
		t.Errorf("fds after the failed batch %s, before %s", got, fds)
	}
	if got, _ := os.Readlink(fmt.Sprintf("/proc/%d/cwd", p.pid)); got != cwd {
		t.Errorf("cwd %s after the failed batch: the chdir after the failure ran", got)
	}
	if err := tc.Detach(); err != nil {
		t.Fatal(err)
	}
	if _, n, _, _ := answer(t, p.ask("add 1")); n != 2 {
		t.Errorf("n = %d, want 2", n)
	}
}

// TestBatchPages: a batch longer than a page of code runs in several pieces, and a Ref
// crosses from one to the next.
func TestBatchPages(t *testing.T) {
	requirePython(t)
	p := startPython(t)
	tc := seizeBlocked(t, p)
	var b Batch
	fd := b.Add("open", unix.SYS_OPENAT, unix.AT_FDCWD, "/", unix.O_RDONLY|unix.O_DIRECTORY, 0)
	for i := 0; i < 200; i++ {
		b.Add("getpid", unix.SYS_GETPID)
	}
	b.Add("dup3", unix.SYS_DUP3, fd, 78, 0)
	b.Close("close", fd)
	var args [][]operand
	for _, c := range b.calls {
		args = append(args, make([]operand, len(c.args)))
	}
	if _, next := compileBatch(b.calls, args, 0, 0); next >= b.Len() {
		t.Fatalf("the test's batch fits in one page (%d calls): it tests nothing", next)
	}
	res, err := tc.RunBatch(&b)
	if err != nil {
		t.Fatal(err)
	}
	for i := 1; i <= 200; i++ {
		if int(res[i]) != p.pid {
			t.Fatalf("call %d returned %d, want pid %d", i, res[i], p.pid)
		}
	}
	if l, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/78", p.pid)); err != nil || l != "/" {
		t.Errorf("fd 78 -> %q, %v; want /", l, err)
	}
	if err := tc.Detach(); err != nil {
		t.Fatal(err)
	}
	if _, n, _, _ := answer(t, p.ask("add 2")); n != 2 {
		t.Errorf("n = %d, want 2", n)
	}
}

// TestBatchSignal: a signal that arrives while a batch sleeps in ppoll is held, the sleep
// is restarted by the kernel (-ERESTARTNOHAND, no handler ran) and completes, and the signal is delivered once after
// Detach.
func TestBatchSignal(t *testing.T) {
	requirePython(t)
	p := startPython(t)
	tc := seizeBlocked(t, p)
	ts := unix.NsecToTimespec((200 * time.Millisecond).Nanoseconds())
	var b Batch
	b.Add("ppoll", unix.SYS_PPOLL, 0, 0, bytesOf(&ts), 0, 0)
	b.Add("getpid", unix.SYS_GETPID)
	go func() {
		time.Sleep(50 * time.Millisecond)
		unix.Kill(p.pid, unix.SIGUSR1)
	}()
	start := time.Now()
	res, err := tc.RunBatch(&b)
	if err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d < 200*time.Millisecond || res[0] != 0 || int(res[1]) != p.pid {
		t.Errorf("batch took %v, results %v; want >= 200ms (the sleep restarted), [0 %d]", d, res, p.pid)
	}
	if len(tc.held) != 1 {
		t.Errorf("%d signals held, want 1", len(tc.held))
	}
	if err := tc.Detach(); err != nil {
		t.Fatal(err)
	}
	if _, _, usr1, _ := answer(t, p.ask("get")); usr1 != 1 {
		t.Errorf("usr1 handler ran %d times, want 1", usr1)
	}
}

// TestBatchOut: output buffers get what the calls wrote (getitimer of an armed timer,
// read back after the batch).
func TestBatchOut(t *testing.T) {
	requirePython(t)
	p := startPython(t)
	tc := seizeBlocked(t, p)
	set := unix.Itimerval{Value: unix.Timeval{Sec: 100}, Interval: unix.Timeval{Sec: 7}}
	var b Batch
	b.Add("setitimer", unix.SYS_SETITIMER, unix.ITIMER_VIRTUAL, bytesOf(&set), 0)
	o := b.Out(int(unsafe.Sizeof(unix.Itimerval{})))
	b.Add("getitimer", unix.SYS_GETITIMER, unix.ITIMER_VIRTUAL, o)
	b.Add("disarm", unix.SYS_SETITIMER, unix.ITIMER_VIRTUAL, bytesOf(&unix.Itimerval{}), 0)
	if _, err := tc.RunBatch(&b); err != nil {
		t.Fatal(err)
	}
	got := *(*unix.Itimerval)(unsafe.Pointer(&o.Bytes()[0]))
	if got.Interval.Sec != 7 || got.Value.Sec < 99 || got.Value.Sec > 100 {
		t.Errorf("getitimer in the batch read %+v; want about %+v", got, set)
	}
	if err := tc.Detach(); err != nil {
		t.Fatal(err)
	}
}

// TestBatchFault: code that cannot run where it was written (a page without execute
// permission) fails the batch with an error, and the fault is not delivered to the
// tracee, which goes on as before with that page put back.
func TestBatchFault(t *testing.T) {
	requirePython(t)
	p := startPython(t)
	answer(t, p.ask("add 1"))
	tc := seizeBlocked(t, p)
	page := tc.startStack &^ (pageSize - 1) // argv and environment: rw-, not executable
	before := textAround(t, p.pid, page)
	tc.codePage = page
	var b Batch
	b.Add("getpid", unix.SYS_GETPID)
	if _, err := tc.RunBatch(&b); err == nil || !strings.Contains(err.Error(), "faulted") {
		t.Fatalf("RunBatch from a non-executable page: %v, want a fault", err)
	}
	if len(tc.held) != 0 {
		t.Errorf("%d signals held for the tracee, want none (the fault was ours)", len(tc.held))
	}
	if after := textAround(t, p.pid, page); !bytes.Equal(before, after) {
		t.Errorf("the page differs after the failed batch")
	}
	if err := tc.Detach(); err != nil {
		t.Fatal(err)
	}
	if _, n, _, _ := answer(t, p.ask("add 1")); n != 2 {
		t.Errorf("n = %d, want 2", n)
	}
}
