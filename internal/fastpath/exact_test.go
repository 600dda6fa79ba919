package fastpath

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/errdefs"
	"deltabox/internal/procfs"
	"deltabox/internal/remote"
	"deltabox/internal/testutil/skip"
)

func TestParseMountinfo(t *testing.T) {
	in := `988 459 0:242 / / rw,relatime - overlay none rw,lowerdir+=/a,upperdir=/b
989 988 0:240 / /dev rw,nosuid,relatime - tmpfs tmpfs rw,size=64k,mode=755
1098 989 0:241 / /dev/pts rw,nosuid shared:4 master:2 - devpts devpts rw,gid=5
1100 989 0:242 /dev/shm /dev/shm rw,relatime - overlay none rw
4326 988 0:567 / /mnt/a\040b\134c rw,relatime - proc proc rw
`
	got := parseMountinfo([]byte(in))
	if len(got) != 5 {
		t.Fatalf("%d lines: %+v", len(got), got)
	}
	if l := got[2]; l.id != 1098 || l.parent != 989 || l.dev != "0:241" || l.root != "/" || l.point != "/dev/pts" || l.fstype != "devpts" || l.source != "devpts" {
		t.Errorf("a line with optional fields: %+v", l)
	}
	if l := got[4]; l.point != `/mnt/a b\c` || l.fstype != "proc" {
		t.Errorf("an escaped mount point: %+v", l)
	}
}

// TestJudgeMount: the state's own mounts are taken (the overlay, its /dev/shm, clones of
// the base's /dev, /dev/pts and /proc); mounts made inside the sandbox are named.
func TestJudgeMount(t *testing.T) {
	base := parseMountinfo([]byte(`4907 2275 0:474 / / ro - tmpfs deltabox ro
4908 4907 0:519 / /proc rw - proc proc rw
4909 4907 0:520 / /dev rw - tmpfs tmpfs rw
4929 4909 0:521 / /dev/pts rw - devpts devpts rw
`))
	root := mountLine{id: 1, dev: "0:558", root: "/", point: "/", fstype: "overlay"}
	for _, c := range []struct {
		l    mountLine
		want string // "" or part of the refusal
	}{
		{mountLine{dev: "0:558", root: "/dev/shm", point: "/dev/shm", fstype: "overlay"}, ""},
		{mountLine{dev: "0:520", root: "/", point: "/dev", fstype: "tmpfs"}, ""},
		{mountLine{dev: "0:521", root: "/", point: "/dev/pts", fstype: "devpts"}, ""},
		{mountLine{dev: "0:519", root: "/", point: "/proc", fstype: "proc"}, ""},
		{mountLine{dev: "0:558", root: "/workspace", point: "/workspace", fstype: "overlay"}, ""},
		{mountLine{dev: "0:566", root: "/", point: "/mnt/t", fstype: "tmpfs"}, "a tmpfs mounted inside the sandbox on /mnt/t"},
		{mountLine{dev: "0:567", root: "/", point: "/proc", fstype: "proc"}, "a proc mounted inside the sandbox on /proc"},
		{mountLine{dev: "0:600", root: "/", point: "/dev", fstype: "tmpfs"}, "a tmpfs mounted inside the sandbox on /dev"},
		{mountLine{dev: "0:519", root: "/", point: "/mnt/p", fstype: "proc"}, "on /mnt/p"},
		{mountLine{dev: "0:558", root: "/workspace/a", point: "/mnt/b", fstype: "overlay"}, "a bind mount of /workspace/a on /mnt/b"},
		{mountLine{dev: "0:558", root: "/dev/x", point: "/dev/x", fstype: "overlay"}, "under /dev"},
	} {
		got := judgeMount(c.l, root, base)
		if (c.want == "") != (got == "") || !strings.Contains(got, c.want) {
			t.Errorf("%+v: %q, want %q", c.l, got, c.want)
		}
	}
}

func TestParseSmaps(t *testing.T) {
	in := `7f0d50ef6000-7f0d50ef7000 rw-p 00000000 00:00 0
Size:                  4 kB
Anonymous:             4 kB
VmFlags: rd wr mr mw me ac sd wf
7f0d50ef8000-7f0d50ef9000 rw-s 00002000 00:90 67380045                   /workspace/a b
Anonymous:             0 kB
VmFlags: rd wr sh mr mw me ms sd dc
`
	got := parseSmaps([]byte(in))
	if len(got) != 2 || !got[0].flags["wf"] || got[0].flags["dc"] || got[0].anonKB != 4 || !got[1].flags["dc"] || got[1].path != "/workspace/a b" || got[1].start != 0x7f0d50ef8000 {
		t.Fatalf("parsed %+v", got)
	}
	if mw := parseSmapsMayWrite([]byte(in)); !mw[0x7f0d50ef6000] || !mw[0x7f0d50ef8000] {
		t.Errorf("mw %v", mw)
	}
}

// TestIsDeleted: a file is deleted by its link count, not by the " (deleted)" the kernel
// appends to an unlinked name: a live file named "x (deleted)" is not, a file unlinked
// while open is, and so is a name unlinked from a file that keeps another link.
func TestIsDeleted(t *testing.T) {
	dir := t.TempDir()
	open := func(name string) (*os.File, string) {
		t.Helper()
		f, err := os.OpenFile(filepath.Join(dir, name), os.O_RDWR|os.O_CREATE, 0o644)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		return f, fmt.Sprintf("/proc/self/fd/%d", f.Fd())
	}
	check := func(what, fd string, want bool) {
		t.Helper()
		sx, err := statxAt(fd)
		if err != nil {
			t.Fatal(err)
		}
		link, _ := os.Readlink(fd)
		got, err := isDeleted(&sx, link, lookupSelf)
		if err != nil || got != want {
			t.Errorf("%s (%s, %d links): deleted %v %v, want %v", what, link, sx.Nlink, got, err, want)
		}
	}
	_, live := open("x (deleted)")
	check("a live file named x (deleted)", live, false)
	_, gone := open("gone")
	os.Remove(filepath.Join(dir, "gone"))
	check("an unlinked file", gone, true)
	_, linked := open("a")
	if err := os.Link(filepath.Join(dir, "a"), filepath.Join(dir, "b")); err != nil {
		t.Fatal(err)
	}
	os.Remove(filepath.Join(dir, "a"))
	check("an unlinked name of a file with another link", linked, true)
	// The same, with a file of that very name ("a (deleted)") beside it: another file.
	os.WriteFile(filepath.Join(dir, "a (deleted)"), nil, 0o644)
	check("an unlinked name beside a file named as its link reads", linked, true)
}

// TestIneligibleIsConflict: however wrapped, a refusal is a 409.
func TestIneligibleIsConflict(t *testing.T) {
	err := fmt.Errorf("session py: %w", &Ineligible{Pid: 7, Reason: "why"})
	if !errors.Is(err, errdefs.ErrConflict) {
		t.Fatal("an Ineligible is not a conflict")
	}
}

// TestForkCopyFindsDontforkAndWipeonfork: Fork refuses, with an *Ineligible naming the
// mapping, a process whose template would lack memory (MADV_DONTFORK, even untouched) or
// get it zero-filled (MADV_WIPEONFORK, one page written: the counts are exact); it takes
// a process with an untouched MADV_WIPEONFORK mapping (zeros either way) or none. The
// refused process is let go as it was, and no template is left.
func TestForkCopyFindsDontforkAndWipeonfork(t *testing.T) {
	skip.Require(t, os.Geteuid() == 0, "needs root (ptrace)")
	gcc, err := exec.LookPath("gcc")
	skip.Require(t, err == nil, "gcc not found")
	bin := filepath.Join(t.TempDir(), "forkcopy")
	if out, err := exec.Command(gcc, "-O1", "-Wall", "-o", bin, "testdata/forkcopy.c").CombinedOutput(); err != nil {
		t.Fatalf("building testdata/forkcopy.c: %v: %s", err, out)
	}
	tr := remote.NewTracer()
	defer tr.Close()
	for _, c := range []struct {
		advice, pages int
		refuse        string
	}{
		{0, 1, ""},
		{unix.MADV_DONTFORK, 0, "MADV_DONTFORK"},
		{unix.MADV_DONTFORK, 3, "MADV_DONTFORK"},
		{unix.MADV_WIPEONFORK, 1, "MADV_WIPEONFORK"},
		{unix.MADV_WIPEONFORK, 0, ""},
	} {
		cmd := exec.Command(bin, fmt.Sprint(c.advice), fmt.Sprint(c.pages))
		cmd.Dir = "/"
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		pid := cmd.Process.Pid
		for i := 0; i < 500 && procfs.State(pid) != 'S'; i++ {
			time.Sleep(2 * time.Millisecond)
		}
		h, err := Hold(tr, pid)
		if err != nil {
			t.Fatalf("%+v: hold: %v", c, err)
		}
		_, err = h.Fork()
		var in *Ineligible
		switch {
		case c.refuse == "" && err != nil:
			t.Errorf("%+v: %v", c, err)
		case c.refuse != "" && (!errors.As(err, &in) || !strings.Contains(err.Error(), c.refuse)):
			t.Errorf("%+v: %v, want a refusal naming %s", c, err, c.refuse)
		case c.refuse != "" && h.Tmpl != nil:
			t.Errorf("%+v: refused, with a template", c)
		}
		if err := h.Abort(); err != nil {
			t.Errorf("%+v: abort: %v", c, err)
		}
		if s := procfs.State(pid); s != 'S' && s != 'R' {
			t.Errorf("%+v: the process is %c after the refusal", c, s)
		}
		cmd.Process.Kill()
		cmd.Wait()
	}
}

// TestMoveReopensDevicesAndMoveBackGivesThemBack: a move reopens a process's /dev/null
// fds (new open file descriptions, not shared with the template, fds that shared one
// still sharing one), and a move that is undone gives it back the very descriptions it
// had.
func TestMoveReopensDevicesAndMoveBackGivesThemBack(t *testing.T) {
	skip.Require(t, os.Geteuid() == 0, "needs root (ptrace, setns, pidfd_getfd)")
	gcc, err := exec.LookPath("gcc")
	skip.Require(t, err == nil, "gcc not found")
	bin := filepath.Join(t.TempDir(), "forkcopy")
	if out, err := exec.Command(gcc, "-O1", "-Wall", "-o", bin, "testdata/forkcopy.c").CombinedOutput(); err != nil {
		t.Fatalf("building testdata/forkcopy.c: %v: %s", err, out)
	}
	cmd := exec.Command(bin, "0", "0")
	cmd.Dir = "/"
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	pid := cmd.Process.Pid
	for i := 0; i < 500 && procfs.State(pid) != 'S'; i++ {
		time.Sleep(2 * time.Millisecond)
	}
	// Copies of its descriptions (pidfd_getfd), to compare with (kcmp).
	pfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(pfd)
	var orig [3]int
	for i := range orig {
		if orig[i], err = unix.PidfdGetfd(pfd, i, 0); err != nil {
			t.Fatal(err)
		}
		defer unix.Close(orig[i])
	}
	self := os.Getpid()
	same := func(fd int, o int) bool {
		t.Helper()
		s, err := sameFile(pid, fd, self, o)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	shared12, _ := sameFile(pid, 1, pid, 2)

	tr := remote.NewTracer()
	defer tr.Close()
	h, err := Hold(tr, pid)
	if err != nil {
		t.Fatal(err)
	}
	if k := h.P.FDs[0]; k.Kind != "dev" || k.Path != "/dev/null" {
		t.Fatalf("fd 0: %+v", k)
	}
	if _, err := h.Fork(); err != nil {
		h.Abort()
		t.Fatal(err)
	}
	if err := h.Move(ownMountNS(t)); err != nil {
		h.Abort()
		t.Fatal(err)
	}
	for i := range orig {
		if same(i, orig[i]) {
			t.Errorf("after Move fd %d is still its old description", i)
		}
		if l, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/%d", pid, i)); l != "/dev/null" {
			t.Errorf("after Move fd %d reads %q", i, l)
		}
	}
	if s, _ := sameFile(pid, 1, pid, 2); s != shared12 {
		t.Errorf("after Move fds 1 and 2 share a description: %v, before: %v", s, shared12)
	}
	if err := h.Abort(); err != nil { // MoveBack, kill the template, Release
		t.Fatal(err)
	}
	for i := range orig {
		if !same(i, orig[i]) {
			t.Errorf("after MoveBack fd %d is not its old description", i)
		}
	}
}

// TestMountsWhere judges real mounts of this process (the host's namespace, whose "base"
// is pid 1's): its root's mount and /proc are taken. Without the base's table, only the
// root's filesystem can be judged, and anything else is refused saying why.
func TestMountsWhere(t *testing.T) {
	skip.Require(t, os.Geteuid() == 0, "needs root (pid 1's mountinfo)")
	root, err := statxAt("/proc/self/root")
	if err != nil {
		t.Fatal(err)
	}
	proc, err := statxAt("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	m := &mounts{hostPid: os.Getpid(), rootMnt: root.Mnt_id}
	for _, mnt := range []uint64{root.Mnt_id, proc.Mnt_id} {
		if w, err := m.where(mnt); w != "" || err != nil {
			t.Errorf("mount %d: %q %v", mnt, w, err)
		}
	}
	m.baseErr = errors.New("no init")
	if w, err := m.where(proc.Mnt_id); !strings.Contains(w, "cannot be checked") || err != nil {
		t.Errorf("/proc without the base's table: %q %v", w, err)
	}
}
