package overlay

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/testutil"
)

// userNS starts a process in a new user namespace mapping 0..65535 to base and returns
// an fd on that namespace.
func userNS(t testing.TB, base int) int {
	cmd := exec.Command("sleep", "100")
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: unix.CLONE_NEWUSER,
		UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: base, Size: 65536}},
		GidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: base, Size: 65536}}}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	fd, err := unix.Open("/proc/"+strconv.Itoa(cmd.Process.Pid)+"/ns/user", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return fd
}

// TestIDMappedOverlay: through the idmapped view, a lower file owned by 0 on disk is
// owned by base in the overlay, the overlay is writable (created as the sandbox's
// root: AsRoot), and what is written lands on disk owned by 0 again, a lower directory
// renamed with redirect_dir (trusted xattrs: the mount is the daemon's).
func TestIDMappedOverlay(t *testing.T) {
	testutil.Require(t, os.Geteuid() == 0, "idmapped mounts and overlays need root")
	testutil.RequireStore(t)
	dir := filepath.Join(testutil.MainRoot(), "tmp", "idmap-test-"+strconv.Itoa(os.Getpid()))
	t.Cleanup(func() { os.RemoveAll(dir) })
	for _, d := range []string{"lower/etc", "upper", "work"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "lower/etc/f"), []byte("hi"), 0o644); err != nil {
		t.Fatal(err)
	}
	const base = 1 << 30
	m, err := NewIDMapped(testutil.MainRoot(), userNS(t, base), base)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	fd, err := m.Mount(Spec{Lowers: []string{filepath.Join(dir, "lower")}, Upper: filepath.Join(dir, "upper"), Work: filepath.Join(dir, "work")})
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstatat(fd, "etc/f", &st, 0); err != nil {
		t.Fatal(err)
	}
	if st.Uid != base || st.Gid != base {
		t.Fatalf("etc/f through the overlay: %d:%d, want %d:%d", st.Uid, st.Gid, base, base)
	}
	err = m.AsRoot(func() error {
		f, err := unix.Openat(fd, "new", unix.O_CREAT|unix.O_WRONLY|unix.O_CLOEXEC, 0o644)
		if err != nil {
			return err
		}
		unix.Close(f)
		return unix.Renameat(fd, "etc", fd, "etc2")
	})
	if err != nil {
		t.Fatalf("write through the overlay as the sandbox's root: %v", err)
	}
	for _, p := range []string{"upper/new", "upper/etc2"} {
		if err := unix.Stat(filepath.Join(dir, p), &st); err != nil {
			t.Fatal(err)
		}
		if st.Uid != 0 || st.Gid != 0 {
			t.Errorf("%s on disk: %d:%d, want 0:0", p, st.Uid, st.Gid)
		}
	}
	// The thread went back to the daemon's ids.
	if got, _, _ := unix.RawSyscall(unix.SYS_SETFSUID, ^uintptr(0), 0, 0); got != 0 {
		t.Errorf("fsuid after AsRoot: %d", got)
	}
}

// BenchmarkNewIDMapped: the per-sandbox cost of the idmapped view (open_tree clone of
// the store's mount, mount_setattr MOUNT_ATTR_IDMAP).
func BenchmarkNewIDMapped(b *testing.B) {
	ns := userNS(b, 1<<30)
	for i := 0; i < b.N; i++ {
		m, err := NewIDMapped(testutil.MainRoot(), ns, 1<<30)
		if err != nil {
			b.Fatal(err)
		}
		m.Close()
	}
}

// BenchmarkAsRoot: the cost of running a file operation as the sandbox's root.
func BenchmarkAsRoot(b *testing.B) {
	m := &IDMapped{Base: 1 << 30, tree: -1}
	for i := 0; i < b.N; i++ {
		m.AsRoot(func() error { return nil })
	}
}

// TestAsRootDiscardsAThreadItCannotPutBack: fn drops the thread's CAP_SETUID from its
// permitted set, so AsRoot cannot give the thread its capabilities back: AsRoot says so,
// and the thread is discarded (no thread of the process keeps the sandbox's fsuid or
// lacks the capability for the daemon's next work) instead of a panic ending the daemon
// (it did).
func TestAsRootDiscardsAThreadItCannotPutBack(t *testing.T) {
	testutil.Require(t, os.Geteuid() == 0, "setfsuid needs root")
	const base = 1<<30 + 7
	m := &IDMapped{Base: base, tree: -1}
	before := threadsDiscarded.Load()
	err := m.AsRoot(func() error {
		hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
		var c [2]unix.CapUserData
		if err := unix.Capget(&hdr, &c[0]); err != nil {
			return err
		}
		c[0].Effective &^= 1 << unix.CAP_SETUID
		c[0].Permitted &^= 1 << unix.CAP_SETUID
		return unix.Capset(&hdr, &c[0]) // this thread only (raw capset)
	})
	if err == nil {
		t.Fatal("AsRoot on a thread that cannot set its fsuid back returned no error")
	}
	if n := threadsDiscarded.Load() - before; n != 1 {
		t.Fatalf("%d threads discarded, want 1 (err %v)", n, err)
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		tasks, _ := filepath.Glob("/proc/self/task/*/status")
		left := ""
		for _, p := range tasks {
			b, _ := os.ReadFile(p)
			for _, l := range strings.Split(string(b), "\n") {
				f := strings.Fields(l)
				if len(f) == 5 && f[0] == "Uid:" && f[4] == strconv.Itoa(base) {
					left = p + " (fsuid)"
				}
				if len(f) == 2 && f[0] == "CapPrm:" {
					if c, err := strconv.ParseUint(f[1], 16, 64); err == nil && c&(1<<unix.CAP_SETUID) == 0 {
						left = p + " (no CAP_SETUID)"
					}
				}
			}
		}
		if left == "" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: still there 5 s after AsRoot returned", left)
		}
	}
	if err := m.AsRoot(func() error { return nil }); err != nil {
		t.Fatalf("AsRoot after a discarded thread: %v", err)
	}
}

// TestAsRootPanicReachesCaller: a panic in fn is raised again on the caller's goroutine
// (where a recover, net/http's included, can catch it), not on AsRoot's own, which would
// end the daemon, and the thread is put back first.
func TestAsRootPanicReachesCaller(t *testing.T) {
	testutil.Require(t, os.Geteuid() == 0, "setfsuid needs root")
	m := &IDMapped{Base: 1<<30 + 9, tree: -1}
	before := threadsDiscarded.Load()
	func() {
		defer func() {
			if pv := recover(); pv != "boom" {
				t.Fatalf("recovered %v, want boom", pv)
			}
		}()
		m.AsRoot(func() error { panic("boom") })
	}()
	if n := threadsDiscarded.Load() - before; n != 0 {
		t.Fatalf("%d threads discarded after a panic in fn", n)
	}
}
