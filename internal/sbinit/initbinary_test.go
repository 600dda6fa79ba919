package sbinit

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"deltabox/internal/testutil/skip"
)

// TestInitMemfd: the small init the daemon's binary carries goes into a memfd that
// runs (exec through /proc/self/fd) and that no one may change: sealed against write,
// grow and shrink with the seals sealed, mode 0555, close-on-exec, at 100 or above. A
// dynamically linked executable or a file that is no ELF is refused with the reason,
// so is an executable memfd where vm.memfd_noexec=2 (in a PID namespace of its own),
// and without a small init the daemon's own binary is the init, saying why.
func TestInitMemfd(t *testing.T) {
	_, err := exec.LookPath("go")
	skip.Require(t, err == nil, "no go toolchain to build %s: %v", InitBinaryName, err)
	p := filepath.Join(t.TempDir(), InitBinaryName)
	cmd := exec.Command("go", "build", "-o", p, "./cmd/"+InitBinaryName)
	cmd.Dir = filepath.Join("..", "..")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	exe, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	fd, err := initMemfd(exe)
	if err != nil {
		t.Fatalf("initMemfd: %v", err)
	}
	defer unix.Close(fd)
	if fd < 100 {
		t.Errorf("the memfd is fd %d, want 100 or above", fd)
	}
	if fl, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0); err != nil || fl&unix.FD_CLOEXEC == 0 {
		t.Errorf("the memfd's fd flags %#x (%v), want FD_CLOEXEC", fl, err)
	}
	want := unix.F_SEAL_SEAL | unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_WRITE
	if s, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0); err != nil || s&want != want {
		t.Errorf("the memfd's seals %#x (%v), want %#x", s, err, want)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Mode&0o7777 != 0o555 || st.Size != int64(len(exe)) {
		t.Errorf("the memfd: mode %#o size %d (%v), want 0555 and %d bytes", st.Mode&0o7777, st.Size, err, len(exe))
	}
	// Writable by no one, root included: not through this fd, nor one opened anew.
	if _, err := unix.Pwrite(fd, []byte("x"), 0); err == nil {
		t.Error("a write to the memfd succeeded")
	}
	if w, err := os.OpenFile("/proc/self/fd/"+strconv.Itoa(fd), os.O_WRONLY, 0); err == nil {
		if _, err := w.WriteAt([]byte("x"), 0); err == nil {
			t.Error("a write to the memfd reopened for writing succeeded")
		}
		w.Close()
	}
	if err := unix.Ftruncate(fd, 0); err == nil {
		t.Error("the memfd was truncated")
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, 0); err == nil {
		t.Error("seals could still be changed")
	}
	got := make([]byte, len(exe))
	if n, err := unix.Pread(fd, got, 0); err != nil || n != len(exe) || !bytes.Equal(got, exe) {
		t.Errorf("the memfd holds %d bytes (%v), not the init", n, err)
	}
	// It runs: the init without its argument says what it is.
	out, _ := exec.Command("/proc/self/fd/" + strconv.Itoa(fd)).CombinedOutput()
	if !strings.Contains(string(out), "the sandbox init") {
		t.Errorf("exec of the memfd: %q, want the small init's usage", out)
	}

	refused := func(what, errPart string, b []byte) {
		t.Helper()
		fd, err := initMemfd(b)
		if err == nil {
			unix.Close(fd)
		}
		if err == nil || !strings.Contains(err.Error(), errPart) {
			t.Errorf("%s: %v, want an error saying %q", what, err, errPart)
		}
	}
	refused("not ELF", "not an ELF", []byte("#!/bin/sh\n"))
	for _, c := range []string{"/bin/true", "/usr/bin/true"} {
		if b, err := os.ReadFile(c); err == nil && bytes.Contains(b, []byte("ld-linux")) {
			refused("dynamically linked", "dynamically linked", b)
			break
		}
	}

	// A PID namespace whose vm.memfd_noexec is 2 refuses an executable memfd: the
	// reason names the setting (the child is this test, re-executed there).
	if os.Geteuid() != 0 {
		t.Log("not root: vm.memfd_noexec=2 not checked (it takes a PID namespace)")
	} else {
		c := exec.Command(os.Args[0], "-test.run=^TestInitMemfdNoexec$", "-test.v")
		c.Env = append(os.Environ(), "DELTABOX_TEST_INIT="+p)
		c.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID}
		out, err := c.CombinedOutput()
		if err != nil || !strings.Contains(string(out), "--- PASS: TestInitMemfdNoexec") {
			t.Errorf("with vm.memfd_noexec=2: %v\n%s", err, out)
		}
	}

	// Without a small init (a plain go build): the daemon's own binary, and why.
	defer func(b []byte, w string) {
		embeddedInit, embeddedWhy, initBinOnce, initExePath, initMemfdFD = b, w, sync.Once{}, "/proc/self/exe", -1
	}(embeddedInit, embeddedWhy)
	UseInit(nil, "no small init here")
	initBinOnce = sync.Once{}
	if path, why := InitBinary(); path != "/proc/self/exe" || initExe() != "/proc/self/exe" || !strings.Contains(why, "no small init here") {
		t.Errorf("without a small init: %s, %q (exec %s), want /proc/self/exe and the reason", path, why, initExe())
	}
	UseInit(exe, "")
	initBinOnce = sync.Once{}
	if path, why := InitBinary(); path != "memfd:"+InitBinaryName || !strings.HasPrefix(initExe(), "/proc/self/fd/") {
		t.Errorf("with the small init: %s, %q (exec %s), want its memfd", path, why, initExe())
	}
	if initMemfdFD >= 0 {
		unix.Close(initMemfdFD)
	}
}

// TestInitMemfdNoexec is TestInitMemfd's child in a PID namespace of its own: with
// vm.memfd_noexec=2 there, initMemfd refuses, naming the setting.
func TestInitMemfdNoexec(t *testing.T) {
	p := os.Getenv("DELTABOX_TEST_INIT")
	if p == "" {
		t.Skip("run by TestInitMemfd, in a PID namespace of its own")
	}
	if err := os.WriteFile("/proc/sys/vm/memfd_noexec", []byte("2"), 0); err != nil {
		t.Fatal(err)
	}
	exe, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	fd, err := initMemfd(exe)
	if err == nil {
		unix.Close(fd)
	}
	if err == nil || !strings.Contains(err.Error(), "vm.memfd_noexec=2") {
		t.Fatalf("initMemfd with vm.memfd_noexec=2: %v, want an error naming it", err)
	}
}
