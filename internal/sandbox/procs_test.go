package sandbox

import (
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/testutil"
)

// Procs lists a PID namespace's processes from their first entry (a seek past proc's own
// entries): the same PIDs as the whole directory, init first, and it takes that path on
// this kernel (not the fallback). The namespace is a private one (unshare) with a shell
// and 12 stopped children, so that nothing starts or ends between the two listings.
func TestProcsFromFirstProcessEntry(t *testing.T) {
	testutil.Require(t, os.Geteuid() == 0, "needs root (a PID namespace with its proc)")
	cmd := testutil.Command(t, time.Minute, "unshare", "--pid", "--fork", "--mount-proc", "sh", "-c",
		"for i in 1 2 3 4 5 6 7 8 9 10 11 12; do sleep 60 & done; kill -STOP $(jobs -p); echo ready; exec sleep 60")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	line := make([]byte, 6)
	if _, err := out.Read(line); err != nil || string(line) != "ready\n" {
		t.Fatalf("the namespace did not start: %q %v", line, err)
	}
	// unshare's child is the namespace's init (1): its root holds the namespace's proc.
	kids, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", cmd.Process.Pid, cmd.Process.Pid))
	if err != nil || len(strings.Fields(string(kids))) != 1 {
		t.Fatalf("unshare's children: %q %v", kids, err)
	}
	s := &Sandbox{ID: "test", proc: -1}
	if s.proc, err = unix.Open("/proc/"+strings.TrimSpace(string(kids))+"/root/proc", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0); err != nil {
		t.Fatal(err)
	}
	defer unix.Close(s.proc)
	got, err := s.Procs()
	if err != nil {
		t.Fatal(err)
	}
	fd, err := unix.Openat(s.proc, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	whole, err := readPids(fd, make([]byte, 16384))
	if err != nil {
		t.Fatal(err)
	}
	if len(whole) != 13 || !slices.Equal(got, whole) {
		t.Fatalf("Procs = %v, the whole directory = %v (want init and its 12 children)", got, whole)
	}
	if _, err := unix.Seek(fd, tgidOffset+1, 0); err != nil {
		t.Fatal(err)
	}
	first, err := readPids(fd, make([]byte, 16384))
	if err != nil || !slices.Equal(first, whole) {
		t.Fatalf("from offset tgidOffset+1: %v %v, want %v: the kernel's offsets changed, and Procs reads the whole directory", first, err, whole)
	}
}
