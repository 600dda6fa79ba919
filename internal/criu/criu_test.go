package criu

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"deltabox/internal/deadline"
	"deltabox/internal/testutil/skip"
)

// realCRIU returns the CRIU that scripts/setup.sh builds, or skips (fails with CI=true).
func realCRIU(t *testing.T) string {
	t.Helper()
	skip.Require(t, os.Geteuid() == 0, "CRIU dumps need root")
	bin, err := Find()
	skip.Require(t, err == nil, "no CRIU: %v", err)
	return bin
}

// fakeCRIU writes an executable shell script standing in for criu and returns its path.
func fakeCRIU(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "criu")
	if err := os.WriteFile(p, []byte("#!/bin/sh\n"+body), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { // the answer Probe kept for it, if any
		if _, kept, ok := probeKey(p); ok {
			os.Remove(kept)
		}
	})
	return p
}

// startSleep starts a process CRIU can dump (own session, stdio on /dev/null).
func startSleep(t *testing.T) int {
	t.Helper()
	cmd := exec.Command("sleep", "1000")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	return cmd.Process.Pid
}

// dumpWorks checks that r dumps a sleep, which goes on running.
func dumpWorks(t *testing.T, r *Runner) {
	t.Helper()
	pid := startSleep(t)
	dir := t.TempDir()
	c := r.Dump(pid, dir, true)
	start := time.Now()
	if err := c.Run(context.Background()); err != nil {
		t.Fatalf("dump through the package (%s mode): %v", r.Mode, err)
	}
	t.Logf("%s took %v", strings.Join(c.Line(), " "), time.Since(start))
	if _, err := os.Stat(filepath.Join(dir, "inventory.img")); err != nil {
		t.Fatalf("no images: %v", err)
	}
	// Left running, the sleep goes back to its sleep: it may be seen running (R) for a
	// moment after CRIU lets it go, never stopped or gone.
	st := procState(pid)
	for deadline := time.Now().Add(2 * time.Second); st == "R" && time.Now().Before(deadline); st = procState(pid) {
		time.Sleep(5 * time.Millisecond)
	}
	if st != "S" {
		t.Fatalf("the dumped sleep is in state %q, want S (--leave-running)", st)
	}
}

// TestProbeThisMachine runs the real self-test: CRIU must be usable here one way or
// the other, and a dump through the package must then work.
func TestProbeThisMachine(t *testing.T) {
	bin := realCRIU(t)
	r := Probe(context.Background(), bin)
	t.Logf("CRIU on this machine: %s", r)
	if !r.Usable() {
		t.Fatalf("CRIU is unusable here: %s", r)
	}
	if max := 2*ProbeTimeout + 5*time.Second; r.ProbeS > max.Seconds() {
		t.Errorf("the self-test took %.1f s, more than its deadlines allow (%v)", r.ProbeS, max)
	}
	if again := Probe(context.Background(), bin); again != r {
		t.Errorf("a second Probe ran the self-test again")
	}
	dumpWorks(t, r)
}

// TestProbeWithoutBreakpoints simulates a machine that never delivers hardware
// breakpoints: a criu whose dump hangs unless CRIU_FAULT=130 is set. The probe must
// pick the no-breakpoints mode within its deadlines, and dumps must then work.
func TestProbeWithoutBreakpoints(t *testing.T) {
	real := realCRIU(t)
	fake := fakeCRIU(t, fmt.Sprintf(`if [ "$1" = dump ] && [ "$CRIU_FAULT" != 130 ]; then exec sleep 1000; fi
exec %s "$@"
`, real))
	start := time.Now()
	r := Probe(context.Background(), fake)
	took := time.Since(start)
	t.Logf("probe of a criu without breakpoints: %s (%v)", r, took)
	if r.Mode != NoBreakpoints {
		t.Fatalf("mode %s, want %s: %s", r.Mode, NoBreakpoints, r)
	}
	if !strings.Contains(r.Reason, "did not finish within "+ProbeTimeout.String()) {
		t.Errorf("the reason does not say the plain dump hung: %s", r.Reason)
	}
	if took > ProbeTimeout+5*time.Second {
		t.Errorf("the probe took %v: the hanging plain dump was not cut at %v", took, ProbeTimeout)
	}
	if env := r.Env(); len(env) != 1 || env[0] != NoBreakpointsEnv {
		t.Errorf("env %v, want [%s]", env, NoBreakpointsEnv)
	}
	dumpWorks(t, r)
}

// TestProbeKeptForTheBoot: a usable answer is kept in KdatDir for the next process of
// this boot (the in-process map cleared stands for a new daemon): it comes back without
// a self-test, marked cached. A changed binary is probed again; an unusable answer is not
// kept.
func TestProbeKeptForTheBoot(t *testing.T) {
	real := realCRIU(t)
	fake := fakeCRIU(t, fmt.Sprintf("exec %s \"$@\"\n", real))
	forget := func() {
		probeMu.Lock()
		clear(probed)
		probeMu.Unlock()
	}
	t.Cleanup(forget)
	forget()
	first := Probe(context.Background(), fake)
	if !first.Usable() || first.Cached {
		t.Fatalf("first probe: %s (cached %v)", first, first.Cached)
	}
	forget()
	start := time.Now()
	again := Probe(context.Background(), fake)
	if !again.Cached || again.Mode != first.Mode || again.ProbeS != first.ProbeS {
		t.Fatalf("second probe in a new process of this boot: %s (cached %v), want the first's answer kept", again, again.Cached)
	}
	if took := time.Since(start); took > time.Second {
		t.Errorf("a kept answer took %v", took)
	}
	// The binary changes (setup.sh rebuilt it): probed again.
	later := time.Now().Add(time.Minute)
	if err := os.Chtimes(fake, later, later); err != nil {
		t.Fatal(err)
	}
	forget()
	if r := Probe(context.Background(), fake); r.Cached || !r.Usable() {
		t.Fatalf("probe of a changed binary: %s (cached %v), want a new self-test", r, r.Cached)
	}
	// An unusable binary is not kept.
	bad := fakeCRIU(t, "exit 1\n")
	Probe(context.Background(), bad)
	forget()
	if r := Probe(context.Background(), bad); r.Cached || r.Usable() {
		t.Fatalf("a second probe of an unusable criu: %s (cached %v)", r, r.Cached)
	}
}

// TestProbeUnusable: a criu that hangs either way is reported unusable, with both
// reasons, within the two deadlines.
func TestProbeUnusable(t *testing.T) {
	realCRIU(t)
	fake := fakeCRIU(t, "exec sleep 1000\n")
	start := time.Now()
	r := Probe(context.Background(), fake)
	took := time.Since(start)
	if r.Mode != Unusable || r.Usable() || !strings.Contains(r.Reason, "with "+NoBreakpointsEnv) {
		t.Fatalf("probe of a hanging criu: %s", r)
	}
	if took > 2*ProbeTimeout+5*time.Second {
		t.Errorf("the probe took %v", took)
	}
}

// TestHangingCRIUIsKilled: a criu that forks a child and never exits returns the named
// error soon after its deadline, quotes its log, and leaves no process behind.
func TestHangingCRIUIsKilled(t *testing.T) {
	skip.Require(t, os.Geteuid() == 0, "runs as root like the rest")
	pids := filepath.Join(t.TempDir(), "pids")
	// Writes a log like a breakpoint-less machine's, then waits on a child for ever.
	fake := fakeCRIU(t, fmt.Sprintf(`while [ $# -gt 0 ]; do [ "$1" = -D ] && dir=$2; shift; done
echo "Error (criu/util.c:1533): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted" > "$dir/dump.log"
sleep 1000 &
echo $$ $! > %s
wait
`, pids))
	r := &Runner{Bin: fake, Mode: Plain}
	c := r.Dump(4242, t.TempDir(), true)
	c.Timeout = 300 * time.Millisecond
	start := time.Now()
	err := c.Run(context.Background())
	took := time.Since(start)
	t.Logf("error after %v: %v", took, err)
	var te *deadline.TimeoutError
	if !errors.As(err, &te) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("error %v, want a timeout", err)
	}
	for _, want := range []string{"criu dump of pid 4242 did not finish within 300ms", "Can't setup RLIMIT_NOFILE", NoBreakpointsEnv} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the error lacks %q", want)
		}
	}
	if took > 3*time.Second {
		t.Errorf("Run returned %v after a 300ms deadline", took)
	}
	b, rerr := os.ReadFile(pids)
	f := strings.Fields(string(b))
	if rerr != nil || len(f) != 2 {
		t.Fatalf("the fake criu did not record its pids: %q %v", b, rerr)
	}
	pgid, _ := strconv.Atoi(f[0])
	child, _ := strconv.Atoi(f[1])
	// The shell was reaped by Run; its child, reparented to init when the shell died,
	// must be dead too (a zombie until init, which reaps about once a second here,
	// collects it).
	if st := procState(pgid); st != "" {
		t.Errorf("the fake criu (pid %d) is still there, state %q", pgid, st)
	}
	for deadline := time.Now().Add(2 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if st := procState(child); st == "" || st == "Z" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the fake criu's child %d outlived it: state %q", child, procState(child))
		}
	}
}
