package e2e

// Limits (issue 3, item 5): memory, pids and CPU limits per sandbox through the cgroup
// v1 controllers. A command over its limits fails inside its sandbox while the daemon
// and the other sandboxes keep answering. Helpers of this file are prefixed lim.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"deltabox/internal/api"
	"deltabox/internal/cgroup"
	"deltabox/internal/sandbox"
	"deltabox/internal/state"
	"deltabox/internal/store"
	"deltabox/internal/testutil"
)

// limCreate creates a sandbox with options o and checks the limits it reports.
func limCreate(t *testing.T, d *testutil.Daemon, o state.CreateOptions) *state.SandboxInfo {
	t.Helper()
	in, err := d.C.Create(dbxCtx(t), o)
	if err != nil {
		t.Fatalf("create %+v: %v", o, err)
	}
	want := cgroup.WithDefaults(cgroup.Limits{MemoryBytes: o.MemoryMB << 20, Pids: o.Pids, CPUs: o.CPUs})
	if in.Limits != want {
		t.Fatalf("sandbox %s reports limits %+v, want %+v", in.ID, in.Limits, want)
	}
	if in.Usage == nil {
		t.Fatalf("sandbox %s reports no usage: %+v", in.ID, in)
	}
	return in
}

// limDirs returns the v1 directories of sandbox id of the daemon on d.Root.
func limDirs(t *testing.T, d *testutil.Daemon, id string) map[string]string {
	t.Helper()
	cgroup.SetRootFor(d.Root, store.DefaultRoot) // sets a variable of this test process only
	dirs := cgroup.OpenV1(id).Dirs()
	for _, c := range []string{"memory", "pids", "cpu"} {
		if dirs[c] == "" {
			t.Fatalf("sandbox %s has no %s cgroup under %s/%s (have %v)", id, c, cgroup.V1Mount, c, dirs)
		}
	}
	return dirs
}

func limRead(t *testing.T, dir, file string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, file))
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

// limCheckFiles checks the controllers' files against l.
func limCheckFiles(t *testing.T, d *testutil.Daemon, id string, l cgroup.Limits) {
	t.Helper()
	dirs := limDirs(t, d, id)
	if got := limRead(t, dirs["memory"], "memory.limit_in_bytes"); got != strconv.FormatInt(l.MemoryBytes, 10) {
		t.Errorf("%s: memory.limit_in_bytes %s, want %d", id, got, l.MemoryBytes)
	}
	if _, err := os.Stat(filepath.Join(dirs["memory"], "memory.memsw.limit_in_bytes")); err == nil {
		if got := limRead(t, dirs["memory"], "memory.memsw.limit_in_bytes"); got != strconv.FormatInt(l.MemoryBytes, 10) {
			t.Errorf("%s: memory.memsw.limit_in_bytes %s, want %d (no escape into swap)", id, got, l.MemoryBytes)
		}
	}
	if got := limRead(t, dirs["pids"], "pids.max"); got != strconv.FormatInt(l.Pids, 10) {
		t.Errorf("%s: pids.max %s, want %d", id, got, l.Pids)
	}
	wantQuota := "-1"
	if l.CPUs < float64(cgroup.HostCPUs()) {
		wantQuota = strconv.Itoa(int(l.CPUs*100000 + 0.5))
	}
	if got := limRead(t, dirs["cpu"], "cpu.cfs_quota_us"); got != wantQuota {
		t.Errorf("%s: cpu.cfs_quota_us %s, want %s (cpus %g)", id, got, wantQuota, l.CPUs)
	}
}

// limCheckPlaced checks that a command of the sandbox runs inside its v1 cgroups, as
// /proc/self/cgroup shows them (no cgroup namespace: host paths).
func limCheckPlaced(t *testing.T, d *testutil.Daemon, id string) {
	t.Helper()
	// Inside, a command's cgroups are the roots of its cgroup namespace; the host's
	// view of a command (a sleep left running, found by its argument) names the groups.
	if in := dbxSh(t, d, id, "grep -c ':/$' /proc/self/cgroup"); strings.TrimSpace(in) == "0" {
		t.Errorf("%s: a command sees cgroups other than its namespace's roots", id)
	}
	// An argument of this call's own: another sandbox's check may have its sleep running.
	arg := fmt.Sprintf("3.%d", time.Now().UnixNano()%1_000_000_000)
	dbxSh(t, d, id, "sleep "+arg+" >/dev/null 2>&1 </dev/null &")
	out := ""
	for try := 0; out == "" && try < 50; try++ {
		ents, _ := os.ReadDir("/proc")
		for _, e := range ents {
			if b, err := os.ReadFile("/proc/" + e.Name() + "/cmdline"); err == nil && string(b) == "sleep\x00"+arg+"\x00" {
				c, _ := os.ReadFile("/proc/" + e.Name() + "/cgroup")
				out = string(c)
				// Gone before the caller counts the sandbox's processes.
				if pid, err := strconv.Atoi(e.Name()); err == nil {
					syscall.Kill(pid, syscall.SIGKILL)
					for i := 0; i < 100 && syscall.Kill(pid, 0) == nil; i++ {
						time.Sleep(10 * time.Millisecond)
					}
				}
			}
		}
		if out == "" {
			time.Sleep(20 * time.Millisecond)
		}
	}
	cgroup.SetRootFor(d.Root, store.DefaultRoot)
	want := "/" + filepath.Base(cgroup.Root) + "/" + id
	for _, c := range []string{"memory", "pids", "cpu", "cpuacct"} {
		found := false
		for _, l := range strings.Split(out, "\n") {
			f := strings.SplitN(l, ":", 3)
			if len(f) == 3 && f[1] == c {
				found = true
				if f[2] != want {
					t.Errorf("%s: a command's %s cgroup is %q, want %q\n%s", id, c, f[2], want, out)
				}
			}
		}
		if !found {
			t.Errorf("%s: no %s line in /proc/self/cgroup:\n%s", id, c, out)
		}
	}
}

// limProbe runs echo ok in id and returns how long the call took.
func limProbe(ctx context.Context, d *testutil.Daemon, id string) (time.Duration, error) {
	start := time.Now()
	r, err := d.C.Exec(ctx, id, api.ExecRequest{Argv: []string{"echo", "ok"}, TimeoutMS: 10_000})
	lat := time.Since(start)
	if err != nil {
		return lat, err
	}
	if r.ExitCode != 0 || r.Stdout != "ok\n" {
		return lat, fmt.Errorf("echo ok in %s: exit %d stdout %q stderr %q", id, r.ExitCode, r.Stdout, r.Stderr)
	}
	if err := d.C.Health(ctx); err != nil {
		return lat, fmt.Errorf("health: %w", err)
	}
	return time.Since(start), nil
}

// limWhile runs r in id in the background and probes peer until it ends; it returns
// the result and the probes' latencies, and fails if a probe fails or takes over 1s.
func limWhile(t *testing.T, d *testutil.Daemon, id string, r api.ExecRequest, peer string) (*sandbox.ExecResult, []time.Duration) {
	t.Helper()
	ctx := dbxCtx(t)
	type result struct {
		r   *sandbox.ExecResult
		err error
	}
	done := make(chan result, 1)
	go func() {
		res, err := d.C.Exec(ctx, id, r)
		done <- result{res, err}
	}()
	var lats []time.Duration
	for {
		select {
		case res := <-done:
			if res.err != nil {
				t.Fatalf("exec %q in %s: %v", r.Argv, id, res.err)
			}
			return res.r, lats
		default:
		}
		lat, err := limProbe(ctx, d, peer)
		if err != nil {
			t.Fatalf("while %s runs %q: %v", id, r.Argv, err)
		}
		if lat > time.Second {
			t.Errorf("while %s runs %q: echo ok in %s took %v, want < 1s", id, r.Argv, peer, lat)
		}
		lats = append(lats, lat)
		time.Sleep(20 * time.Millisecond)
	}
}

func limMax(l []time.Duration) time.Duration {
	var m time.Duration
	for _, x := range l {
		m = max(m, x)
	}
	return m
}

// TestLimitsMemoryHog: a command that allocates past its sandbox's memory limit is
// OOM-killed inside the sandbox; the other sandbox's execs keep answering meanwhile,
// and the limited sandbox works afterwards.
func TestLimitsMemoryHog(t *testing.T) {
	d := testutil.StartDaemon(t)
	hog := limCreate(t, d, state.CreateOptions{ID: "hog", MemoryMB: 256})
	peer := limCreate(t, d, state.CreateOptions{ID: "peer"})
	limCheckFiles(t, d, hog.ID, hog.Limits)
	limCheckFiles(t, d, peer.ID, peer.Limits)
	limCheckPlaced(t, d, hog.ID)

	// 8 MiB written at a time, up to 1 GiB: the limit is reached after ~0.3 s.
	script := "import time\nchunks = []\nfor i in range(128):\n    chunks.append(b'x' * (8 << 20))\n    time.sleep(0.01)\nprint('allocated', len(chunks) * 8, 'MiB')\n"
	start := time.Now()
	res, lats := limWhile(t, d, hog.ID, api.ExecRequest{Argv: []string{"python3", "-c", script}, TimeoutMS: 60_000}, peer.ID)
	t.Logf("hog: exit %d signal %d after %v; %d probes of the other sandbox meanwhile, slowest %v",
		res.ExitCode, res.Signal, time.Since(start), len(lats), limMax(lats))
	killed := res.ExitCode == -1 && res.Signal == 9
	if !killed && !strings.Contains(res.Stderr, "MemoryError") {
		t.Fatalf("the hog was not stopped by its 256 MiB limit: exit %d signal %d\nstdout: %s\nstderr: %s",
			res.ExitCode, res.Signal, res.Stdout, res.Stderr)
	}
	if len(lats) == 0 {
		t.Fatalf("the hog ended before the other sandbox could be probed")
	}
	in, err := d.C.Get(dbxCtx(t), hog.ID)
	if err != nil {
		t.Fatal(err)
	}
	u := in.Usage
	t.Logf("hog usage: %+v", *u)
	if u.MemoryPeakBytes > 256<<20 || u.MemoryPeakBytes < 200<<20 {
		t.Errorf("usage %+v: want a peak in (200 MiB, 256 MiB]", *u)
	}
	if killed && u.OOMKills == 0 {
		t.Errorf("usage %+v: the hog was killed but oom_kills is 0", *u)
	}
	if in.Status != "running" || in.InitPid != hog.InitPid {
		t.Fatalf("the hog's sandbox: status %s init %d, want running with init %d", in.Status, in.InitPid, hog.InitPid)
	}
	// The sandbox goes on, and its shell survives an OOM kill of its child.
	out := dbxSh(t, d, hog.ID, "python3 -c \"b = b'x' * (512 << 20)\"; echo rc=$?; echo ok")
	if out != "rc=137\nok\n" {
		t.Fatalf("shell around a hog: %q, want rc=137 (SIGKILL) then ok", out)
	}
	if got := dbxSh(t, d, hog.ID, "python3 -c \"b = b'x' * (64 << 20); print(len(b) >> 20)\""); got != "64\n" {
		t.Fatalf("64 MiB under a 256 MiB limit: %q", got)
	}
}

// TestLimitsForkBomb: a fork bomb stops at its sandbox's pids limit; the other
// sandbox answers meanwhile; the exec timeout ends the bomb and the sandbox works on.
func TestLimitsForkBomb(t *testing.T) {
	d := testutil.StartDaemon(t)
	bomb := limCreate(t, d, state.CreateOptions{ID: "bomb", Pids: 64})
	peer := limCreate(t, d, state.CreateOptions{ID: "peer"})
	limCheckFiles(t, d, bomb.ID, bomb.Limits)
	dirs := limDirs(t, d, bomb.ID)

	start := time.Now()
	res, lats := limWhile(t, d, bomb.ID, api.ExecRequest{
		Argv:      []string{"bash", "-c", ":(){ :|:& };:; sleep 60"},
		TimeoutMS: 4000,
	}, peer.ID)
	t.Logf("bomb: exit %d signal %d timed out %v after %v; %d probes of the other sandbox meanwhile, slowest %v",
		res.ExitCode, res.Signal, res.TimedOut, time.Since(start), len(lats), limMax(lats))
	if !res.TimedOut {
		t.Fatalf("the bomb's exec did not time out: %+v", res)
	}
	if len(lats) < 5 {
		t.Errorf("only %d probes of the other sandbox during 4s of fork bomb", len(lats))
	}
	in, err := d.C.Get(dbxCtx(t), bomb.ID)
	if err != nil {
		t.Fatal(err)
	}
	u := in.Usage
	t.Logf("bomb usage: %+v; stderr: %s", *u, dbxTail(res.Stderr, 300))
	if u.PidsLimitHits == 0 || u.PidsPeak > 64 || u.PidsPeak < 60 {
		t.Errorf("usage %+v: want forks refused (pids_limit_hits > 0) and a peak of ~64 (<= 64)", *u)
	}
	if events := limRead(t, dirs["pids"], "pids.events"); events == "max 0" {
		t.Errorf("pids.events %q: the limit was never hit", events)
	}
	// Everything the bomb started is gone once the timeout has killed its group.
	deadline := time.Now().Add(10 * time.Second)
	for limRead(t, dirs["pids"], "pids.current") != "0" {
		if time.Now().After(deadline) {
			t.Fatalf("10s after the timeout, pids.current of %s is %s, want 0 (tasks: %s)",
				bomb.ID, limRead(t, dirs["pids"], "pids.current"), limRead(t, dirs["pids"], "tasks"))
		}
		time.Sleep(20 * time.Millisecond)
	}
	if in.Status != "running" || in.InitPid != bomb.InitPid {
		t.Fatalf("the bomb's sandbox: status %s init %d, want running with init %d (init must survive)", in.Status, in.InitPid, bomb.InitPid)
	}
	if got := dbxSh(t, d, bomb.ID, "echo ok"); got != "ok\n" {
		t.Fatalf("after the bomb: %q", got)
	}
	// 40 processes at once fit under 64.
	if got := dbxSh(t, d, bomb.ID, "for i in $(seq 40); do sleep 1 & done; wait; echo done"); got != "done\n" {
		t.Fatalf("40 sleeps: %q", got)
	}
}

// limBurnScript busy-loops until it has had CPUSEC seconds of CPU time (or 30 s of wall
// time went by: a starved machine) and prints its CPU time and wall time. CPU time, not
// wall time: how much a loop gets depends on what else the machine runs, and a loop
// that got little is measured over a longer time instead of a shorter sample.
const limBurnScript = "import time\nw0 = time.monotonic(); c0 = time.process_time()\n" +
	"while time.process_time() - c0 < CPUSEC and time.monotonic() - w0 < 30: pass\n" +
	"print(time.process_time() - c0, time.monotonic() - w0)\n"

func limBurnCode(cpu float64) string {
	return strings.Replace(limBurnScript, "CPUSEC", strconv.FormatFloat(cpu, 'f', 3, 64), 1)
}

// limRatios sums the CPU times of out's lines ("cpu wall" each) and divides by the
// longest wall time.
func limRatios(t *testing.T, where, out string, n int) float64 {
	t.Helper()
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != n {
		t.Fatalf("busy loops in %s printed %q, want %d lines", where, out, n)
	}
	var sum, wall float64
	for _, l := range lines {
		var c, w float64
		if _, err := fmt.Sscan(l, &c, &w); err != nil || c <= 0 || w <= 0 {
			t.Fatalf("busy loop in %s printed %q", where, l)
		}
		sum += c
		wall = max(wall, w)
	}
	return sum / wall
}

// limBurn runs n busy loops at once in sandbox id, cpu seconds of CPU time in all, and
// returns the CPU time they had per wall second.
func limBurn(t *testing.T, d *testutil.Daemon, id string, n int, cpu float64) float64 {
	t.Helper()
	script := fmt.Sprintf("for i in $(seq %d); do python3 -c '%s' & done; wait", n, limBurnCode(cpu/float64(n)))
	return limRatios(t, id, dbxSh(t, d, id, script), n)
}

// limBurnBeside runs limBurn in id and, at the same time, a host loop for the same CPU
// time: the two ratios are of the same moments of a machine whose load changes.
func limBurnBeside(t *testing.T, d *testutil.Daemon, id string, n int, cpu float64) (sandbox, host float64) {
	t.Helper()
	done := make(chan float64, 1)
	go func() {
		out, err := testutil.Command(t, time.Minute, "python3", "-c", limBurnCode(cpu)).Output()
		if err != nil {
			t.Errorf("busy loop on the host: %v", err)
			done <- 0
			return
		}
		done <- limRatios(t, "the host", string(out), 1)
	}()
	sandbox = limBurn(t, d, id, n, cpu)
	return sandbox, <-done
}

// TestLimitsCPU: cpus 0.1 gets about a tenth of a CPU, and is throttled; a sandbox with
// the default is not throttled. Each measure is of CPU time (a fixed amount, over
// however long it takes) against a host process's over the same moments, so that the
// rest of a test suite running beside it changes how long it takes, not what it
// asserts. A quota shows only when the sandbox could get more than it: on this 2-CPU
// machine kind, loaded by parallel test runs, 4 busy loops of one sandbox got 0.31 CPU
// in all (a host process beside them 0.29), under a quota of 0.5 that was never reached;
// 0.1 is under what such a machine leaves.
func TestLimitsCPU(t *testing.T) {
	d := testutil.StartDaemon(t)
	const quota = 0.1
	slow := limCreate(t, d, state.CreateOptions{ID: "slow", CPUs: quota})
	fast := limCreate(t, d, state.CreateOptions{ID: "fast"})
	limCheckFiles(t, d, slow.ID, slow.Limits)
	limCheckFiles(t, d, fast.ID, fast.Limits)
	limCheckPlaced(t, d, slow.ID)

	// More loops than CPUs: the sandbox asks for every CPU, far over its quota, so it
	// reaches the quota also when other work takes a share of each CPU.
	n := 2 * cgroup.HostCPUs()
	r, ref := limBurnBeside(t, d, slow.ID, n, 3*quota)
	t.Logf("cpus %g: %d loops had %.3f CPU per wall second (a host process beside them: %.2f)", quota, n, r, ref)
	if r > 1.5*quota {
		t.Errorf("cpus %g: %d busy loops got %.3f CPU per wall second, want about %g (< %g)", quota, n, r, quota, 1.5*quota)
	}
	if r < 0.5*quota && ref >= 2*quota {
		t.Errorf("cpus %g: %d busy loops got %.3f CPU per wall second, want about %g (> %g; a host process beside them got %.2f)", quota, n, r, quota, 0.5*quota, ref)
	}
	in, err := d.C.Get(dbxCtx(t), slow.ID)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("slow usage: %+v", *in.Usage)
	// How long the throttling lasted depends on how much CPU the rest of the machine
	// leaves: that it happened is the point.
	if in.Usage.CPUThrottled < 3 || in.Usage.CPUThrottledNS <= 0 || in.Usage.CPUNanos < int64(0.9*3*quota*1e9) {
		t.Errorf("usage %+v: want >= 3 throttled periods and >= %.2f s of CPU", *in.Usage, 0.9*3*quota)
	}

	// Unthrottled gets a whole CPU, unless the machine is so busy that a host process
	// beside it does not either (other tests, builds): then it must get about what the
	// host process gets, and the throttling counters (0 periods here, many above) tell.
	var rf float64
	for i := 0; i < 4; i++ {
		if rf, ref = limBurnBeside(t, d, fast.ID, 1, 1.0); rf > 0.9 {
			break
		}
		if ref <= 0.9 && rf >= 0.8*ref {
			t.Logf("the host is busy: a host process got %.2f, the sandbox %.2f", ref, rf)
			break
		}
	}
	t.Logf("default cpus (%g): %.2f of wall time on CPU (a host process beside it: %.2f)", fast.Limits.CPUs, rf, ref)
	if rf <= 0.9 && !(ref <= 0.9 && rf >= 0.8*ref) {
		t.Errorf("default cpus: a busy loop got %.2f CPU per wall second, want > 0.9 (not throttled; a host process beside it got %.2f)", rf, ref)
	}
	in, err = d.C.Get(dbxCtx(t), fast.ID)
	if err != nil {
		t.Fatal(err)
	}
	if in.Usage.CPUThrottled != 0 {
		t.Errorf("default cpus: %d throttled periods, want 0", in.Usage.CPUThrottled)
	}
}

// TestLimitsSurviveRestart: limits are part of the sandbox's record, applied again when
// a daemon restarts it, after a graceful stop and after a crash; stale v1 directories
// are swept; the v1 directories go with their sandbox and the daemon.
func TestLimitsSurviveRestart(t *testing.T) {
	d := testutil.StartDaemon(t)
	lim := limCreate(t, d, state.CreateOptions{ID: "lim", MemoryMB: 300, Pids: 100, CPUs: 0.75})
	def := limCreate(t, d, state.CreateOptions{ID: "def"})
	gone := limCreate(t, d, state.CreateOptions{ID: "gone", Pids: 50})
	goneDirs := limDirs(t, d, gone.ID)
	if err := d.C.Remove(dbxCtx(t), gone.ID); err != nil {
		t.Fatal(err)
	}
	for c, dir := range goneDirs {
		if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("rm: the %s cgroup %s is still there (%v)", c, dir, err)
		}
	}
	check := func(when string) {
		t.Helper()
		for _, want := range []*state.SandboxInfo{lim, def} {
			in, err := d.C.Get(dbxCtx(t), want.ID)
			if err != nil {
				t.Fatalf("%s: %v", when, err)
			}
			if in.Status != "running" || in.Limits != want.Limits {
				t.Fatalf("%s: %s is %s with limits %+v, want running with %+v (%s)", when, want.ID, in.Status, in.Limits, want.Limits, in.Error)
			}
			limCheckFiles(t, d, want.ID, want.Limits)
			limCheckPlaced(t, d, want.ID)
		}
	}
	check("created")

	d.Stop()
	d = testutil.StartDaemonOn(t, d.Root)
	check("after a graceful restart")

	// A crash leaves the v1 directories (with a process in one) and a stray one; the
	// next start adopts the sandbox with its directories and its process, and sweeps the
	// stray one.
	dbxSh(t, d, lim.ID, "sleep 1000 >/dev/null 2>&1 & echo started")
	dirs := limDirs(t, d, lim.ID)
	stray := filepath.Join(filepath.Dir(dirs["pids"]), "stray")
	d.Kill()
	if err := os.Mkdir(stray, 0o755); err != nil {
		t.Fatal(err)
	}
	d = testutil.StartDaemonOn(t, d.Root)
	if _, err := os.Stat(stray); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the stray cgroup %s survived the startup sweep (%v)", stray, err)
	}
	check("after a crash")
	if got := limRead(t, limDirs(t, d, lim.ID)["pids"], "pids.current"); got != "1" {
		t.Errorf("after the crash: pids.current %s, want 1 (the sleep, adopted with its sandbox)", got)
	}

	// A graceful stop of a daemon that stops its sandboxes leaves no v1 directory behind,
	// not even the store's parents.
	d.Stop()
	d = testutil.StartDaemonEnv(t, d.Root, "DELTABOX_STOP_SANDBOXES=1")
	check("after a restart that stops them")
	d.Stop()
	cgroup.SetRootFor(d.Root, store.DefaultRoot)
	for _, c := range []string{"memory", "pids", "cpu", "cpuacct"} {
		p := filepath.Join(cgroup.V1Mount, c, filepath.Base(cgroup.Root))
		if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
			ents, _ := os.ReadDir(p)
			t.Errorf("after the daemon stopped, %s is still there (%v, %d entries)", p, err, len(ents))
		}
	}
}

// TestLimitsDefaultsAndValidation: the documented defaults, the CLI flags, and a 400
// naming the field for every bad value (with nothing left behind).
func TestLimitsDefaultsAndValidation(t *testing.T) {
	d := testutil.StartDaemon(t)
	def := limCreate(t, d, state.CreateOptions{ID: "def"})
	want := cgroup.Limits{MemoryBytes: min(4<<30, cgroup.HostMemoryBytes()/2), Pids: 1024, CPUs: float64(cgroup.HostCPUs())}
	if def.Limits != want {
		t.Errorf("default limits %+v, want %+v", def.Limits, want)
	}
	limCheckFiles(t, d, def.ID, want)

	for _, c := range []struct{ body, mention string }{
		{`{"memory_mb": -1}`, "memory"},
		{`{"memory_mb": 1}`, "memory"},
		{`{"memory_mb": 1099511627776}`, "memory"},
		{`{"memory_mb": 9000000000000000000}`, "memory"},
		{`{"pids": -5}`, "pids"},
		{`{"pids": 3}`, "pids"},
		{`{"pids": 100000000}`, "pids"},
		{`{"cpus": -1}`, "cpus"},
		{`{"cpus": 0.001}`, "cpus"},
		{`{"cpus": 1000}`, "cpus"},
		{`{"memory_mb": "2G"}`, "memory_mb"},
		{`{"cpus": 1e999}`, "cpus"},
		{`{"memory": 512}`, "memory"},
	} {
		status, body := dbxRaw(t, d, "POST", "/sandboxes", c.body)
		if status != 400 {
			t.Errorf("create %s: status %d, want 400: %s", c.body, status, body)
			continue
		}
		_, msg := dbxErrorBody(t, body)
		if !strings.Contains(msg, c.mention) {
			t.Errorf("create %s: message %q does not mention %q", c.body, msg, c.mention)
		}
	}
	l, err := d.C.List(dbxCtx(t))
	if err != nil || len(l) != 1 {
		t.Fatalf("after refused creates: %d sandboxes (%v), want 1", len(l), err)
	}
	if ids := cgroup.ListV1(); len(ids) != 1 || ids[0] != def.ID {
		t.Errorf("after refused creates, v1 cgroups %v, want only %s", ids, def.ID)
	}

	// The CLI: deltabox create --memory 2G --pids 512 --cpus 1.5
	cpus := 1.5
	if float64(cgroup.HostCPUs()) < cpus {
		cpus = 0.5
	}
	out, err := testutil.Command(t, time.Minute, testutil.Binary(t), "--socket", d.Socket, "--json", "create", "--name", "cli",
		"--memory", "2G", "--pids", "512", "--cpus", strconv.FormatFloat(cpus, 'g', -1, 64)).CombinedOutput()
	if err != nil {
		t.Fatalf("deltabox create: %v\n%s", err, out)
	}
	var in state.SandboxInfo
	if err := json.Unmarshal(out, &in); err != nil {
		t.Fatalf("deltabox create --json: %v\n%s", err, out)
	}
	if wantCLI := (cgroup.Limits{MemoryBytes: 2 << 30, Pids: 512, CPUs: cpus}); in.Limits != wantCLI {
		t.Fatalf("deltabox create --memory 2G --pids 512 --cpus %g: limits %+v, want %+v", cpus, in.Limits, wantCLI)
	}
	limCheckFiles(t, d, "cli", in.Limits)
	out, err = testutil.Command(t, time.Minute, testutil.Binary(t), "--socket", d.Socket, "create", "--pids", "-1").CombinedOutput()
	if err == nil || !strings.Contains(string(out), "pids") {
		t.Fatalf("deltabox create --pids -1: err %v, output %q; want a failure naming pids", err, out)
	}
}
