package security

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/errdefs"
	"deltabox/internal/testutil"
)

// The daemon's own resources: whatever a sandbox does, the daemon's memory and threads
// stay bounded and another sandbox keeps answering (docs/API.md "Limits").

// procStatus reads a field of /proc/PID/status (VmRSS in kB, Threads).
func procStatus(t *testing.T, pid int, field string) int64 {
	t.Helper()
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, field+":"); ok {
			n, err := strconv.ParseInt(strings.Fields(v)[0], 10, 64)
			if err != nil {
				t.Fatalf("%s: %q", field, l)
			}
			return n
		}
	}
	t.Fatalf("no %s in /proc/%d/status", field, pid)
	return 0
}

// rssBound is how much the daemon's resident memory may grow while a sandbox floods
// it: the buffers a sandbox can fill are about 2 MiB a session (docs/API.md), and
// the Go heap's own slack is a few MiB.
const rssBound = 32 << 10 // kB

// victimBound is how long an exec in another sandbox may take while one floods the
// daemon (an idle `true` answers in ~10 ms on the 2-core VM).
const victimBound = 3 * time.Second

// watch samples the daemon's RSS and runs `true` in victim every 200 ms until stop is
// closed; it returns the highest RSS seen (kB) and the slowest exec.
func watch(t *testing.T, d *testutil.Daemon, victim string, stop <-chan struct{}) (maxRSS int64, slowest time.Duration, err error) {
	for {
		if r := procStatus(t, d.Pid(), "VmRSS"); r > maxRSS {
			maxRSS = r
		}
		start := time.Now()
		res, e := d.C.Exec(ctx(t), victim, apitypes.ExecRequest{Argv: []string{"true"}, TimeoutMS: 30_000})
		if e == nil && res.ExitCode != 0 {
			e = fmt.Errorf("exit %d", res.ExitCode)
		}
		if e != nil && err == nil {
			err = e
		}
		slowest = max(slowest, time.Since(start))
		select {
		case <-stop:
			return
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func create(t *testing.T, d *testutil.Daemon, o apitypes.CreateOptions) {
	t.Helper()
	if _, err := d.C.Create(ctx(t), o); err != nil {
		t.Fatal(err)
	}
}

// TestOutputFloodBounded: output nobody asked for (a background `yes` in a bash
// session, a python thread writing 50 MB after its call returned) and a call's own 20
// MB after a lone 0x1e (the sentinel's lead byte) leave the daemon's RSS within
// rssBound, while a second sandbox keeps answering. The session answers afterwards,
// and a call's answer counts what it dropped.
func TestOutputFloodBounded(t *testing.T) {
	d := testutil.StartDaemon(t)
	create(t, d, apitypes.CreateOptions{ID: "res-flood"})
	create(t, d, apitypes.CreateOptions{ID: "res-victim"})
	if _, err := d.C.StartSession(ctx(t), "res-flood", apitypes.SessionOptions{Name: "py", Kind: apitypes.SessionPython}); err != nil {
		t.Fatal(err)
	}
	if _, err := d.C.Run(ctx(t), "res-flood", "main", "true", 30*time.Second); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second) // let the heap settle after the sessions' start
	rss0 := procStatus(t, d.Pid(), "VmRSS")

	stop := make(chan struct{})
	var wg sync.WaitGroup
	var maxRSS int64
	var slowest time.Duration
	var victimErr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		maxRSS, slowest, victimErr = watch(t, d, "res-victim", stop)
	}()
	// After the call: both floods run with no call to consume them.
	if _, err := d.C.Run(ctx(t), "res-flood", "main", "( timeout 10 yes & ) ; true", 30*time.Second); err != nil {
		t.Fatal(err)
	}
	py := "import os, threading\n" +
		"def f():\n    for _ in range(800): os.write(1, b'x' * 65536)\n" +
		"threading.Thread(target=f).start()\n"
	if _, err := d.C.Run(ctx(t), "res-flood", "py", py, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	time.Sleep(10 * time.Second)
	// During a call: a lone 0x1e, then 20 MB with no other 0x1e.
	res, err := d.C.Run(ctx(t), "res-flood", "py", `os.write(1, b'\x1e' + b'a' * (20 << 20)); print("end")`, 60*time.Second)
	close(stop)
	wg.Wait()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("daemon RSS %d kB before, %d kB at most during the floods; slowest victim exec %v", rss0, maxRSS, slowest)
	if !res.StdoutTruncated || !strings.Contains(res.Stdout, "bytes dropped here") || !strings.HasSuffix(res.Stdout, "end\n") {
		t.Errorf("the call after a lone 0x1e: truncated %v, %d bytes ending %q", res.StdoutTruncated, len(res.Stdout), res.Stdout[max(0, len(res.Stdout)-80):])
	}
	if victimErr != nil {
		t.Errorf("the victim sandbox's exec failed during the flood: %v", victimErr)
	}
	if slowest > victimBound {
		t.Errorf("the victim sandbox's exec took %v during the flood (bound %v)", slowest, victimBound)
	}
	if maxRSS-rss0 > rssBound {
		t.Errorf("the daemon's RSS grew by %d kB during the flood (bound %d kB)", maxRSS-rss0, rssBound)
	}
	if r, err := d.C.Run(ctx(t), "res-flood", "main", "echo alive", 30*time.Second); err != nil || !strings.HasSuffix(r.Stdout, "alive\n") {
		t.Errorf("the flooded bash session after the flood: %v %+v", err, r)
	}
}

// TestIdleSessionsPinNoThreads: an idle session costs the daemon no OS thread (a
// blocking read on each terminal's master held one: Go aborts at 10,000 threads).
func TestIdleSessionsPinNoThreads(t *testing.T) {
	t.Setenv("DELTABOX_MAX_SESSIONS_PER_SANDBOX", "256") // past the default caps
	t.Setenv("DELTABOX_MAX_SESSIONS", "256")
	d := testutil.StartDaemon(t)
	create(t, d, apitypes.CreateOptions{ID: "res-threads"})
	th0 := procStatus(t, d.Pid(), "Threads")
	const n = 200
	for i := range n {
		if _, err := d.C.StartSession(ctx(t), "res-threads", apitypes.SessionOptions{Name: "s" + strconv.Itoa(i), Argv: []string{"sleep", "1000"}}); err != nil {
			t.Fatalf("session %d: %v", i, err)
		}
	}
	time.Sleep(500 * time.Millisecond)
	th := procStatus(t, d.Pid(), "Threads")
	t.Logf("daemon threads: %d before, %d with %d idle sessions", th0, th, n)
	if th-th0 > 20 {
		t.Errorf("%d idle sessions took %d OS threads of the daemon", n, th-th0)
	}
	if err := d.C.Health(ctx(t)); err != nil {
		t.Fatal(err)
	}
}

// TestSessionCaps: sessions per sandbox and in total are capped; past a cap the start
// is a 409 naming the limit and what to do, and a killed session frees its place.
func TestSessionCaps(t *testing.T) {
	t.Setenv("DELTABOX_MAX_SESSIONS_PER_SANDBOX", "3")
	t.Setenv("DELTABOX_MAX_SESSIONS", "4")
	d := testutil.StartDaemon(t)
	create(t, d, apitypes.CreateOptions{ID: "res-cap-a"})
	create(t, d, apitypes.CreateOptions{ID: "res-cap-b"})
	start := func(id, name string) error {
		_, err := d.C.StartSession(ctx(t), id, apitypes.SessionOptions{Name: name, Argv: []string{"sleep", "1000"}})
		return err
	}
	for i := range 3 {
		if err := start("res-cap-a", "s"+strconv.Itoa(i)); err != nil {
			t.Fatal(err)
		}
	}
	err := start("res-cap-a", "s3")
	if !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "3 sessions") || !strings.Contains(err.Error(), "kill") {
		t.Errorf("a 4th session in a sandbox capped at 3: %v", err)
	}
	// A session started by a call (the default bash session) counts too.
	if _, err := d.C.Run(ctx(t), "res-cap-a", "main", "true", 30*time.Second); !errors.Is(err, errdefs.ErrConflict) {
		t.Errorf("the default session past the sandbox's cap: %v", err)
	}
	// Restarting a session under its own name takes no new place.
	if err := d.C.KillSession(ctx(t), "res-cap-a", "s2"); err != nil {
		t.Fatal(err)
	}
	if err := start("res-cap-a", "s2"); err != nil {
		t.Fatalf("a session started where one was killed: %v", err)
	}
	if err := start("res-cap-b", "t0"); err != nil {
		t.Fatal(err)
	}
	err = start("res-cap-b", "t1")
	if !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "4 sessions") || !strings.Contains(err.Error(), "kill") {
		t.Errorf("a 5th session in a daemon capped at 4: %v", err)
	}
	if err := d.C.KillSession(ctx(t), "res-cap-a", "s0"); err != nil {
		t.Fatal(err)
	}
	if err := start("res-cap-b", "t1"); err != nil {
		t.Errorf("a session started after another sandbox's was killed: %v", err)
	}
}

// TestForkBombContained: a fork bomb stays under its sandbox's pids limit while the
// daemon and a second sandbox keep answering, and its sandbox answers again after it.
func TestForkBombContained(t *testing.T) {
	d := testutil.StartDaemon(t)
	create(t, d, apitypes.CreateOptions{ID: "res-bomb", Pids: 128})
	create(t, d, apitypes.CreateOptions{ID: "res-victim"})
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var slowest time.Duration
	var victimErr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		_, slowest, victimErr = watch(t, d, "res-victim", stop)
	}()
	res, err := d.C.Exec(ctx(t), "res-bomb", apitypes.ExecRequest{Argv: []string{"bash", "-c", ":(){ :|:& };:; sleep 8"}, TimeoutMS: 8_000})
	close(stop)
	wg.Wait()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("bomb: exit %d timed out %v; slowest victim exec %v", res.ExitCode, res.TimedOut, slowest)
	if victimErr != nil || slowest > victimBound {
		t.Errorf("the victim sandbox during the fork bomb: %v, slowest exec %v (bound %v)", victimErr, slowest, victimBound)
	}
	if err := d.C.Health(ctx(t)); err != nil {
		t.Fatal(err)
	}
	// What the bomb left may still be dying: the sandbox answers within a bound.
	var r *apitypes.ExecResult
	for end := time.Now().Add(30 * time.Second); time.Now().Before(end); time.Sleep(500 * time.Millisecond) {
		if r, err = d.C.Exec(ctx(t), "res-bomb", apitypes.ExecRequest{Argv: []string{"echo", "ok"}, TimeoutMS: 5_000}); err == nil && strings.Contains(r.Stdout, "ok") {
			break
		}
	}
	if err != nil || !strings.Contains(r.Stdout, "ok") {
		t.Errorf("the bombed sandbox does not answer: %v %+v", err, r)
	}
}

// TestMemoryHogContained: a process allocating past the sandbox's memory_mb is killed
// by the kernel (the answer says so), while the daemon's RSS stays put and a second
// sandbox keeps answering.
func TestMemoryHogContained(t *testing.T) {
	d := testutil.StartDaemon(t)
	create(t, d, apitypes.CreateOptions{ID: "res-hog", MemoryMB: 128})
	create(t, d, apitypes.CreateOptions{ID: "res-victim"})
	rss0 := procStatus(t, d.Pid(), "VmRSS")
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var maxRSS int64
	var slowest time.Duration
	var victimErr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		maxRSS, slowest, victimErr = watch(t, d, "res-victim", stop)
	}()
	res, err := d.C.Exec(ctx(t), "res-hog", apitypes.ExecRequest{Argv: []string{"python3", "-c", "b = bytearray(512 << 20); print('allocated')"}, TimeoutMS: 60_000})
	close(stop)
	wg.Wait()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("hog: exit %d signal %d oom %q; daemon RSS %d -> %d kB; slowest victim exec %v", res.ExitCode, res.Signal, res.OOM, rss0, maxRSS, slowest)
	if strings.Contains(res.Stdout, "allocated") || res.OOM == "" {
		t.Errorf("512 MiB allocated under a 128 MiB limit: %+v", res)
	}
	if victimErr != nil || slowest > victimBound {
		t.Errorf("the victim sandbox during the memory hog: %v, slowest exec %v (bound %v)", victimErr, slowest, victimBound)
	}
	if maxRSS-rss0 > rssBound {
		t.Errorf("the daemon's RSS grew by %d kB (bound %d kB)", maxRSS-rss0, rssBound)
	}
	if r, err := d.C.Exec(ctx(t), "res-hog", apitypes.ExecRequest{Argv: []string{"echo", "ok"}}); err != nil || r.Stdout != "ok\n" {
		t.Errorf("the hog's sandbox after the kill: %v %+v", err, r)
	}
}
