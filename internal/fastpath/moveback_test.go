package fastpath

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"deltabox/internal/remote"
	"deltabox/internal/testutil/skip"
)

// mapper is testdata/mapper.c running on a terminal (the fast path takes no pipes).
type mapper struct {
	t      *testing.T
	pid    int
	master *os.File
	lines  chan string
}

// startMapper builds and starts testdata/mapper.c mapping file, and waits until it is
// blocked reading its terminal.
func startMapper(t *testing.T, file string) *mapper {
	t.Helper()
	skip.Require(t, os.Geteuid() == 0, "needs root (ptrace, setns, map_files)")
	gcc, err := exec.LookPath("gcc")
	skip.Require(t, err == nil, "gcc not found")
	bin := filepath.Join(t.TempDir(), "mapper")
	if out, err := exec.Command(gcc, "-O1", "-Wall", "-o", bin, "testdata/mapper.c").CombinedOutput(); err != nil {
		t.Fatalf("building testdata/mapper.c: %v: %s", err, out)
	}
	master, err := os.OpenFile("/dev/ptmx", os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { master.Close() })
	if err := unix.IoctlSetPointerInt(int(master.Fd()), unix.TIOCSPTLCK, 0); err != nil {
		t.Fatal(err)
	}
	n, err := unix.IoctlGetUint32(int(master.Fd()), unix.TIOCGPTN)
	if err != nil {
		t.Fatal(err)
	}
	slave, err := os.OpenFile(fmt.Sprintf("/dev/pts/%d", n), os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	tio, _ := unix.IoctlGetTermios(int(slave.Fd()), unix.TCGETS)
	tio.Lflag &^= unix.ECHO
	unix.IoctlSetTermios(int(slave.Fd()), unix.TCSETS, tio)
	cmd := exec.Command(bin, file)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = slave, slave, slave
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	slave.Close()
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	m := &mapper{t: t, pid: cmd.Process.Pid, master: master, lines: make(chan string, 10)}
	go func() {
		sc := bufio.NewScanner(master)
		for sc.Scan() {
			m.lines <- strings.TrimRight(sc.Text(), "\r")
		}
		close(m.lines)
	}()
	if l := m.next(); l != "ready" {
		t.Fatalf("subject says %q", l)
	}
	for i := 0; i < 500; i++ { // blocked in read
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", m.pid))
		if i := bytes.LastIndexByte(b, ')'); i > 0 && b[i+2] == 'S' {
			break
		}
		time.Sleep(2 * time.Millisecond)
	}
	return m
}

func (m *mapper) next() string {
	m.t.Helper()
	select {
	case l := <-m.lines:
		return l
	case <-time.After(5 * time.Second):
		m.t.Fatal("no answer from the subject")
	}
	return ""
}

func (m *mapper) ask(c string) string {
	m.t.Helper()
	fmt.Fprintln(m.master, c)
	return m.next()
}

// TestMoveBackMapsBack: a move that is undone puts a writable shared mapping back on the
// very file it mapped. Between Fork and Move the mapped path is made to name another
// file (as the new state's copy would be): Move maps that one, MoveBack the original
// again (through the template's map_files), and the process's writes reach the original.
func TestMoveBackMapsBack(t *testing.T) {
	file := filepath.Join(t.TempDir(), "data")
	if err := os.WriteFile(file, append([]byte("orig"), make([]byte, 4092)...), 0o644); err != nil {
		t.Fatal(err)
	}
	sub := startMapper(t, file)
	pid := sub.pid
	tr := remote.NewTracer()
	defer tr.Close()
	h, err := Hold(tr, pid)
	if err != nil {
		t.Fatal(err)
	}
	if len(h.P.Maps) != 1 || h.P.Maps[0].Path != file {
		t.Fatalf("mappings to remap: %+v", h.P.Maps)
	}
	m := h.P.Maps[0]
	tmpl, err := h.Fork()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		var ws unix.WaitStatus
		unix.Wait4(tmpl.HostPid, &ws, 0, nil)
	})
	// The path now names another file.
	if err := os.Rename(file, file+".orig"); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(file, append([]byte("new"), make([]byte, 4093)...), 0o644); err != nil {
		t.Fatal(err)
	}
	inode := func(p string) uint64 {
		t.Helper()
		var st unix.Stat_t
		if err := unix.Stat(p, &st); err != nil {
			t.Fatal(err)
		}
		return st.Ino
	}
	mapped := func() uint64 { return inode(fmt.Sprintf("/proc/%d/map_files/%x-%x", pid, m.Start, m.End)) }
	if err := h.Move(ownMountNS(t)); err != nil {
		t.Fatal(err)
	}
	if got, want := mapped(), inode(file); got != want {
		t.Fatalf("after Move the process maps inode %d, want the new file's %d", got, want)
	}
	if err := h.Abort(); err != nil { // MoveBack, kill the template, Release
		t.Fatal(err)
	}
	if got, want := mapped(), inode(file+".orig"); got != want {
		t.Fatalf("after MoveBack the process maps inode %d, want the original's %d", got, want)
	}
	if l := sub.ask("read"); l != "map=orig" {
		t.Fatalf("mapping after MoveBack: %q", l)
	}
	sub.ask("write back")
	if b, _ := os.ReadFile(file + ".orig"); !bytes.HasPrefix(b, []byte("back\x00")) {
		t.Errorf("a write through the mapping did not reach the original file: %q", b[:8])
	}
	if b, _ := os.ReadFile(file); !bytes.HasPrefix(b, []byte("new\x00")) {
		t.Errorf("the other file changed: %q", b[:8])
	}
}

// TestForkRecordsPendingSignals: a template records the signals pending at its fork,
// which fork does not copy into it: a kill()ed SIGUSR1 with its siginfo (sender kept),
// and a SIGUSR2 pending without a queue entry (sigqueue()d while the process's
// RLIMIT_SIGPENDING was 0), with the siginfo the kernel would deliver for it (SI_USER
// from pid 0). The live process keeps both pending.
func TestForkRecordsPendingSignals(t *testing.T) {
	file := filepath.Join(t.TempDir(), "data")
	if err := os.WriteFile(file, make([]byte, 4096), 0o644); err != nil {
		t.Fatal(err)
	}
	sub := startMapper(t, file)
	if err := unix.Prlimit(sub.pid, unix.RLIMIT_SIGPENDING, &unix.Rlimit{}, nil); err != nil {
		t.Fatal(err)
	}
	var si [128]byte
	si[0] = byte(unix.SIGUSR2)
	copy(si[8:], []byte{0xff, 0xff, 0xff, 0xff}) // SI_QUEUE: not exempt from the limit
	if _, _, e := unix.RawSyscall(unix.SYS_RT_SIGQUEUEINFO, uintptr(sub.pid), uintptr(unix.SIGUSR2), uintptr(unsafe.Pointer(&si))); e != 0 {
		t.Fatal(e)
	}
	if err := unix.Kill(sub.pid, unix.SIGUSR1); err != nil {
		t.Fatal(err)
	}
	both := uint64(1<<(unix.SIGUSR1-1) | 1<<(unix.SIGUSR2-1))
	if m := shdPnd(t, sub.pid); m != both {
		t.Fatalf("subject's ShdPnd %#x, want %#x", m, both)
	}
	tr := remote.NewTracer()
	defer tr.Close()
	h, err := Hold(tr, sub.pid)
	if err != nil {
		t.Fatal(err)
	}
	tmpl, err := h.Fork()
	if err != nil {
		h.Abort()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		var ws unix.WaitStatus
		unix.Wait4(tmpl.HostPid, &ws, 0, nil)
	})
	if !tmpl.WaitStopped(5 * time.Second) {
		t.Fatal("the template did not reach its stop")
	}
	// Its own SIGSTOP stays queued while the tracer holds it (KeepStopped); nothing else.
	if m := shdPnd(t, tmpl.HostPid) &^ (1 << (unix.SIGSTOP - 1)); m != 0 {
		t.Errorf("fork left signals pending in the template: %#x", m)
	}
	var got []string
	for _, s := range tmpl.Signals {
		sender := int32(uint32(s.Info[16]) | uint32(s.Info[17])<<8 | uint32(s.Info[18])<<16 | uint32(s.Info[19])<<24)
		got = append(got, fmt.Sprintf("%d/%d/%d/%v", s.Info.Signo(), s.Info.Code(), sender, s.Shared))
	}
	want := fmt.Sprintf("[10/0/%d/true 12/0/0/true]", os.Getpid())
	if fmt.Sprint(got) != want {
		t.Errorf("recorded pending signals %v, want %s", got, want)
	}
	if err := h.Abort(); err != nil {
		t.Fatal(err)
	}
	if m := shdPnd(t, sub.pid); m != both {
		t.Errorf("subject's ShdPnd after the fork %#x, want %#x", m, both)
	}
}

// ownMountNS is an fd on the test's own mount namespace, the one its tracees are in
// (a move onto it is a move onto the same namespace), closed at the test's end.
func ownMountNS(t *testing.T) int {
	fd, err := unix.Open("/proc/self/ns/mnt", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return fd
}
