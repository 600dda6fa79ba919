package durable

import (
	"bytes"
	"context"
	"encoding/base64"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/apitypes"
	"deltabox/internal/criu"
	"deltabox/internal/procfs"
	"deltabox/internal/testutil"
)

// runner is CRIU as it works here, or a skip saying why not. The test fails if a
// restore could not give back the thread it started CRIU from.
func runner(t testing.TB) *criu.Runner {
	t.Helper()
	t.Cleanup(func() {
		if n := threadsDiscarded.Load(); n != 0 {
			t.Errorf("%d threads discarded by restores (their way back to our namespaces failed)", n)
		}
	})
	testutil.Require(t, os.Geteuid() == 0, "needs root (CRIU)")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// DELTABOX_CRIU: another CRIU binary than scripts/setup.sh's (a patched build).
	r := criu.Probe(ctx, os.Getenv("DELTABOX_CRIU"))
	testutil.Require(t, r.Usable(), "CRIU does not work here: %s", r)
	return r
}

// sandboxSession is a sandbox of a test daemon with a python session in it.
type sandboxSession struct {
	d       *testutil.Daemon
	id      string
	initPid int // host PID of the sandbox's init
	pid     int // the session's PID in the sandbox
	hostPid int
}

func newSandboxSession(t *testing.T, id string) *sandboxSession {
	t.Helper()
	d := testutil.StartDaemon(t)
	ctx := t.Context()
	info, err := d.C.Create(ctx, apitypes.CreateOptions{ID: id})
	if err != nil {
		t.Fatal(err)
	}
	si, err := d.C.StartSession(ctx, id, apitypes.SessionOptions{Name: "py", Kind: apitypes.SessionPython})
	if err != nil {
		t.Fatal(err)
	}
	s := &sandboxSession{d: d, id: id, initPid: info.InitPid, pid: si.Pid}
	if s.hostPid = childWithInnerPid(info.InitPid, si.Pid); s.hostPid == 0 {
		t.Fatalf("no child of init %d has pid %d in the sandbox", info.InitPid, si.Pid)
	}
	return s
}

func (s *sandboxSession) run(t testing.TB, code string) string {
	t.Helper()
	r, err := s.d.C.Run(t.Context(), s.id, "py", code, 60*time.Second)
	if err != nil {
		t.Fatalf("%q: %v", code, err)
	}
	if r.ExitCode != 0 {
		t.Fatalf("%q: exit %d: %s%s", code, r.ExitCode, r.Stdout, r.Stderr)
	}
	return strings.TrimSpace(r.Stdout)
}

// childWithInnerPid is the host PID of init's child whose PID in the sandbox is inner.
func childWithInnerPid(initPid, inner int) int {
	tasks, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", initPid))
	for _, tk := range tasks {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/children", initPid, tk.Name()))
		for _, f := range strings.Fields(string(b)) {
			p, _ := strconv.Atoi(f)
			if in, err := procfs.InnerPid(p); err == nil && in == inner {
				return p
			}
		}
	}
	return 0
}

// nsFiles opens the namespaces of pid as Restore wants them, and lists its cgroups.
func nsFiles(t testing.TB, pid int) Sandbox {
	t.Helper()
	open := func(n string) *os.File {
		f, err := os.Open(fmt.Sprintf("/proc/%d/ns/%s", pid, n))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		return f
	}
	cg, err := CgroupsOf(pid)
	if err != nil {
		t.Fatal(err)
	}
	return Sandbox{PID: open("pid"), User: open("user"), Net: open("net"), IPC: open("ipc"), UTS: open("uts"), Mnt: open("mnt"), Time: open("time"),
		Cgroup: open("cgroup"), Cgroups: cg}
}

// pty is a new pseudo-terminal in the devpts that pid sees (the sandbox's own), its
// slave owned by the sandbox's root and tty group (5), echo off as the session's driver
// set it: what the daemon's session gives a restored process.
type pty struct{ master, slave *os.File }

func newPty(t testing.TB, pid int) *pty {
	t.Helper()
	m, err := os.OpenFile(fmt.Sprintf("/proc/%d/root/dev/pts/ptmx", pid), os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	if err := unix.IoctlSetPointerInt(int(m.Fd()), unix.TIOCSPTLCK, 0); err != nil {
		t.Fatal(err)
	}
	// TIOCGPTPEER's argument is the slave's open flags.
	sfd, _, errno := unix.Syscall(unix.SYS_IOCTL, m.Fd(), unix.TIOCGPTPEER, unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC)
	if errno != 0 {
		t.Fatal(errno)
	}
	s := os.NewFile(uintptr(sfd), "pty-slave")
	base := uidBase(t, pid)
	if err := s.Chown(base, base+5); err != nil {
		t.Fatal(err)
	}
	tio, err := unix.IoctlGetTermios(int(sfd), unix.TCGETS)
	if err != nil {
		t.Fatal(err)
	}
	tio.Lflag &^= unix.ECHO
	if err := unix.IoctlSetTermios(int(sfd), unix.TCSETS, tio); err != nil {
		t.Fatal(err)
	}
	return &pty{master: m, slave: s}
}

func uidBase(t testing.TB, pid int) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/uid_map", pid))
	if err != nil {
		t.Fatal(err)
	}
	f := strings.Fields(string(b))
	n, _ := strconv.Atoi(f[1])
	return n
}

// call runs code in the restored session's driver (internal/session's python driver:
// base64 chunks on "C" lines, then "R<id>") and returns its output before the sentinel.
func (p *pty) call(t testing.TB, code string, timeout time.Duration) string {
	t.Helper()
	id := strconv.FormatInt(time.Now().UnixNano(), 36)
	msg := "C" + base64.StdEncoding.EncodeToString([]byte(code)) + "\nR" + id + "\n"
	if _, err := p.master.Write([]byte(msg)); err != nil {
		t.Fatal(err)
	}
	sentinel := []byte("\x1eDBX:" + id + ":")
	var out []byte
	buf := make([]byte, 4096)
	p.master.SetReadDeadline(time.Now().Add(timeout))
	for {
		n, err := p.master.Read(buf)
		out = append(out, buf[:n]...)
		if i := bytes.Index(out, sentinel); i >= 0 && bytes.IndexByte(out[i+1:], 0x1e) >= 0 {
			rc := string(out[i+len(sentinel) : i+1+bytes.IndexByte(out[i+1:], 0x1e)])
			if rc != "0" {
				t.Fatalf("%q: exit %s: %q", code, rc, out[:i])
			}
			return strings.TrimSpace(strings.ReplaceAll(string(out[:i]), "\r\n", "\n"))
		}
		if err != nil {
			t.Fatalf("%q: no answer from the restored session within %v (%v); it printed %q", code, timeout, err, out)
		}
	}
}

// kill ends host PID pid and waits until init has reaped it.
func kill(t testing.TB, pid int) {
	t.Helper()
	syscall.Kill(pid, syscall.SIGKILL)
	for deadline := time.Now().Add(5 * time.Second); ; {
		if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); os.IsNotExist(err) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("pid %d still there 5 s after SIGKILL", pid)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func ppid(pid int) int {
	f, err := procfs.Stat(pid)
	if err != nil {
		return 0
	}
	n, _ := strconv.Atoi(string(f[1]))
	return n
}

// TestDumpRestoreSession: a python session of a sandbox (50 MB of random bytes and a
// dict) is dumped while it runs, changes after the dump, is killed, and restored into
// the same sandbox from its image: it has its PID back, is the init's child, and answers
// on its terminal with the state it had at the dump.
func TestDumpRestoreSession(t *testing.T) {
	r := runner(t)
	s := newSandboxSession(t, "dur")
	h := s.run(t, "import os, hashlib\nx = bytearray(os.urandom(50 << 20))\nstate = {'n': 41}\nhashlib.sha256(x).hexdigest()")

	dir := filepath.Join(s.d.Root, "durable", "img1")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	m, err := Dump(t.Context(), r, s.hostPid, dir, DumpOptions{LogLevel: logLevelFromEnv()})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("dump: %v (CRIU %.3f s), ttys %v", time.Since(t0), m.DumpS, m.TTYs)
	if d := os.Getenv("DELTABOX_DEBUG"); d != "" {
		exec.Command("cp", filepath.Join(dir, DumpLog), d).Run()
	}
	if m.Pid != s.pid || len(m.TTYs) != 1 {
		t.Fatalf("manifest: pid %d (want %d), ttys %v (want the session's one)", m.Pid, s.pid, m.TTYs)
	}
	// The sandbox's network namespace is not in the image (CRIU ran in it): no dump of
	// the host's conntrack table (Dump says why), and Restore joins the namespace.
	if nets, _ := filepath.Glob(filepath.Join(dir, "net*.img")); len(nets) > 0 {
		t.Fatalf("the image holds the network namespace: %v", nets)
	}
	netns := nsLink(s.hostPid, "net")
	// Its pages go to a page store (the image keeps refs) and come back for the restore.
	ps, err := OpenPageStore(filepath.Join(s.d.Root, "durable", "pages"))
	if err != nil {
		t.Fatal(err)
	}
	defer ps.Close()
	ist, err := ps.Ingest(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("ingest: %+v", *ist)
	// The dump left it running: it answers, and changes after the image.
	if got := s.run(t, "state['n'] += 1; x[0] ^= 0xff; state['n']"); got != "42" {
		t.Fatalf("after the dump: %q, want 42", got)
	}

	cgroups, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", s.hostPid))
	if err != nil {
		t.Fatal(err)
	}
	cgns := nsLink(s.hostPid, "cgroup")
	sb := nsFiles(t, s.hostPid)
	p := newPty(t, s.hostPid)
	sb.TTYs = map[string]*os.File{m.TTYs[0]: p.slave}
	kill(t, s.hostPid)

	t0 = time.Now()
	if err := ps.Materialize(dir); err != nil {
		t.Fatal(err)
	}
	materialized := time.Since(t0)
	st, err := Restore(t.Context(), r, dir, sb, RestoreOptions{LogLevel: logLevelFromEnv()})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("restored: host pid %d, state %c", st.HostPid, procfs.State(st.HostPid))
	if d := os.Getenv("DELTABOX_DEBUG"); d != "" {
		exec.Command("cp", filepath.Join(dir, RestoreLog), d+".restore").Run()
	}
	if os.Getenv("DELTABOX_DEBUG") != "" {
		n, _ := unix.IoctlGetInt(int(p.master.Fd()), unix.TIOCGPTN)
		out, _ := exec.Command("sh", "-c", fmt.Sprintf("ls -l /proc/%d/fd/; grep -E 'State|PPid|NSpid' /proc/%d/status; stat -L -c '%%t %%T %%D' /proc/%d/fd/0", st.HostPid, st.HostPid, st.HostPid)).CombinedOutput()
		t.Logf("our pty %d; restored:\n%s", n, out)
	}
	restored := time.Since(t0)
	p.slave.Close()
	got := p.call(t, "(os.getpid(), state['n'], hashlib.sha256(x).hexdigest())", 30*time.Second)
	answered := time.Since(t0)
	t.Logf("restore: %v (pages back %v, CRIU %.3f s), first answer %v after the restore began", restored, materialized, st.CRIUS, answered)
	t.Cleanup(func() { syscall.Kill(st.HostPid, syscall.SIGKILL) })
	if want := fmt.Sprintf("(%d, 41, %s)", s.pid, h); got != want {
		t.Fatalf("restored session answered %q, want %q", got, want)
	}
	if st.HostPid == 0 {
		t.Fatal("the restored process is not found in the sandbox")
	}
	if pp := ppid(st.HostPid); pp != s.initPid {
		t.Fatalf("restored process %d has parent %d, want the sandbox's init %d", st.HostPid, pp, s.initPid)
	}
	if cg, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", st.HostPid)); !bytes.Equal(cg, cgroups) {
		t.Fatalf("restored process's cgroups:\n%s\nbefore:\n%s", cg, cgroups)
	}
	if a := nsLink(st.HostPid, "net"); a != netns {
		t.Fatalf("restored process's network namespace %s, the session's was %s", a, netns)
	}
	if a := nsLink(st.HostPid, "cgroup"); a != cgns {
		t.Fatalf("restored process's cgroup namespace %s, the session's was %s (init's %s)", a, cgns, nsLink(s.initPid, "cgroup"))
	}
	// As the process sees it: relative to the sandbox's cgroup namespace.
	if got := p.call(t, "open('/proc/self/cgroup').read().splitlines()[-1]", 10*time.Second); got != "'0::/'" {
		t.Fatalf("the restored process sees its cgroup2 as %s, want '0::/'", got)
	}
}

// logLevelFromEnv is CRIU's log level for the tests: DELTABOX_CRIU_LOG (0-4), else
// CRIU's default.
func logLevelFromEnv() int32 {
	n, _ := strconv.Atoi(os.Getenv("DELTABOX_CRIU_LOG"))
	return int32(n)
}

// stoppedProg makes itself non-dumpable, fills 10 MB, stops itself (a group stop, as a
// template that its tracer let go), and once continued writes what it then is to
// /tmp/out: its PID, whether it is dumpable, the hash of its heap.
const stoppedProg = `
import ctypes, hashlib, os, signal, time
libc = ctypes.CDLL(None)
libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
x = bytearray(os.urandom(10 << 20))
open('/tmp/hash', 'w').write(hashlib.sha256(x).hexdigest())
os.kill(os.getpid(), signal.SIGSTOP)
open('/tmp/out.tmp', 'w').write('%d %d %s' % (os.getpid(), libc.prctl(3, 0, 0, 0, 0), hashlib.sha256(x).hexdigest()))
os.rename('/tmp/out.tmp', '/tmp/out')
time.sleep(600)  # alive until the test kills it: the test reads /tmp/out through its /proc/PID/root
`

// TestDumpStoppedNonDumpable: a non-dumpable process in a group stop (what a template
// is once its tracer lets it go) is dumped and stays stopped, with SIGSTOP still
// queued; restored from the image it is stopped again, with its PID, and once
// continued runs on, non-dumpable, with its heap.
func TestDumpStoppedNonDumpable(t *testing.T) {
	r := runner(t)
	s := newSandboxSession(t, "stp")
	res, err := s.d.C.Exec(t.Context(), s.id, apitypes.ExecRequest{Argv: []string{"sh", "-c",
		"setsid python3 -c \"$0\" </dev/null >/dev/null 2>&1 & echo $!", stoppedProg}})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("start: %v %+v", err, res)
	}
	inner, _ := strconv.Atoi(strings.TrimSpace(res.Stdout))
	var hp int
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if hp = childWithInnerPid(s.initPid, inner); hp != 0 && procfs.State(hp) == 'T' {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("sandbox pid %d (host %d) did not stop itself within 20 s", inner, hp)
		}
	}
	root := fmt.Sprintf("/proc/%d/root", hp)
	h, err := os.ReadFile(root + "/tmp/hash")
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(s.d.Root, "durable", "stopped")
	os.MkdirAll(dir, 0o700)
	// As a template would be: in the background, durable when Dump returns.
	m, err := Dump(t.Context(), r, hp, dir, DumpOptions{Background: true, Sync: true})
	if err != nil {
		t.Fatal(err)
	}
	if st := procfs.State(hp); st != 'T' {
		t.Fatalf("after the dump the process is in state %c, want T (stopped)", st)
	}
	if shd := statusField(hp, "ShdPnd"); shd&(1<<(syscall.SIGSTOP-1)) == 0 {
		t.Fatalf("after the dump SIGSTOP is not queued (ShdPnd %#x)", shd)
	}
	if len(m.TTYs) != 0 {
		t.Fatalf("terminals %v in the image of a process on /dev/null", m.TTYs)
	}

	sb := nsFiles(t, hp)
	kill(t, hp)
	st, err := Restore(t.Context(), r, dir, sb, RestoreOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Kill(st.HostPid, syscall.SIGKILL) })
	if got := procfs.State(st.HostPid); got != 'T' {
		t.Fatalf("restored process in state %c, want T (stopped)", got)
	}
	if pp := ppid(st.HostPid); pp != s.initPid {
		t.Fatalf("restored process's parent %d, want init %d", pp, s.initPid)
	}
	syscall.Kill(st.HostPid, syscall.SIGCONT)
	root = fmt.Sprintf("/proc/%d/root", st.HostPid)
	var out []byte
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if out, err = os.ReadFile(root + "/tmp/out"); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the continued process wrote nothing within 10 s (state %c)", procfs.State(st.HostPid))
		}
	}
	if want := fmt.Sprintf("%d 0 %s", inner, h); string(out) != want {
		t.Fatalf("the restored process says %q, want %q (pid, dumpable, heap hash)", out, want)
	}
}

// statusField is the hex mask on the line "key:" of /proc/PID/status (0 if none).
func statusField(pid int, key string) uint64 {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	for _, l := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(l, key+":"); ok {
			v, _ := strconv.ParseUint(strings.TrimSpace(rest), 16, 64)
			return v
		}
	}
	return 0
}

// pipeline is a tree of three: sh, and two pythons it started, one writing a counter
// into a pipe to the other, which keeps the last value in /tmp/last. It rewrites the
// file in place through one fd of fixed size: a write-then-rename caught by the dump
// between its open and its rename left CRIU a path that was gone at the restore
// ("Can't open file tmp/last.tmp", seen under load).
const pipeline = `python3 -u -c 'import itertools, time
for i in itertools.count():
    print(i); time.sleep(0.01)' | python3 -c 'import os, sys
fd = os.open("/tmp/last", os.O_WRONLY | os.O_CREAT, 0o644)
for l in sys.stdin:
    os.pwrite(fd, b"%012d\n" % int(l), 0)'`

// TestDumpRestoreTree: a process tree with a pipe inside (what the fast path refuses:
// children, a pipe between two processes) is dumped and restored with every PID and
// parent, and the pipe carries data again.
func TestDumpRestoreTree(t *testing.T) {
	r := runner(t)
	s := newSandboxSession(t, "tree")
	res, err := s.d.C.Exec(t.Context(), s.id, apitypes.ExecRequest{Argv: []string{"sh", "-c",
		"setsid sh -c \"$0\" </dev/null >/dev/null 2>&1 & echo $!", pipeline}})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("start: %v %+v", err, res)
	}
	inner, _ := strconv.Atoi(strings.TrimSpace(res.Stdout))
	var hp int
	var tr []int
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if hp = childWithInnerPid(s.initPid, inner); hp != 0 {
			if tr = Tree(hp); len(tr) == 3 {
				if fi, err := os.Stat(fmt.Sprintf("/proc/%d/root/tmp/last", hp)); err == nil && fi.Size() > 0 { // its size fixed: CRIU checks it at the restore
					break
				}
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("sandbox pid %d (host %d): tree %v, no /tmp/last within 20 s", inner, hp, tr)
		}
	}
	innerOf := func(hosts []int) (out []string) {
		for _, p := range hosts {
			in, _ := procfs.InnerPid(p)
			out = append(out, fmt.Sprintf("%d<-%d", in, innerPPid(p)))
		}
		slices.Sort(out)
		return out
	}
	before := innerOf(tr)
	if os.Getenv("DELTABOX_DEBUG") != "" {
		for _, p := range tr {
			b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", p))
			t.Logf("%d:\n%s", p, b)
		}
	}
	dir := filepath.Join(s.d.Root, "durable", "tree")
	os.MkdirAll(dir, 0o700)
	if _, err := Dump(t.Context(), r, hp, dir, DumpOptions{}); err != nil {
		t.Fatal(err)
	}
	sb := nsFiles(t, hp)
	for _, p := range tr {
		syscall.Kill(p, syscall.SIGKILL)
	}
	for _, p := range tr {
		kill(t, p)
	}
	st, err := Restore(t.Context(), r, dir, sb, RestoreOptions{})
	if err != nil {
		t.Fatal(err)
	}
	after := Tree(st.HostPid)
	t.Cleanup(func() {
		for _, p := range after {
			syscall.Kill(p, syscall.SIGKILL)
		}
	})
	if got := innerOf(after); !slices.Equal(got, before) {
		t.Fatalf("restored tree (pid<-parent, in the sandbox) %v, dumped %v", got, before)
	}
	if pp := ppid(st.HostPid); pp != s.initPid {
		t.Fatalf("restored root's parent %d, want init %d", pp, s.initPid)
	}
	last := func() int {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/root/tmp/last", st.HostPid))
		n, _ := strconv.Atoi(strings.TrimSpace(string(b)))
		return n
	}
	v0 := last()
	time.Sleep(300 * time.Millisecond)
	if v1 := last(); v1 <= v0 {
		t.Fatalf("the restored pipeline does not move: /tmp/last %d, then %d 300 ms later", v0, v1)
	}
}

// innerPPid is pid's parent's PID in the sandbox (0 for a parent outside it).
func innerPPid(pid int) int {
	in, _ := procfs.InnerPid(ppid(pid))
	return in
}

func nsLink(pid int, ns string) string {
	l, _ := os.Readlink(fmt.Sprintf("/proc/%d/ns/%s", pid, ns))
	return l
}

// TestRestoreRefusesTakenPid: a restore while the dumped process still lives fails,
// saying the PID is taken, and leaves that process as it was.
func TestRestoreRefusesTakenPid(t *testing.T) {
	r := runner(t)
	s := newSandboxSession(t, "taken")
	s.run(t, "v = 7")
	dir := filepath.Join(s.d.Root, "durable", "taken")
	os.MkdirAll(dir, 0o700)
	m, err := Dump(t.Context(), r, s.hostPid, dir, DumpOptions{})
	if err != nil {
		t.Fatal(err)
	}
	sb := nsFiles(t, s.hostPid)
	p := newPty(t, s.hostPid)
	sb.TTYs = map[string]*os.File{m.TTYs[0]: p.slave}
	st, err := Restore(t.Context(), r, dir, sb, RestoreOptions{})
	if err == nil {
		syscall.Kill(st.HostPid, syscall.SIGKILL)
		t.Fatalf("restore over a live pid %d succeeded (host pid %d)", s.pid, st.HostPid)
	}
	if !strings.Contains(err.Error(), "is taken") {
		t.Errorf("error does not say the PID is taken: %v", err)
	}
	if got := s.run(t, "v += 1; v"); got != "8" {
		t.Fatalf("the live session after the refused restore: %q", got)
	}
}
