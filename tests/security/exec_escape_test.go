package security

import (
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/testutil"
)

// TestExecTimeoutLeavesNothing: a command that tries to outlive its timeout by every
// way out of its process group and session (setsid, a double fork reparented to init, a
// fork loop starting new sessions, writes to the cgroup files it could reach) is ended
// whole when its timeout comes: nothing carrying its marker is left on the host, and
// the sandbox keeps working. `bash -c 'setsid sleep 1000 & sleep 100'` with a 2 s
// timeout left the sleep running; a fork loop went on after the exec had returned.
func TestExecTimeoutLeavesNothing(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "sec-escape"
	if _, err := d.C.Create(ctx(t), apitypes.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	marker := "escape" + strconv.Itoa(os.Getpid())
	script := `m=` + marker + `
for f in /sys/fs/cgroup/cgroup.procs /sys/fs/cgroup/*/cgroup.procs /sys/fs/cgroup/*/tasks; do echo $$ > $f 2>/dev/null; done
setsid bash -c "sleep 1000; : $m" &
( setsid bash -c "sleep 1001; : $m" & ) &
while :; do setsid bash -c "sleep 1002; : $m" & sleep 0.01; done`
	start := time.Now()
	r, err := d.C.Exec(ctx(t), id, apitypes.ExecRequest{Argv: []string{"bash", "-c", script, marker}, TimeoutMS: 1500})
	if err != nil {
		t.Fatal(err)
	}
	if !r.TimedOut {
		t.Fatalf("not timed out: %+v", r)
	}
	deadline := time.Now().Add(3 * time.Second)
	for {
		left := hostPidsWith(t, marker)
		if len(left) == 0 {
			break
		}
		if time.Now().After(deadline) {
			var desc []string
			for _, p := range left {
				b, _ := os.ReadFile("/proc/" + strconv.Itoa(p) + "/cmdline")
				desc = append(desc, strconv.Itoa(p)+":"+strings.ReplaceAll(string(b), "\x00", " "))
			}
			t.Fatalf("%v after the exec returned (it ran %v): the command's processes are left: %v", 3*time.Second, time.Since(start), desc)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if got := sh(t, d, id, "echo ok"); got != "ok\n" {
		t.Fatalf("after the timeout: %q", got)
	}
}
