package e2e

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"io/fs"
	"math/rand"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/client"
	"deltabox/internal/errdefs"
	"deltabox/internal/fastpath"
	"deltabox/internal/state"
	"deltabox/internal/testutil"
)

// What fork does not copy (interval and POSIX timers, pending signals) and what it would
// share (writable shared file mappings, open file descriptions), checked on a C program
// (testdata/fpkernel.c) that replaces a bash session's shell and speaks its protocol.

// fpkBuild compiles testdata/fpkernel.c statically (the sandbox's image has its own libc).
func fpkBuild(t *testing.T) []byte {
	t.Helper()
	testutil.RequireStore(t)
	gcc, err := exec.LookPath("gcc")
	testutil.Require(t, err == nil, "gcc not found (apt-get install gcc libc6-dev)")
	bin := filepath.Join(t.TempDir(), "fpkernel")
	out, err := testutil.Command(t, 2*time.Minute, gcc, "-static", "-O2", "-Wall", "-o", bin, "testdata/fpkernel.c").CombinedOutput()
	if err != nil && bytes.Contains(out, []byte("cannot find -lc")) {
		testutil.Require(t, false, "no static libc (libc6-dev): %s", out)
	}
	if err != nil {
		t.Fatalf("building testdata/fpkernel.c: %v: %s", err, out)
	}
	b, err := os.ReadFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// fpkStart puts the program into sandbox id and execs it in place of the main session's
// shell.
func fpkStart(t *testing.T, d *testutil.Daemon, id string, bin []byte) {
	t.Helper()
	ctx := dbxCtx(t)
	if _, err := d.C.WriteFile(ctx, id, "/workspace/fpkernel", bytes.NewReader(bin), client.WriteFileOptions{Mode: 0o755}); err != nil {
		t.Fatal(err)
	}
	if _, err := d.C.WriteFile(ctx, id, "/workspace/fpk-r.txt", strings.NewReader("0123456789abcdefghij"), client.WriteFileOptions{}); err != nil {
		t.Fatal(err)
	}
	sessRun(t, d, id, "main", "export __db_id; exec /workspace/fpkernel")
}

// fpkState is the program's answer to "state".
type fpkState struct {
	rd, wr             int64
	mapv               string
	realLeft, realIv   int64 // us
	virtLeft, virtIv   int64 // us
	ptID               int
	ptLeft, ptIv       int64 // ns
	timers             string
	alrm, vt, pt1, pid int
	pend               uint64
}

func fpkGet(t *testing.T, d *testutil.Daemon, id, cmd string) fpkState {
	t.Helper()
	l := sessRun(t, d, id, "main", cmd)
	var s fpkState
	_, err := fmt.Sscanf(strings.TrimSpace(l), "rd=%d wr=%d map=%s real=%d/%d virt=%d/%d pt=%d:%d/%d timers=%s alrm=%d vt=%d pt1=%d pend=%x pid=%d",
		&s.rd, &s.wr, &s.mapv, &s.realLeft, &s.realIv, &s.virtLeft, &s.virtIv, &s.ptID, &s.ptLeft, &s.ptIv, &s.timers, &s.alrm, &s.vt, &s.pt1, &s.pend, &s.pid)
	if err != nil {
		t.Fatalf("%s: bad answer %q: %v", cmd, l, err)
	}
	return s
}

// fpkPending is what the program keeps pending (blocked): SIGUSR1, SIGRTMIN+2 (two
// queued), SIGRTMIN+3 (POSIX timer 2's own signal). glibc's SIGRTMIN is 34.
const fpkPending = 1<<(10-1) | 1<<(36-1) | 1<<(37-1)

// fpkTimers checks s's timers against rec, taken before the checkpoint s was restored
// from: armed with their intervals, and no more time left than at rec unless they fired
// since (the restored process starts from the checkpoint's counts).
func fpkTimers(t *testing.T, what string, s, rec fpkState) {
	t.Helper()
	if s.realIv != 250000 || s.realLeft <= 0 || (s.alrm == rec.alrm && s.realLeft > rec.realLeft) {
		t.Errorf("%s: ITIMER_REAL %d/%d us (alarms %d), recorded %d us left (alarms %d)", what, s.realLeft, s.realIv, s.alrm, rec.realLeft, rec.alrm)
	}
	if s.virtIv != 100000 || s.virtLeft <= 0 || (s.vt == rec.vt && s.virtLeft > rec.virtLeft) {
		t.Errorf("%s: ITIMER_VIRTUAL %d/%d us (signals %d), recorded %d us left (signals %d)", what, s.virtLeft, s.virtIv, s.vt, rec.virtLeft, rec.vt)
	}
	if s.ptID != 1 || s.timers != "1,1" || s.ptIv != 300e6 || s.ptLeft <= 0 || (s.pt1 == rec.pt1 && s.ptLeft > rec.ptLeft) {
		t.Errorf("%s: POSIX timers id %d, present %s, %d/%d ns (signals %d), recorded %d ns left (signals %d)", what, s.ptID, s.timers, s.ptLeft, s.ptIv, s.pt1, rec.ptLeft, rec.pt1)
	}
}

// hashLayers hashes every file of the given layers' frozen directories (path, mode,
// content or link target).
func hashLayers(t *testing.T, root string, layers []uint64) map[uint64]string {
	t.Helper()
	out := map[uint64]string{}
	for _, l := range layers {
		dir := filepath.Join(root, "layers", strconv.FormatUint(l, 10), "frozen")
		h := sha256.New()
		err := filepath.WalkDir(dir, func(p string, e fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			info, err := e.Info()
			if err != nil {
				return err
			}
			fmt.Fprintf(h, "%s %v %d\n", p, info.Mode(), info.Size())
			switch {
			case info.Mode().IsRegular():
				b, err := os.ReadFile(p)
				if err != nil {
					return err
				}
				h.Write(b)
			case info.Mode()&fs.ModeSymlink != 0:
				target, _ := os.Readlink(p)
				h.Write([]byte(target))
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		out[l] = fmt.Sprintf("%x", h.Sum(nil))
	}
	return out
}

// TestFastPathKernelState: a process with open files at known offsets, a writable
// shared file mapping, ITIMER_REAL and ITIMER_VIRTUAL interval timers, two POSIX timers
// (ids 1 and 2, the second with its signal pending) and blocked pending signals (a
// kill()ed SIGUSR1, two sigqueue()d real-time signals) is checkpointed at three states
// and restored to them in random order. Each restore gives back the checkpoint's offsets
// and mapping contents, its timers re-armed with no more time left than they had and
// still firing, its pending signals still pending (each delivered with its siginfo when
// unblocked); writes through the mapping land in the restored state's file, and no
// frozen layer changes.
func TestFastPathKernelState(t *testing.T) {
	bin := fpkBuild(t)
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "fk")
	fpkStart(t, d, "fk", bin)
	st := fpkGet(t, d, "fk", "state")
	if st.pend != fpkPending || st.timers != "1,1" || st.mapv != "map-start" {
		t.Fatalf("program did not set up: %+v", st)
	}
	type node struct {
		id    string
		layer uint64
		st    fpkState
	}
	var nodes []node
	for i := 0; i < 3; i++ {
		s := fpkGet(t, d, "fk", fmt.Sprintf("change c%d", i))
		op := dbxCheckpoint(t, d, "fk", fmt.Sprintf("k%d", i))
		if op.Processes != 1 {
			t.Fatalf("checkpoint %d took %d processes: %v", i, op.Processes, op.ProcessErrors)
		}
		// The live process goes on with all it had.
		after := fpkGet(t, d, "fk", "state")
		if after.rd != s.rd || after.wr != s.wr || after.mapv != s.mapv || after.pend != fpkPending || after.pid != st.pid {
			t.Fatalf("live process after checkpoint %d: %+v, before %+v", i, after, s)
		}
		fpkTimers(t, fmt.Sprintf("live process after checkpoint %d", i), after, s)
		nodes = append(nodes, node{op.Node.ID, op.Node.Layer, s})
	}
	var layers []uint64
	for _, n := range nodes {
		layers = append(layers, n.layer)
	}
	frozen := hashLayers(t, d.Root, layers)

	rng := rand.New(rand.NewSource(4))
	for k := 0; k < 6; k++ {
		i := rng.Intn(len(nodes))
		n := nodes[i]
		sessRun(t, d, "fk", "main", "change dirty")
		res := dbxRestore(t, d, "fk", n.id)
		if res.Processes != 1 {
			t.Fatalf("restore %d to node %d: %d processes: %v", k, i, res.Processes, res.ProcessErrors)
		}
		what := fmt.Sprintf("restore %d to node %d", k, i)
		s := fpkGet(t, d, "fk", "state")
		if s.rd != n.st.rd || s.wr != n.st.wr || s.mapv != fmt.Sprintf("c%d", i) || s.pid != st.pid {
			t.Fatalf("%s: offsets %d %d, mapping %q, pid %d; recorded %d %d %q %d", what, s.rd, s.wr, s.mapv, s.pid, n.st.rd, n.st.wr, n.st.mapv, st.pid)
		}
		if s.pend != fpkPending {
			t.Errorf("%s: pending signals %#x, want %#x", what, s.pend, uint64(fpkPending))
		}
		fpkTimers(t, what, s, n.st)
		if got := sessRun(t, d, "fk", "main", "unblock"); got != "usr1=1 rt2=21,22 pt3=1 pt3tid=2 pt3val=53\n" {
			t.Errorf("%s: signals delivered when unblocked: %q", what, got)
		}
		for _, c := range []string{"waitreal", "waitpt", "spin"} {
			if got := sessRun(t, d, "fk", "main", c); got != "fired\n" {
				t.Errorf("%s: %s: %q", what, c, got)
			}
		}
		mark := fmt.Sprintf("r%d", k)
		sessRun(t, d, "fk", "main", "mapwrite "+mark)
		b, err := d.C.ReadFile(dbxCtx(t), "fk", "/workspace/fpk-map.bin")
		if err != nil || !bytes.HasPrefix(b, []byte(mark+"\x00")) {
			t.Fatalf("%s: a write through the mapping is not in the state's file: %q, %v", what, b[:min(len(b), 16)], err)
		}
	}
	if after := hashLayers(t, d.Root, layers); fmt.Sprint(after) != fmt.Sprint(frozen) {
		t.Fatalf("frozen layers changed: %v, then %v", frozen, after)
	}
	for i, n := range nodes {
		b, err := os.ReadFile(filepath.Join(d.Root, "layers", strconv.FormatUint(n.layer, 10), "frozen", "workspace", "fpk-map.bin"))
		if err != nil || !bytes.HasPrefix(b, []byte(fmt.Sprintf("c%d\x00", i))) {
			t.Errorf("node %d's frozen copy of the mapped file: %q, %v", i, b[:min(len(b), 16)], err)
		}
	}
}

// kcmpFile reports whether fd1 of pid1 and fd2 of pid2 are the same open file
// description (kcmp KCMP_FILE).
func kcmpFile(t *testing.T, pid1, pid2, fd1, fd2 int) bool {
	t.Helper()
	r, _, e := unix.Syscall6(unix.SYS_KCMP, uintptr(pid1), uintptr(pid2), 0 /* KCMP_FILE */, uintptr(fd1), uintptr(fd2), 0)
	if e != 0 {
		t.Fatalf("kcmp(%d, %d, KCMP_FILE, %d, %d): %v", pid1, pid2, fd1, fd2, e)
	}
	return r == 0
}

// fpkFDs finds the fds of host process pid open on the program's files.
func fpkFDs(t *testing.T, pid int) (rd, wr int) {
	t.Helper()
	ents, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	rd, wr = -1, -1
	for _, e := range ents {
		target, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, e.Name()))
		n, _ := strconv.Atoi(e.Name())
		switch {
		case strings.HasSuffix(target, "/fpk-r.txt"):
			rd = n
		case strings.HasSuffix(target, "/fpk-w.txt"):
			wr = n
		}
	}
	if rd < 0 || wr < 0 {
		t.Fatalf("process %d: fds of fpk-r.txt %d and fpk-w.txt %d", pid, rd, wr)
	}
	return rd, wr
}

// fpkMapping returns the address of pid's mapping of fpk-map.bin and its map_files
// (device, inode): the file it maps.
func fpkMapping(t *testing.T, pid int) (addr uint64, dev uint64, ino uint64) {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if !strings.HasSuffix(l, "/fpk-map.bin") {
			continue
		}
		rng := strings.Fields(l)[0]
		lo, _, _ := strings.Cut(rng, "-")
		addr, _ = strconv.ParseUint(lo, 16, 64)
		var st unix.Stat_t
		if err := unix.Stat(fmt.Sprintf("/proc/%d/map_files/%s", pid, rng), &st); err != nil {
			t.Fatal(err)
		}
		return addr, st.Dev, st.Ino
	}
	t.Fatalf("process %d has no mapping of fpk-map.bin:\n%s", pid, b)
	return
}

// fpkPeek reads the first bytes of pid's memory at addr.
func fpkPeek(t *testing.T, pid int, addr uint64) string {
	t.Helper()
	f, err := os.Open(fmt.Sprintf("/proc/%d/mem", pid))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, 16)
	if _, err := f.ReadAt(b, int64(addr)); err != nil {
		t.Fatal(err)
	}
	return string(bytes.TrimRight(b, "\x00"))
}

// TestFastPathKcmpNoSharedFiles: after a checkpoint the live process shares no open file
// description (kcmp KCMP_FILE) of its files with its template, only the terminal (by
// design); its shared mapping maps another file than the template's, and writes through
// it do not reach the template's memory. The same holds for the process a restore makes.
func TestFastPathKcmpNoSharedFiles(t *testing.T) {
	bin := fpkBuild(t)
	d := testutil.StartDaemon(t)
	info := dbxCreate(t, d, "kc")
	fpkStart(t, d, "kc", bin)
	sessRun(t, d, "kc", "main", "change one")
	op := dbxCheckpoint(t, d, "kc", "one")
	live := func() int {
		pids := dbxReadPids(filepath.Join(dbxCgroupDir(t, info.InitPid), "cgroup.procs"))
		st := fpkGet(t, d, "kc", "state")
		h, err := fastpath.HostPid(pids, st.pid)
		if err != nil {
			t.Fatal(err)
		}
		return h
	}
	stopped := fpStoppedPids(t, d, "kc")
	if len(stopped) != 1 {
		t.Fatalf("%d stopped processes after one checkpoint of one session, want 1 template", len(stopped))
	}
	var tmpl int
	for p := range stopped {
		tmpl = p
	}
	tAddr, tDev, tIno := fpkMapping(t, tmpl)
	if got := fpkPeek(t, tmpl, tAddr); got != "one" {
		t.Fatalf("template's mapping holds %q, want the checkpoint's %q", got, "one")
	}
	check := func(what string, pid int, pty bool) {
		t.Helper()
		rd, wr := fpkFDs(t, pid)
		trd, twr := fpkFDs(t, tmpl)
		if kcmpFile(t, pid, tmpl, rd, trd) || kcmpFile(t, pid, tmpl, wr, twr) {
			t.Errorf("%s shares an open file description with its template", what)
		}
		if pty != kcmpFile(t, pid, tmpl, 0, 0) {
			t.Errorf("%s: terminal shared with the template: %v, want %v", what, !pty, pty)
		}
		addr, dev, ino := fpkMapping(t, pid)
		if addr != tAddr || (dev == tDev && ino == tIno) {
			t.Errorf("%s maps fpk-map.bin at %#x (dev %d ino %d), the template at %#x (dev %d ino %d): want the same address, another file", what, addr, dev, ino, tAddr, tDev, tIno)
		}
		mark := "w-" + strconv.Itoa(pid%1000)
		sessRun(t, d, "kc", "main", "mapwrite "+mark)
		if got := fpkPeek(t, pid, addr); got != mark {
			t.Fatalf("%s's mapping after a write: %q", what, got)
		}
		if got := fpkPeek(t, tmpl, tAddr); got != "one" {
			t.Errorf("a write through %s's mapping reached the template: %q", what, got)
		}
	}
	check("the live process", live(), true)
	if res := dbxRestore(t, d, "kc", op.Node.ID); res.Processes != 1 {
		t.Fatalf("restore: %d processes: %v", res.Processes, res.ProcessErrors)
	}
	if got := fpkGet(t, d, "kc", "state").mapv; got != "one" {
		t.Fatalf("restored mapping holds %q", got)
	}
	check("the restored process", live(), false)
}

// TestFastPathPythonMmap: a python session's mmap of a file (MAP_SHARED, writable) no
// longer refuses a checkpoint: after a restore it shows the checkpoint's bytes and writes
// through it reach the restored state's file. An anonymous mmap (shared anonymous memory,
// which fork would share with the template) still refuses it, naming it, and nothing
// changes.
func TestFastPathPythonMmap(t *testing.T) {
	// Durable images off: with them, CRIU carries shared anonymous memory instead
	// (TestCRIUCarriesWhatTheFastPathRefuses); the refusal is the fast path's own.
	d := testutil.StartDaemonEnv(t, testutil.NewStore(t), "DELTABOX_DURABLE=0")
	dbxCreate(t, d, "pm")
	if _, err := d.C.StartSession(dbxCtx(t), "pm", state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	sessRun(t, d, "pm", "py", "import mmap\nopen('/workspace/m.bin', 'wb').write(b'abc' + bytes(4093))\nf = open('/workspace/m.bin', 'r+b')\nm = mmap.mmap(f.fileno(), 0)\nanon = mmap.mmap(-1, 4096)")
	_, err := d.C.Checkpoint(dbxCtx(t), "pm", "refused")
	if !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "shared anonymous memory") || !strings.Contains(err.Error(), "session py") {
		t.Fatalf("checkpoint with a shared anonymous mapping: %v", err)
	}
	sessRun(t, d, "pm", "py", "anon.close()")
	op := dbxCheckpoint(t, d, "pm", "abc")
	if op.Processes != 1 {
		t.Fatalf("checkpoint took %d processes: %v", op.Processes, op.ProcessErrors)
	}
	sessRun(t, d, "pm", "py", "m[:3] = b'xyz'")
	if b, _ := d.C.ReadFile(dbxCtx(t), "pm", "/workspace/m.bin"); !bytes.HasPrefix(b, []byte("xyz")) {
		t.Fatalf("write through the live mapping after the checkpoint: file starts %q", b[:3])
	}
	dbxRestore(t, d, "pm", op.Node.ID)
	if out := sessRun(t, d, "pm", "py", "bytes(m[:3])"); out != "b'abc'\n" {
		t.Fatalf("restored mapping: %q", out)
	}
	sessRun(t, d, "pm", "py", "m[:3] = b'def'; m.flush()")
	if b, _ := d.C.ReadFile(dbxCtx(t), "pm", "/workspace/m.bin"); !bytes.HasPrefix(b, []byte("def")) {
		t.Fatalf("write through the restored mapping: file starts %q", b[:3])
	}
}
