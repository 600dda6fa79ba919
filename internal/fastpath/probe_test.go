package fastpath

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/remote"
	"deltabox/internal/testutil/skip"
)

// TestProbeMayWriteAgreesWithSmaps: Hold learns VM_MAYWRITE of read-only shared mappings
// with an injected mprotect instead of the smaps walk. The answer must be the kernel's
// own (smaps "mw"), and the probe must leave the process's mappings exactly as they were:
// the same /proc/PID/maps text and VmFlags before and after, and a read-only mapping of
// a file opened for writing can still be made writable by the process afterwards.
func TestProbeMayWriteAgreesWithSmaps(t *testing.T) {
	skip.Require(t, os.Geteuid() == 0, "needs root (ptrace, /proc/PID/map_files)")
	py, err := exec.LookPath("python3")
	skip.Require(t, err == nil, "needs python3")
	dir := t.TempDir()
	file := filepath.Join(dir, "data")
	if err := os.WriteFile(file, make([]byte, 3*4096), 0o644); err != nil {
		t.Fatal(err)
	}
	// ro: read-only file, read-only shared; rom: file opened r+, read-only shared;
	// rw: file opened r+, writable shared. After "go" it makes rom writable and writes.
	prog := `import mmap, os, sys
os.closerange(3, 4096)
f = open(sys.argv[1], 'rb'); g = open(sys.argv[1], 'r+b')
ro = mmap.mmap(f.fileno(), 4096, mmap.MAP_SHARED, mmap.PROT_READ)
rom = mmap.mmap(g.fileno(), 4096, mmap.MAP_SHARED, mmap.PROT_READ, offset=4096)
rw = mmap.mmap(g.fileno(), 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=8192)
f.close(); g.close()
print("ready", flush=True)
sys.stdin.readline()
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
for l in open('/proc/self/maps'):
    a, perms, off = l.split()[0], l.split()[1], l.split()[2]
    if perms == 'r--s' and int(off, 16) == 4096 and sys.argv[1] in l:
        lo, hi = (int(x, 16) for x in a.split('-'))
        r = libc.mprotect(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 3)
        print("mprotect", r, ctypes.get_errno(), flush=True)
`
	cmd := exec.Command(py, "-c", prog, file)
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	out := bufio.NewReader(stdout)
	if l, err := out.ReadString('\n'); err != nil || l != "ready\n" {
		t.Fatalf("python: %q %v", l, err)
	}
	pid := cmd.Process.Pid
	base := "/proc/" + strconv.Itoa(pid)
	mapsBefore, _ := os.ReadFile(base + "/maps")
	smapsBefore, _ := os.ReadFile(base + "/smaps")
	mw := parseSmapsMayWrite(smapsBefore)

	tr := remote.NewTracer()
	defer tr.Close()
	tt, err := tr.Seize(pid)
	if err != nil {
		t.Fatal(err)
	}
	asked := map[uint64]bool{}
	err = tr.Do(func() error {
		probe := probeMayWrite(tt)
		for _, m := range parseMaps(mapsBefore) {
			if m.perms[3] != 's' || m.perms[1] == 'w' || !strings.Contains(m.path, file) {
				continue
			}
			got, err := probe(m.start, m.end, 1) // PROT_READ
			if err != nil {
				return err
			}
			asked[m.start] = true
			if got != mw[m.start] {
				t.Errorf("mapping %x (%s at %x): probe says may-write %v, smaps %v", m.start, m.perms, m.offset, got, mw[m.start])
			}
			if m.offset == 4096 && !got {
				t.Errorf("the read-only mapping of the file opened r+ was probed not writable")
			}
			if m.offset == 0 && got {
				t.Errorf("the read-only mapping of the file opened read-only was probed writable")
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(asked) != 2 {
		t.Fatalf("probed %d read-only shared mappings of %s, want 2", len(asked), file)
	}
	if err := tt.Detach(); err != nil {
		t.Fatal(err)
	}
	mapsAfter, _ := os.ReadFile(base + "/maps")
	if string(mapsAfter) != string(mapsBefore) {
		t.Errorf("maps changed by the probe:\nbefore:\n%s\nafter:\n%s", mapsBefore, mapsAfter)
	}
	smapsAfter, _ := os.ReadFile(base + "/smaps")
	if a, b := vmFlags(smapsBefore), vmFlags(smapsAfter); a != b {
		t.Errorf("VmFlags changed by the probe:\nbefore %s\nafter  %s", a, b)
	}
	stdin.Write([]byte("go\n"))
	if l, _ := out.ReadString('\n'); l != "mprotect 0 0\n" {
		t.Errorf("the process could not make its read-only mapping of a file opened r+ writable after the probe: %q", l)
	}
}

func vmFlags(smaps []byte) string {
	var out []string
	for _, l := range strings.Split(string(smaps), "\n") {
		if strings.HasPrefix(l, "VmFlags:") {
			out = append(out, l)
		}
	}
	return strings.Join(out, "|")
}

// TestIsPtySlave: a terminal is recognised by its device, not only by its path (one
// opened through a torn-down state namespace reads as "/N").
func TestIsPtySlave(t *testing.T) {
	m, err := os.OpenFile("/dev/ptmx", os.O_RDWR, 0)
	if err != nil {
		t.Skipf("no /dev/ptmx: %v", err)
	}
	defer m.Close()
	sfd, err := unix.IoctlRetInt(int(m.Fd()), unix.TIOCGPTPEER)
	if err != nil {
		// TIOCGPTPEER needs the slave unlocked first.
		unix.IoctlSetPointerInt(int(m.Fd()), unix.TIOCSPTLCK, 0)
		if sfd, err = unix.IoctlRetInt(int(m.Fd()), unix.TIOCGPTPEER); err != nil {
			t.Fatal(err)
		}
	}
	defer unix.Close(sfd)
	self := "/proc/self/fd/"
	if !isPtySlave(self + strconv.Itoa(sfd)) {
		t.Errorf("a pty slave (fd %d) not recognised", sfd)
	}
	n, _ := os.Open("/dev/null")
	defer n.Close()
	if isPtySlave(self + strconv.Itoa(int(n.Fd()))) {
		t.Error("/dev/null taken for a pty slave")
	}
	if isPtySlave(self + strconv.Itoa(int(m.Fd()))) {
		t.Error("the pty master taken for a slave")
	}
}

// TestDupTerminalIsInspectFD: an fd that is the very description of a lower terminal fd
// (a session's 0, 1 and 2) is answered by kcmp (dupTerminal) with what inspectFD finds;
// another open of the same terminal, its own description, is not, and is inspected.
func TestDupTerminalIsInspectFD(t *testing.T) {
	skip.Require(t, os.Geteuid() == 0, "needs root (kcmp, /proc/PID/fdinfo of a child)")
	m, err := os.OpenFile("/dev/ptmx", os.O_RDWR, 0)
	if err != nil {
		t.Skipf("no /dev/ptmx: %v", err)
	}
	defer m.Close()
	unix.IoctlSetPointerInt(int(m.Fd()), unix.TIOCSPTLCK, 0)
	sfd, err := unix.IoctlRetInt(int(m.Fd()), unix.TIOCGPTPEER)
	if err != nil {
		t.Fatal(err)
	}
	tty := os.NewFile(uintptr(sfd), "tty")
	defer tty.Close()
	other, err := os.OpenFile(fmt.Sprintf("/proc/self/fd/%d", sfd), os.O_RDWR, 0) // the same terminal, a new description
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	py, err := exec.LookPath("python3")
	skip.Require(t, err == nil, "needs python3")
	cmd := exec.Command(py, "-c", "import os, time; os.closerange(4, 4096); time.sleep(1000)")
	cmd.Stdin, cmd.Stdout, cmd.Stderr, cmd.ExtraFiles = tty, tty, tty, []*os.File{other}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	pid := cmd.Process.Pid
	noWrite := func(uint64, uint64, int) (bool, error) { return false, nil }
	var p *Proc
	for i := 0; i < 300; i++ { // until it has closed what it inherited beyond 0-3
		if p, err = inspect(pid, noWrite, lookupSelf); err == nil && len(p.FDs) == 4 {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err != nil || len(p.FDs) != 4 {
		t.Fatalf("inspect: %v %+v", err, p)
	}
	base := "/proc/" + strconv.Itoa(pid)
	for i, fd := range p.FDs {
		want, err := inspectFD(&Proc{HostPid: pid, Pid: pid, FDs: p.FDs[:i]}, base, fd.Num, nil, lookupSelf, anyMount)
		if err != nil || want == nil || fmt.Sprint(fd) != fmt.Sprint(*want) {
			t.Errorf("fd %d: inspect has %+v, inspectFD %+v (%v)", fd.Num, fd, want, err)
		}
		_, dup := dupTerminal(&Proc{HostPid: pid, Pid: pid, FDs: p.FDs[:i]}, fd.Num)
		if dup != (fd.Num == 1 || fd.Num == 2) {
			t.Errorf("fd %d: dupTerminal %v, want it for 1 and 2 only (3 is its own description)", fd.Num, dup)
		}
	}
}
