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

	"golang.org/x/sys/unix"

	"deltabox/internal/remote"
	"deltabox/internal/testutil/skip"
)

// TestMoveBackMapsBack: a move that is undone puts a writable shared mapping back on the
// very file it mapped. Between Fork and Move the mapped path is made to name another
// file (as the new state's copy would be): Move maps that one, MoveBack the original
// again (through the template's map_files), and the process's writes reach the original.
func TestMoveBackMapsBack(t *testing.T) {
	skip.Require(t, os.Geteuid() == 0, "needs root (ptrace, setns, map_files)")
	gcc, err := exec.LookPath("gcc")
	skip.Require(t, err == nil, "gcc not found")
	dir := t.TempDir()
	bin := filepath.Join(dir, "mapper")
	if out, err := exec.Command(gcc, "-O1", "-Wall", "-o", bin, "testdata/mapper.c").CombinedOutput(); err != nil {
		t.Fatalf("building testdata/mapper.c: %v: %s", err, out)
	}
	file := filepath.Join(dir, "data")
	if err := os.WriteFile(file, append([]byte("orig"), make([]byte, 4092)...), 0o644); err != nil {
		t.Fatal(err)
	}

	// The subject talks on a terminal: the fast path takes no pipes.
	master, err := os.OpenFile("/dev/ptmx", os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer master.Close()
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
	pid := cmd.Process.Pid
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	lines := make(chan string, 10)
	go func() {
		sc := bufio.NewScanner(master)
		for sc.Scan() {
			lines <- strings.TrimRight(sc.Text(), "\r")
		}
		close(lines)
	}()
	next := func() string {
		t.Helper()
		select {
		case l := <-lines:
			return l
		case <-time.After(5 * time.Second):
			t.Fatal("no answer from the subject")
		}
		return ""
	}
	ask := func(c string) string {
		t.Helper()
		fmt.Fprintln(master, c)
		return next()
	}
	if l := next(); l != "ready" {
		t.Fatalf("subject says %q", l)
	}
	for i := 0; i < 500; i++ { // blocked in read
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if i := bytes.LastIndexByte(b, ')'); i > 0 && b[i+2] == 'S' {
			break
		}
		time.Sleep(2 * time.Millisecond)
	}

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
	if err := h.Move("/proc/self/ns/mnt"); err != nil {
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
	if l := ask("read"); l != "map=orig" {
		t.Fatalf("mapping after MoveBack: %q", l)
	}
	ask("write back")
	if b, _ := os.ReadFile(file + ".orig"); !bytes.HasPrefix(b, []byte("back\x00")) {
		t.Errorf("a write through the mapping did not reach the original file: %q", b[:8])
	}
	if b, _ := os.ReadFile(file); !bytes.HasPrefix(b, []byte("new\x00")) {
		t.Errorf("the other file changed: %q", b[:8])
	}
}
