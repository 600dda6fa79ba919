package state_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/nftables"
	"golang.org/x/sys/unix"

	"deltabox/internal/cgroup"
	"deltabox/internal/netns"
	"deltabox/internal/sandbox"
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
// it is in a lower layer only), and appends "COUNT" to it on each SIGUSR1, which its
// main thread passes to the other over a loopback TCP connection: a checkpoint that
// fails at any step must also leave the connection working (out of CRIU's repair mode,
// the sandbox's traffic unlocked). It takes SIGUSR1 by sigwait, blocked in both
// threads, as removedThings does and for its reasons (a handler and pause() lose a
// signal that comes just before the pause).
const criuCounter = `cd /workspace; echo start > log; nohup python3 -c '
import os, signal, socket, threading
f = open("/workspace/log", "a"); n = [0]
l = socket.socket(); l.bind(("127.0.0.1", 0)); l.listen()
c = socket.create_connection(l.getsockname()); a, _ = l.accept()
def w():
    while True:
        if a.recv(1) != b"+": raise SystemExit("the connection broke")
        n[0] += 1; f.write("%d\n" % n[0]); f.flush()
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
threading.Thread(target=w, daemon=True).start()
open("/workspace/pid", "w").write(str(os.getpid()))
while True:
    signal.sigwait([signal.SIGUSR1]); c.send(b"+")
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

// removedThings is a background python with two threads (CRIU carries it) that holds,
// by its argument, an unlinked open file (ghost: each SIGUSR1 appends the count to it
// and copies it to /workspace/ghost.out), a unix socket bound at /workspace/sock (sock:
// each connection is answered "pong"), or a removed working directory (cwd: each
// SIGUSR1 writes the link count of "." to /workspace/cwd.out). tests/e2e has its twin.
//
// It takes SIGUSR1 by sigwait in its main thread, the signal blocked in every thread,
// and has no handler: a blocked signal stays pending until sigwait takes it, whenever it
// comes and whichever thread the kernel looks at. A python handler runs on the main
// thread between any two bytecodes, and the one this had (threading.Event.set, with
// the main thread polling Event.wait(0.1)) could run inside that Event's own wait while
// the wait held the Event's lock, a plain Lock: set then waited for that lock forever,
// and the process never answered again ("ghost: no answer" in a run of the whole suite).
// Signalled in a loop through Manager.Signal at load 5 to 8 on two cores, 3 signals of
// 2,918 went so; python's traceback of the stuck process showed Event.set inside
// Event.wait. A handler with pause() instead loses a signal that comes between the
// loop's last look for handlers and the pause.
const removedThings = `
import os, sys, signal, socket, threading, time
mode = sys.argv[1]
n = [0]
# Blocked before any thread starts: every thread inherits the mask.
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
threading.Thread(target=time.sleep, args=(100000,), daemon=True).start()
if mode == "ghost":
    f = open("/workspace/g", "w+"); f.write("hello\n"); f.flush(); os.unlink("/workspace/g")
    def on():
        n[0] += 1; f.write("%d\n" % n[0]); f.flush(); f.seek(0)
        open("/workspace/ghost.out", "w").write(f.read())
elif mode == "sock":
    s = socket.socket(socket.AF_UNIX); s.bind("/workspace/sock"); s.listen(8)
    def serve():
        while True:
            c, _ = s.accept(); c.sendall(b"pong\n"); c.close()
    threading.Thread(target=serve, daemon=True).start()
    def on(): n[0] += 1
elif mode == "cwd":
    os.mkdir("/workspace/d"); os.chdir("/workspace/d"); os.rmdir("/workspace/d")
    def on():
        n[0] += 1
        open("/workspace/cwd.out", "w").write("%d %d\n" % (n[0], os.stat(".").st_nlink))
open("/workspace/%s.pid" % mode, "w").write(str(os.getpid()))
while True:
    signal.sigwait([signal.SIGUSR1])
    on()
    open("/workspace/%s.done" % mode, "w").write(str(n[0]))
`

// TestFailureAtEveryStepKeepsRemovedFiles: processes that go through CRIU holding an
// unlinked open file, a bound unix socket and a removed working directory keep running,
// with what they hold, through a checkpoint that fails at any step, and the files stay
// as they were (no ghost file, the socket's path kept); then a checkpoint completes and
// a restore carries them.
func TestFailureAtEveryStepKeepsRemovedFiles(t *testing.T) {
	m := openDurable(t, testutil.NewStore(t))
	defer m.Close()
	ctx := context.Background()
	const id = "fr"
	if _, err := m.Create(ctx, state.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	if _, err := m.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"bash", "-c", `printf %s "$1" > /tmp/removed.py`, "sh", removedThings}, Timeout: 30 * time.Second}); err != nil {
		t.Fatal(err)
	}
	pids := map[string]string{}
	for _, mode := range []string{"ghost", "sock", "cwd"} {
		sh(t, m, id, fmt.Sprintf(`cd /workspace; nohup python3 /tmp/removed.py %s </dev/null >/dev/null 2>&1 &
for i in $(seq 1000); do [ -s /workspace/%s.pid ] && exit 0; sleep 0.01; done; exit 1`, mode, mode))
		pids[mode] = strings.TrimSpace(sh(t, m, id, "cat /workspace/"+mode+".pid"))
	}
	count := 0
	check := func(what string) {
		t.Helper()
		count++
		for _, mode := range []string{"ghost", "sock", "cwd"} {
			// Alive with its two threads; then signalled through the manager: a
			// command cannot signal another command's process (landlock).
			sh(t, m, id, fmt.Sprintf(`p=%s; [ -e /proc/$p ] && [ $(ls /proc/$p/task | wc -l) -ge 2 ] || { echo "%s: process $p is gone" >&2; exit 1; }`, pids[mode], mode))
			n, err := strconv.Atoi(pids[mode])
			if err != nil {
				t.Fatal(err)
			}
			if _, err := m.Signal(id, n, int(unix.SIGUSR1)); err != nil {
				t.Fatal(err)
			}
			sh(t, m, id, fmt.Sprintf(`for i in $(seq 500); do [ "$(cat /workspace/%s.done 2>/dev/null)" = %d ] && exit 0; sleep 0.01; done; echo "%s: no answer" >&2; exit 1`, mode, count, mode))
		}
		want := "hello\n"
		for i := 1; i <= count; i++ {
			want += fmt.Sprintf("%d\n", i)
		}
		if got := sh(t, m, id, "cat /workspace/ghost.out"); got != want {
			t.Fatalf("%s: the unlinked file holds %q, want %q", what, got, want)
		}
		if got := sh(t, m, id, `python3 -c 'import socket; s = socket.socket(socket.AF_UNIX); s.connect("/workspace/sock"); print(s.recv(100).decode(), end="")'`); got != "pong\n" {
			t.Fatalf("%s: the socket answered %q", what, got)
		}
		if got, want := sh(t, m, id, "cat /workspace/cwd.out"), fmt.Sprintf("%d 0\n", count); got != want {
			t.Fatalf("%s: the removed cwd: %q, want %q", what, got, want)
		}
	}
	check("at the start")
	if _, err := m.Checkpoint(ctx, id, "base"); err != nil {
		testutil.Require(t, !strings.Contains(err.Error(), "CRIU is unusable"), "no CRIU here: %v", err)
		t.Fatal(err)
	}
	check("after the base checkpoint")
	for step := 1; step <= state.CheckpointStepCount; step++ {
		t.Run(fmt.Sprintf("checkpoint-step%d", step), func(t *testing.T) {
			sh(t, m, id, fmt.Sprintf("echo %d > /workspace/step", step))
			before := sh(t, m, id, manifest)
			state.SetFailStep(m, func(o string, k int) error {
				if o == "checkpoint" && k == step {
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
			check(fmt.Sprintf("after a checkpoint failing at step %d", step))
		})
	}
	r, err := m.Checkpoint(ctx, id, "done")
	if err != nil || r.CRIUProcesses != 3 {
		t.Fatalf("checkpoint after the failures: %v %+v", err, r)
	}
	check("after the last checkpoint")
	done := count
	sh(t, m, id, "echo later > /workspace/later")
	if _, err := m.Restore(ctx, id, r.Node.ID); err != nil {
		t.Fatal(err)
	}
	if sh(t, m, id, "ls /workspace/later 2>/dev/null || true") != "" {
		t.Fatal("the restore kept a file made after the checkpoint")
	}
	// The node holds the processes as they were at the checkpoint: their counts go on
	// from there.
	count = done - 1
	sh(t, m, id, fmt.Sprintf("for m in ghost sock cwd; do echo %d > /workspace/$m.done; done", count))
	check("after the restore")
}

// TestRestoreFailureKeepsCRIUTreeConnection: a restore of a node whose CRIU tree holds a
// TCP connection that fails at any of its steps leaves no lock on the connection (the
// restore locks it from before its first tree's restore: an undo pushed before the
// lock removes it): the next restore's tree counts through its connection again.
func TestRestoreFailureKeepsCRIUTreeConnection(t *testing.T) {
	m := openDurable(t, testutil.NewStore(t))
	defer m.Close()
	ctx := context.Background()
	const id = "rfc"
	if _, err := m.Create(ctx, state.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	sh(t, m, id, criuCounter)
	pid := atoi(strings.TrimSpace(sh(t, m, id, "cat /workspace/pid")))
	cp, err := m.Checkpoint(ctx, id, "base")
	if err != nil || cp.CRIUProcesses != 1 {
		t.Fatalf("checkpoint: %v %+v", err, cp)
	}
	count := func(what string) {
		t.Helper()
		if _, err := m.Signal(id, pid, int(unix.SIGUSR1)); err != nil {
			t.Fatal(err)
		}
		if got := sh(t, m, id, `for i in $(seq 500); do [ "$(wc -l < /workspace/log)" = 2 ] && break; sleep 0.01; done; cat /workspace/log`); got != "start\n1\n" {
			t.Fatalf("%s: log %q, want the node's and one count through the connection", what, got)
		}
	}
	for step := 1; step <= state.RestoreStepCount; step++ {
		state.SetFailStep(m, func(o string, k int) error {
			if o == "restore" && k == step {
				return fmt.Errorf("injected failure at %s step %d", o, k)
			}
			return nil
		})
		_, err := m.Restore(ctx, id, cp.Node.ID)
		state.SetFailStep(m, nil)
		if err == nil || !strings.Contains(err.Error(), "injected") {
			t.Fatalf("restore failing at step %d: %v, want the injected failure", step, err)
		}
		if ts := lockTables(t, id); len(ts) > 0 {
			t.Fatalf("after a restore failing at step %d: locks left in the sandbox's namespace: %v", step, ts)
		}
		if _, err := m.Restore(ctx, id, cp.Node.ID); err != nil {
			t.Fatalf("restore after one failing at step %d: %v", step, err)
		}
		count(fmt.Sprintf("after a restore failing at step %d", step))
	}
}

// lockTables lists the nftables tables of sandbox id's network namespace that lock TCP
// connections (netns.LockTable, CRIU's "CRIU-*"), read through one of its processes.
func lockTables(t *testing.T, id string) []string {
	t.Helper()
	for h := range sandboxProcs(t, id) {
		f, err := os.Open(fmt.Sprintf("/proc/%d/ns/net", h))
		if err != nil {
			continue
		}
		defer f.Close()
		c, err := nftables.New(nftables.WithNetNSFd(int(f.Fd())))
		if err != nil {
			t.Fatal(err)
		}
		defer c.CloseLasting()
		all, err := c.ListTablesOfFamily(nftables.TableFamilyINet)
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, tb := range all {
			if tb.Name == netns.LockTable || strings.HasPrefix(tb.Name, "CRIU-") {
				out = append(out, tb.Name)
			}
		}
		return out
	}
	t.Fatalf("sandbox %s has no process", id)
	return nil
}

// TestRestoreFailureEndsSessionsSinceAsFailed: a restore of a node with a CRIU tree ends
// the sessions the node lacks before it restores the tree (a tree's own pty must get its
// number back: restore.go), so before it knows whether it succeeds. Failing before its
// kill (steps 1-4: the injected failure comes before it), it leaves such a session running; failing after, the session is
// reported ended by the failure, not by a restore that succeeded (the reason a
// successful one gives, checked last).
func TestRestoreFailureEndsSessionsSinceAsFailed(t *testing.T) {
	m := openDurable(t, testutil.NewStore(t))
	defer m.Close()
	ctx := context.Background()
	const id = "rfs"
	if _, err := m.Create(ctx, state.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	sh(t, m, id, criuCounter)
	cp, err := m.Checkpoint(ctx, id, "base")
	if err != nil || cp.CRIUProcesses != 1 {
		t.Fatalf("checkpoint: %v %+v", err, cp)
	}
	exit := func(name string) string {
		t.Helper()
		infos, err := m.Sessions(id)
		if err != nil {
			t.Fatal(err)
		}
		for _, in := range infos {
			if in.Name == name {
				return in.Exit
			}
		}
		t.Fatalf("no session %s among %+v", name, infos)
		return ""
	}
	const beforeKill = 4 // injected before step 4 runs, as at 1-3: nothing is ended
	for step := 1; step <= state.RestoreStepCount+1; step++ {
		name := fmt.Sprintf("since%d", step)
		if _, err := m.StartSession(ctx, id, state.SessionOptions{Name: name, Kind: "bash"}); err != nil {
			t.Fatal(err)
		}
		state.SetFailStep(m, func(o string, k int) error {
			if o == "restore" && k == step {
				return fmt.Errorf("injected failure at %s step %d", o, k)
			}
			return nil
		})
		res, err := m.Restore(ctx, id, cp.Node.ID)
		state.SetFailStep(m, nil)
		switch got := exit(name); {
		case step > state.RestoreStepCount:
			if err != nil || !slices.Contains(res.SessionsEnded, name) || !strings.Contains(got, "where it had no process state") {
				t.Fatalf("restore: %v, sessions ended %v, session %s's end %q: want it ended as the node lacks it", err, res.SessionsEnded, name, got)
			}
		case err == nil || !strings.Contains(err.Error(), "injected"):
			t.Fatalf("restore failing at step %d: %v, want the injected failure", step, err)
		case step <= beforeKill && got != "":
			t.Fatalf("restore failing at step %d, before its kill: session %s ended (%q), want it running", step, name, got)
		case step <= beforeKill:
			call(t, m, id, name, "true")
		case !strings.Contains(got, "failed after its process was ended") || !strings.Contains(got, "injected"):
			t.Fatalf("restore failing at step %d: session %s's end %q, want the failure's", step, name, got)
		}
	}
}
