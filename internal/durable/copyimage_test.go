package durable

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/apitypes"
	"deltabox/internal/procfs"
	"deltabox/internal/remote"
)

// TestCheckCopyImage: an image of a copy is the template's only if the copy was stopped
// and had not run when CRIU took it. A process continued into the blocking call it was
// stopped in (pause: restarted) still has the registers it was left with, but CRIU
// dumps it running and restores it running, and no template can be made of it: its
// image is refused. The same process dumped while stopped passes.
func TestCheckCopyImage(t *testing.T) {
	r := runner(t)
	s := newSandboxSession(t, "cci")
	for _, stopped := range []bool{true, false} {
		res, err := s.d.C.Exec(t.Context(), s.id, apitypes.ExecRequest{Argv: []string{"sh", "-c",
			"setsid python3 -c 'import signal; signal.pause()' </dev/null >/dev/null 2>&1 & echo $!"}})
		if err != nil || res.ExitCode != 0 {
			t.Fatalf("start: %v %+v", err, res)
		}
		inner, _ := strconv.Atoi(strings.TrimSpace(res.Stdout))
		var hp int
		for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			if hp = childWithInnerPid(s.initPid, inner); hp != 0 && procfs.State(hp) == 'S' && syscallNr(hp) == unix.SYS_PAUSE {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("sandbox pid %d (host %d) is not in pause within 20 s", inner, hp)
			}
		}
		if stopped {
			syscall.Kill(hp, syscall.SIGSTOP)
			for deadline := time.Now().Add(5 * time.Second); procfs.State(hp) != 'T'; time.Sleep(time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatalf("host pid %d did not stop", hp)
				}
			}
		}
		// The registers it is left with, as CopyTemplate reads them.
		tr := remote.NewTracer()
		tt, err := tr.Seize(hp)
		if err != nil {
			t.Fatal(err)
		}
		regs := tt.Regs()
		if err := tr.Do(tt.Detach); err != nil {
			t.Fatal(err)
		}
		tr.Close()
		dir := filepath.Join(s.d.Root, "durable", fmt.Sprintf("copy-%v", stopped))
		os.MkdirAll(dir, 0o700)
		if _, err := Dump(t.Context(), r, hp, dir, DumpOptions{Kill: true, Background: true}); err != nil {
			t.Fatal(err)
		}
		err = CheckCopyImage(dir, regs)
		if stopped && err != nil {
			t.Fatalf("the image of a stopped process that never ran: %v", err)
		}
		if !stopped && (err == nil || !strings.Contains(err.Error(), "not stopped")) {
			t.Fatalf("the image of a process running in the call it was left in: %v, want refused as not stopped", err)
		}
	}
}

// syscallNr is the number of the syscall pid is blocked in (-1 if none).
func syscallNr(pid int) int {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/syscall", pid))
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return -1
	}
	n, err := strconv.Atoi(f[0])
	if err != nil {
		return -1
	}
	return n
}
