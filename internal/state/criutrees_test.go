package state_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"deltabox/internal/cgroup"
	"deltabox/internal/state"
	"deltabox/internal/store"
	"deltabox/internal/testutil"
)

// openDurable is openWith with durable images and CRIU on (openWith turns them off:
// their copies would count as templates in the other tests).
func openDurable(t *testing.T, root string) *state.Manager {
	t.Helper()
	st, err := store.Open(root)
	if err != nil {
		t.Fatal(err)
	}
	cgroup.SetRootFor(root, store.DefaultRoot)
	cfg := state.DefaultConfig()
	cfg.StopSandboxes, cfg.Durable = true, true
	m, err := state.New(st, slog.New(slog.NewTextHandler(io.Discard, nil)), cfg)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// criuCounter is a background process the fast path refuses (two threads) that holds a
// file open for appending, created before the first checkpoint (so that after a freeze
// it is in a lower layer only), and appends "COUNT" to it on each SIGUSR1.
const criuCounter = `cd /workspace; echo start > log; nohup python3 -c '
import os, signal, threading, queue
q = queue.Queue(); f = open("/workspace/log", "a"); n = [0]
def w():
    while True:
        q.get(); n[0] += 1; f.write("%d\n" % n[0]); f.flush()
threading.Thread(target=w, daemon=True).start()
signal.signal(signal.SIGUSR1, lambda s, fr: q.put(1))
open("/workspace/pid", "w").write(str(os.getpid()))
while True: signal.pause()
' </dev/null >/dev/null 2>&1 &
for i in $(seq 1000); do [ -s /workspace/pid ] && exit 0; sleep 0.01; done; exit 1`

// TestFailureAtEveryStepKeepsCRIUTrees: a checkpoint that fails at any step leaves a
// background tree that went through CRIU running, with its PID, threads and memory (its
// count goes on), and the files unchanged: a failure after the move (step 7) ends the
// trees on the new state, and they come back onto the old state only once its upper is
// unfrozen and its namespace reinstalled (restored earlier, they would reopen their log
// in a frozen layer and copy it up there). Then a checkpoint completes.
func TestFailureAtEveryStepKeepsCRIUTrees(t *testing.T) {
	m := openDurable(t, testutil.NewStore(t))
	defer m.Close()
	ctx := context.Background()
	const id = "fc"
	if _, err := m.Create(ctx, state.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	sh(t, m, id, criuCounter)
	pid := strings.TrimSpace(sh(t, m, id, "cat /workspace/pid"))
	if _, err := m.Checkpoint(ctx, id, "base"); err != nil {
		testutil.Require(t, !strings.Contains(err.Error(), "CRIU is unusable"), "no CRIU here: %v", err)
		t.Fatal(err)
	}
	count := 0
	bump := func(what string) {
		t.Helper()
		count++
		want := "start\n"
		for i := 1; i <= count; i++ {
			want += fmt.Sprintf("%d\n", i)
		}
		// Through the manager: a command cannot signal another's process (landlock).
		// Once no signal is pending on it: right after a restore, the SIGCONT that
		// resumes it may still be, and a SIGUSR1 sent then goes to its other thread,
		// whose handler does not wake the main thread's pause().
		sh(t, m, id, `for i in $(seq 500); do [ -z "$(grep -E '^(SigPnd|ShdPnd):' /proc/`+pid+`/status | grep -v '0000000000000000$')" ] && break; sleep 0.01; done`)
		if n, err := strconv.Atoi(pid); err != nil {
			t.Fatal(err)
		} else if _, err := m.Signal(id, n, int(unix.SIGUSR1)); err != nil {
			t.Fatal(err)
		}
		got := sh(t, m, id, fmt.Sprintf(`for i in $(seq 500); do [ "$(wc -l < /workspace/log)" = %d ] && break; sleep 0.01; done; cat /workspace/log`, count+1))
		if got != want {
			t.Fatalf("%s: log %q, want %q", what, got, want)
		}
		if th := strings.TrimSpace(sh(t, m, id, "ls /proc/"+pid+"/task | wc -l; cut -d' ' -f3 /proc/"+pid+"/stat")); th != "2\nS" {
			t.Fatalf("%s: the counter's threads and state: %q, want 2 threads, sleeping", what, th)
		}
	}
	bump("after the base checkpoint")
	for step := 1; step <= state.CheckpointStepCount; step++ {
		t.Run(fmt.Sprintf("checkpoint-step%d", step), func(t *testing.T) {
			sh(t, m, id, fmt.Sprintf("echo %d > /workspace/step", step)) // a change: the checkpoint moves
			before := sh(t, m, id, manifest)
			state.SetFailStep(m, func(o string, k int) error {
				if o == "checkpoint" && k == step {
					// Unused dentries dropped: the undo's lookups in the old state go
					// to the layers, not to what the kernel remembers of them (a
					// path looked up before the freeze would find the moved file).
					os.WriteFile("/proc/sys/vm/drop_caches", []byte("2"), 0)
					return fmt.Errorf("injected failure at %s step %d", o, k)
				}
				return nil
			})
			_, err := m.Checkpoint(ctx, id, "x")
			state.SetFailStep(m, nil)
			if err == nil || !strings.Contains(err.Error(), "injected") || strings.Contains(err.Error(), "could not be put back") {
				t.Fatalf("checkpoint failing at step %d: %v, want the injected failure alone", step, err)
			}
			if after := sh(t, m, id, manifest); after != before {
				t.Fatalf("files changed by a checkpoint failing at step %d:\nbefore:\n%s\nafter:\n%s", step, before, after)
			}
			bump(fmt.Sprintf("after a checkpoint failing at step %d", step))
		})
	}
	r, err := m.Checkpoint(ctx, id, "done")
	if err != nil || r.CRIUProcesses != 1 {
		t.Fatalf("checkpoint after the failures: %v %+v", err, r)
	}
	bump("after the last checkpoint")
}
