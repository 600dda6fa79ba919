package sbinit

import (
	"bufio"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"deltabox/internal/testutil/skip"
)

// TestNSStateAndReset: a thread in another process's IPC and UTS namespaces sees
// that namespace's objects and names (not the daemon's), leaves out a removed but
// attached segment, and Reset removes every object and sets the names.
func TestNSStateAndReset(t *testing.T) {
	skip.Require(t, os.Geteuid() == 0, "needs root (namespaces)")
	_, err := exec.LookPath("ipcmk")
	skip.Require(t, err == nil, "needs ipcmk (util-linux)")
	// A process in new IPC and UTS namespaces makes a queue, a set of 3 semaphores, a
	// segment, a POSIX message queue, and a second segment that it attaches and then
	// removes (python3 keeps it attached), then waits.
	cmd := exec.Command("sh", "-c", `ipcmk -Q >/dev/null && ipcmk -S 3 >/dev/null && ipcmk -M 4096 >/dev/null &&
hostname inside && exec python3 -c '
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
i = libc.shmget(0, 8192, 0o1600)
assert libc.shmat(i, None, 0) not in (None, ctypes.c_void_p(-1).value)
assert libc.shmctl(i, 0, None) == 0
assert libc.mq_close(libc.mq_open(b"/dbx q", 0o102, 0o600, None)) == 0  # O_CREAT|O_RDWR
print("ok", flush=True)
sys.stdin.read()'`)
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: unix.CLONE_NEWIPC | unix.CLONE_NEWUTS}
	stdin, _ := cmd.StdinPipe()
	out, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { stdin.Close(); cmd.Wait() }()
	if l, _ := bufio.NewReader(out).ReadString('\n'); l != "ok\n" {
		t.Fatalf("the namespace's process did not come up: %q", l)
	}
	th, err := OpenNS(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	defer th.Close()
	st, err := th.State()
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, o := range st.IPC {
		got = append(got, o.Kind+" "+o.Size)
	}
	want := []string{"POSIX message queue ", "message queue 0 messages, 0 bytes", "semaphore set 3 semaphores", "shared memory segment 4096 bytes, 0 attached"}
	if strings.Join(got, "|") != strings.Join(want, "|") || st.IPC[0].String() != `POSIX message queue "/dbx q"` || st.UTS.Hostname != "inside" {
		t.Fatalf("state %+v: objects %q, want %q and hostname inside", st, got, want)
	}
	removed, err := th.Reset(UTS{Hostname: "restored", Domainname: "dom"})
	if err != nil || len(removed) != 5 { // the removed, attached segment too
		t.Fatalf("reset removed %v: %v", removed, err)
	}
	st, err = th.State()
	if err != nil || len(st.IPC) != 0 || st.UTS != (UTS{"restored", "dom"}) {
		t.Fatalf("after reset: %+v %v", st, err)
	}
	// The daemon's own names are untouched, and every thread is back in its namespaces.
	var u unix.Utsname
	unix.Uname(&u)
	if h := unix.ByteSliceToString(u.Nodename[:]); h == "restored" {
		t.Fatalf("the daemon's hostname changed")
	}
	for _, ns := range []string{"ipc", "uts"} {
		self, _ := os.Readlink("/proc/self/ns/" + ns)
		tasks, _ := filepath.Glob("/proc/self/task/*/ns/" + ns)
		for _, p := range tasks {
			if l, _ := os.Readlink(p); l != self {
				t.Errorf("%s is %s, the process's %s", p, l, self)
			}
		}
	}
}
