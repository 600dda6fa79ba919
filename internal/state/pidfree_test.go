package state_test

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"deltabox/internal/state"
	"deltabox/internal/testutil"
)

// TestWaitPidFree: a restore from an image (and of a CRIU tree) waits for its PID to be
// free before CRIU's clone3 asks for it: an evicted 500 MB template was seen holding it
// for a few ms while it exited, and CRIU failed with "File exists". The wait ends when
// the process holding the PID is gone, counts a zombie as holding it (clone3 set_tid
// fails until it is reaped), and gives up at its deadline naming the PID.
func TestWaitPidFree(t *testing.T) {
	m := open(t, testutil.NewStore(t))
	defer m.Close()
	const id = "pf"
	if _, err := m.Create(context.Background(), state.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	pidOf := func(script string) int {
		t.Helper()
		p, err := strconv.Atoi(strings.TrimSpace(sh(t, m, id, script)))
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	waited := func(pid int, d time.Duration) (time.Duration, error) {
		start := time.Now()
		err := state.WaitPidFree(m, id, pid, d)
		return time.Since(start), err
	}

	p := pidOf("nohup sleep 0.4 </dev/null >/dev/null 2>&1 & echo $!")
	if w, err := waited(p, 5*time.Second); err != nil || w < 250*time.Millisecond {
		t.Fatalf("pid %d held by a 0.4 s sleep: waited %v, %v; want a wait until it ended", p, w, err)
	}
	if w, err := waited(p, 5*time.Second); err != nil || w > 50*time.Millisecond {
		t.Fatalf("a free pid: waited %v, %v", w, err)
	}

	// A zombie: its parent does not reap it for 0.5 s, then exits (init reaps it).
	z := pidOf(`rm -f /tmp/z; nohup python3 -c '
import os, time
p = os.fork()
if p == 0:
    os._exit(0)
open("/tmp/z", "w").write(str(p)); time.sleep(0.5)' </dev/null >/dev/null 2>&1 &
for i in $(seq 500); do [ -s /tmp/z ] && break; sleep 0.01; done; cat /tmp/z`)
	if st := strings.TrimSpace(sh(t, m, id, "cut -d' ' -f3 /proc/"+strconv.Itoa(z)+"/stat")); st != "Z" {
		t.Fatalf("pid %d: state %q, want a zombie", z, st)
	}
	if w, err := waited(z, 5*time.Second); err != nil || w < 200*time.Millisecond {
		t.Fatalf("pid %d held by a zombie for 0.5 s: waited %v, %v; want a wait until it was reaped", z, w, err)
	}

	p = pidOf("nohup sleep 5 </dev/null >/dev/null 2>&1 & echo $!")
	w, err := waited(p, 150*time.Millisecond)
	if err == nil || !strings.Contains(err.Error(), "pid "+strconv.Itoa(p)) || w < 150*time.Millisecond || w > 2*time.Second {
		t.Fatalf("pid %d held past the deadline: waited %v, %v; want an error naming it after 150 ms", p, w, err)
	}
}
