package landlock

import (
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"deltabox/internal/testutil/skip"
)

// TestExecArgWallsOff: two programs started through ExecArg are in domains of their
// own: one cannot read where the other's fd 0 leads (/proc/PID/fd/0, a ptrace access
// check), which a program outside any domain, and the one's own child, can.
func TestExecArgWallsOff(t *testing.T) {
	skip.Require(t, os.Geteuid() == 0, "needs root (landlock_restrict_self without no_new_privs needs CAP_SYS_ADMIN)")
	skip.Require(t, Check() == nil, "landlock: %v", Check())
	a := exec.Command("/proc/self/exe", ExecArg, "sleep", "30")
	if err := a.Start(); err != nil {
		t.Fatal(err)
	}
	defer a.Wait()
	defer a.Process.Kill()
	fd := "/proc/" + strconv.Itoa(a.Process.Pid) + "/fd/0"
	// Wait for the exec into sleep: the wrapper itself is the test binary.
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if b, _ := os.ReadFile("/proc/" + strconv.Itoa(a.Process.Pid) + "/comm"); strings.TrimSpace(string(b)) == "sleep" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the wrapped sleep did not start within 5 s")
		}
	}
	if out, err := exec.Command("readlink", fd).CombinedOutput(); err != nil {
		t.Fatalf("readlink %s outside any domain: %v %s", fd, err, out)
	}
	out, err := exec.Command("/proc/self/exe", ExecArg, "readlink", fd).CombinedOutput()
	if err == nil {
		t.Fatalf("readlink %s from a sibling domain: %q, want it refused", fd, out)
	}
	out, err = exec.Command("/proc/self/exe", ExecArg, "sh", "-c", "sleep 30 & p=$!; sleep 0.1; readlink /proc/$p/fd/0 >/dev/null && echo own; kill $p").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "own") {
		t.Fatalf("a domain's own child: %v %q, want its fd 0 read", err, out)
	}
}
