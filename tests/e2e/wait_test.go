package e2e

// Checkpoints and restores that wait (issue 16, item 6): with wait_ms they queue behind
// the calls (execs, file operations) that arrived before them instead of refusing, calls
// that arrive meanwhile wait behind them, and past wait_ms the 409 names what they
// waited for. The tests speak raw JSON for the new fields, so that they compile and fail
// against a daemon without them. Helpers of this file are prefixed wt.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"deltabox/internal/api"
	"deltabox/internal/client"
	"deltabox/internal/testutil"
)

// wtOp sends a checkpoint (node "") or a restore with body fields extra and returns the
// status and the decoded answer (an error body's message in msg).
func wtOp(t *testing.T, d *testutil.Daemon, id, node string, extra map[string]any) (status int, ans map[string]any, msg string) {
	t.Helper()
	body := map[string]any{}
	for k, v := range extra {
		body[k] = v
	}
	path := "/sandboxes/" + id + "/checkpoint"
	if node != "" {
		path = "/sandboxes/" + id + "/restore"
		body["node"] = node
	}
	b, _ := json.Marshal(body)
	status, raw := dbxRaw(t, d, "POST", path, string(b))
	if status >= 300 {
		_, msg = dbxErrorBody(t, raw)
		return status, nil, msg
	}
	if err := json.Unmarshal(raw, &ans); err != nil {
		t.Fatalf("%s: %v: %s", path, err, raw)
	}
	return status, ans, ""
}

// wtNode is the node id of a checkpoint's or restore's answer.
func wtNode(t *testing.T, ans map[string]any) string {
	t.Helper()
	n, _ := ans["node"].(map[string]any)
	id, _ := n["id"].(string)
	if id == "" {
		t.Fatalf("no node in %v", ans)
	}
	return id
}

// wtStarted runs script in the background (bash -c, through the API) once it has
// written /workspace/.started-NAME, and returns a channel with its result.
func wtStarted(t *testing.T, d *testutil.Daemon, id, name, script string) <-chan error {
	t.Helper()
	done := make(chan error, 1)
	go func() {
		r, err := d.C.Exec(context.Background(), id, api.ExecRequest{
			Argv: []string{"bash", "-c", "touch /workspace/.started-" + name + "; " + script}, TimeoutMS: 60_000})
		if err == nil && r.ExitCode != 0 {
			err = fmt.Errorf("exit %d: %s", r.ExitCode, r.Stderr)
		}
		done <- err
	}()
	deadline := time.Now().Add(20 * time.Second)
	for {
		if _, err := d.C.StatFile(dbxCtx(t), id, "/workspace/.started-"+name); err == nil {
			return done
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s did not start", name)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestCheckpointWaitQueuesBehindCalls: a checkpoint with wait_ms waits for the exec that
// runs (its node has what the exec wrote last), and an exec that arrives while the
// checkpoint waits runs after it (the node does not have what it wrote). Same for a
// restore.
func TestCheckpointWaitQueuesBehindCalls(t *testing.T) {
	d := testutil.StartDaemon(t)
	id := dbxCreate(t, d, "wait1").ID
	n0 := dbxCheckpoint(t, d, id, "empty").Node.ID

	first := wtStarted(t, d, id, "first", "sleep 1.5; echo first > first")
	type opAns struct {
		status int
		ans    map[string]any
		msg    string
		at     time.Time
	}
	ck := make(chan opAns, 1)
	go func() {
		s, a, m := wtOp(t, d, id, "", map[string]any{"label": "waited", "wait_ms": 20_000})
		ck <- opAns{s, a, m, time.Now()}
	}()
	time.Sleep(300 * time.Millisecond) // the checkpoint is queued by now
	lateStart := time.Now()
	lateRes := dbxExec(t, d, id, api.ExecRequest{Argv: []string{"bash", "-c", "echo late > late"}})
	lateEnd := time.Now()
	c := <-ck
	if c.status != 201 {
		t.Fatalf("checkpoint with wait_ms while an exec runs: %d %s, want 201 once the exec ended", c.status, c.msg)
	}
	if err := <-first; err != nil {
		t.Fatalf("the first exec: %v", err)
	}
	if lateRes.ExitCode != 0 {
		t.Fatalf("the late exec: %+v", lateRes)
	}
	if lateEnd.Before(c.at.Add(-50 * time.Millisecond)) {
		t.Fatalf("the exec that arrived while the checkpoint waited ended at +%v, before the checkpoint's answer at +%v: it did not wait behind it",
			lateEnd.Sub(lateStart), c.at.Sub(lateStart))
	}
	waited, _ := c.ans["waited_ms"].(float64)
	if waited < 800 {
		t.Fatalf("waited_ms %v, want about 1200 (the rest of the first exec's sleep): %v", waited, c.ans)
	}
	node := wtNode(t, c.ans)
	t.Logf("checkpoint waited %.0f ms; the late exec took %v", waited, lateEnd.Sub(lateStart).Round(time.Millisecond))

	dbxRestore(t, d, id, n0)
	dbxRestore(t, d, id, node)
	if got := dbxSh(t, d, id, "cat first; ls"); got != "first\nfirst\n" {
		t.Fatalf("the node holds %q, want the first exec's file and not the late one's", got)
	}

	// A restore waits the same way.
	slow := wtStarted(t, d, id, "slow", "sleep 1; echo slow > slow")
	s, a, m := wtOp(t, d, id, n0, map[string]any{"wait_ms": 20_000})
	if s != 200 {
		t.Fatalf("restore with wait_ms while an exec runs: %d %s", s, m)
	}
	if err := <-slow; err != nil {
		t.Fatalf("the exec the restore waited for: %v", err)
	}
	if w, _ := a["waited_ms"].(float64); w < 500 {
		t.Fatalf("restore: waited_ms %v, want about 1000", w)
	}
	if got := dbxSh(t, d, id, "ls -A"); got != "" {
		t.Fatalf("after the restore to the empty node: %q", got)
	}
}

// TestCheckpointWaitGivesUp: past wait_ms the 409 names the call it waited for and how
// long it has run; without wait_ms the 409 comes at once and says how to wait; calls
// queued behind a switch that gives up then run; wait_ms out of range is a 400.
func TestCheckpointWaitGivesUp(t *testing.T) {
	d := testutil.StartDaemon(t)
	id := dbxCreate(t, d, "wait2").ID
	n0 := dbxCheckpoint(t, d, id, "empty").Node.ID
	long := wtStarted(t, d, id, "long", "sleep 30")

	start := time.Now()
	s, _, m := wtOp(t, d, id, "", map[string]any{"wait_ms": 400})
	took := time.Since(start)
	if s != 409 || !strings.Contains(m, "waited 400ms") || !strings.Contains(m, `sleep 30`) || !strings.Contains(m, "running for") {
		t.Fatalf("checkpoint past its wait: %d %q, want 409 naming the exec it waited for", s, m)
	}
	if took < 350*time.Millisecond || took > 5*time.Second {
		t.Fatalf("the checkpoint gave up after %v, want about 400 ms", took)
	}
	s, _, m = wtOp(t, d, id, n0, map[string]any{"wait_ms": 300})
	if s != 409 || !strings.Contains(m, "restore of wait2 waited 300ms") || !strings.Contains(m, "sleep 30") {
		t.Fatalf("restore past its wait: %d %q", s, m)
	}
	// No wait: at once, naming the call, saying how to wait.
	start = time.Now()
	s, _, m = wtOp(t, d, id, "", nil)
	if s != 409 || !strings.Contains(m, "sleep 30") || !strings.Contains(m, "wait_ms") || time.Since(start) > 2*time.Second {
		t.Fatalf("checkpoint without a wait: %d %q after %v, want 409 at once naming the exec and wait_ms", s, m, time.Since(start))
	}
	// An exec queued behind a switch that gives up runs once it has.
	ck := make(chan int, 1)
	go func() {
		s, _, _ := wtOp(t, d, id, "", map[string]any{"wait_ms": 1000})
		ck <- s
	}()
	time.Sleep(200 * time.Millisecond)
	start = time.Now()
	dbxSh(t, d, id, "true")
	queued := time.Since(start)
	if s := <-ck; s != 409 {
		t.Fatalf("the checkpoint behind a 30 s exec answered %d", s)
	}
	if queued < 500*time.Millisecond || queued > 10*time.Second {
		t.Fatalf("an exec that arrived while a checkpoint waited (1 s) ran after %v, want after the checkpoint gave up (~800 ms)", queued)
	}
	for _, w := range []int64{-1, 600_001} {
		if s, _, m := wtOp(t, d, id, "", map[string]any{"wait_ms": w}); s != 400 || !strings.Contains(m, "wait") {
			t.Fatalf("wait_ms %d: %d %q, want 400", w, s, m)
		}
	}
	// The exec is killed: the sandbox goes.
	if err := d.C.Remove(dbxCtx(t), id); err != nil {
		t.Fatal(err)
	}
	<-long
}

// TestCheckpointWaitFileWriteRace is the race: 5 MB files.write calls back to
// back from two writers (so that one always runs: a checkpoint that only waited for an
// idle moment would starve), against a loop of checkpoints. Without wait_ms most are
// refused; with it every one goes through, between writes, and every write succeeds.
func TestCheckpointWaitFileWriteRace(t *testing.T) {
	d := testutil.StartDaemon(t)
	id := dbxCreate(t, d, "wait3").ID
	data := bytes.Repeat([]byte("0123456789abcdef"), 5<<20/16)
	var stop atomic.Bool
	var writes, failed atomic.Int64
	var wg sync.WaitGroup
	var firstErr atomic.Value
	for w := 0; w < 2; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; !stop.Load(); i++ {
				_, err := d.C.WriteFile(context.Background(), id, fmt.Sprintf("w%d-%d.bin", w, i%4), bytes.NewReader(data), client.WriteFileOptions{})
				if err != nil {
					failed.Add(1)
					firstErr.CompareAndSwap(nil, err.Error())
					continue
				}
				writes.Add(1)
			}
		}()
	}
	defer func() { stop.Store(true); wg.Wait() }()
	for writes.Load() < 2 {
		time.Sleep(10 * time.Millisecond)
	}
	refused := 0
	for i := 0; i < 30; i++ {
		if s, _, _ := wtOp(t, d, id, "", nil); s == 409 {
			refused++
		}
	}
	t.Logf("without wait_ms: %d of 30 checkpoints refused (409)", refused)
	start := time.Now()
	var maxWait float64
	for i := 0; i < 30; i++ {
		s, a, m := wtOp(t, d, id, "", map[string]any{"label": fmt.Sprint("race ", i), "wait_ms": 30_000})
		if s != 201 {
			t.Fatalf("checkpoint %d with wait_ms during back-to-back 5 MB writes: %d %s", i, s, m)
		}
		if w, _ := a["waited_ms"].(float64); w > maxWait {
			maxWait = w
		}
	}
	stop.Store(true)
	wg.Wait()
	if failed.Load() > 0 {
		t.Fatalf("%d writes failed meanwhile, the first: %v", failed.Load(), firstErr.Load())
	}
	t.Logf("with wait_ms: 30 of 30 checkpoints in %v (longest wait %.0f ms), %d writes", time.Since(start).Round(time.Millisecond), maxWait, writes.Load())
}
