package e2e

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"deltabox/internal/bench"
	"deltabox/internal/testutil"
)

// TestBenchRLTiny runs `deltabox bench rl` with two branches and one timed step in both
// trainer modes (serial, and overlap: resets during the next policy): every system has
// a row per mode with a GPU busy fraction in (0, 1], every reset brought back the step's
// start state (the untimed checks), the action's own python CPU and wall time are
// reported apart from the call's (and the daemon's CPU for deltabox's rows), and the
// bench removed what it made, podman's containers too. podman's row runs where podman is installed
// (scripts/setup.sh installs it; CI must have it).
func TestBenchRLTiny(t *testing.T) {
	systems := []string{bench.SysRLDeltaBox, bench.SysRLSpares, bench.SysRLFork, bench.SysRLCRIU, bench.SysRLCopytree, bench.SysRLPodman}
	podman, _ := exec.LookPath("podman")
	if podman == "" {
		if os.Getenv("CI") == "true" {
			t.Fatal("podman is not installed: scripts/setup.sh installs it for the benches' baselines")
		}
		systems = systems[:len(systems)-1]
	}
	// Where podman's checkpoint cannot work (a machine without hardware breakpoints),
	// its rows must say why.
	podmanWhy := bench.PodmanUnavailable()
	d := testutil.StartDaemon(t)
	out := filepath.Join(t.TempDir(), "rl.json")
	cmd := testutil.Command(t, 5*time.Minute, testutil.Binary(t), "--socket", d.Socket, "bench", "rl", "--branches", "2", "--steps", "1",
		"--heap-mb", "8", "--workspace-mb", "2", "--policy-ms", "50", "--modes", "serial,overlap", "--systems", strings.Join(systems, ","), "--json", out)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if b, err := cmd.Output(); err != nil {
		t.Fatalf("bench rl: %v\n%s\n%s", err, b, stderr.String())
	}
	f, err := bench.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, r := range f.Results {
		mode, _ := r.Info["mode"].(string)
		seen[r.System+" "+r.Op] = true
		if r.Info["unavailable"] != nil {
			if r.System != bench.SysRLPodman || podmanWhy == "" || !strings.Contains(r.Unavailable(), podmanWhy) {
				t.Errorf("%s: unavailable: %v", r.System, r.Info["unavailable"])
			}
			continue
		}
		if r.System == bench.SysRLPodman && podmanWhy != "" {
			t.Errorf("%s %s ran, but podman's checkpoint cannot work here: %s", r.System, r.Op, podmanWhy)
		}
		busy, _ := r.Info["gpu_busy_frac"].(float64)
		if (r.Op != "rl-2" || mode != "serial") && (r.Op != "rl-2-overlap" || mode != "overlap") || r.N != 1 || r.P50 < 50 || busy <= 0 || busy > 1 {
			t.Errorf("row %s %s (%s): n %d, step p50 %v ms, busy %v", r.System, r.Op, mode, r.N, r.P50, busy)
		}
		if n, _ := r.Info["state_checks"].(float64); n < 2 {
			t.Errorf("%s %s: %v state checks, want one a step or one a branch", r.System, r.Op, n)
		}
		if n, _ := r.Info["state_checks_failed"].(float64); n != 0 {
			t.Errorf("%s %s: %v resets did not bring back the step's start state", r.System, r.Op, n)
		}
		// The action's python measured its own CPU and wall time; the call's way in and
		// out is the rest of the caller's time.
		cpu, _ := r.Info["action_py_cpu_ms_p50"].(float64)
		py, _ := r.Info["action_py_ms_p50"].(float64)
		act, _ := r.Info["action_ms_p50"].(float64)
		call, ok := r.Info["action_call_ms_p50"].(float64)
		if cpu <= 0 || py <= 0 || py > act || !ok || call < 0 {
			t.Errorf("%s %s: action p50 %v ms, its python's CPU %v ms and wall %v ms, the call %v ms", r.System, r.Op, act, cpu, py, call)
		}
		if bound, _ := r.Info["gpu_busy_bound_frac"].(float64); bound <= 0 || bound > 1 {
			t.Errorf("%s %s: GPU busy bound %v", r.System, r.Op, r.Info["gpu_busy_bound_frac"])
		}
		// /proc counts the daemon's CPU in 10 ms ticks: a tiny run's steps may take less
		// than one (0 on a faster machine, s38's CI); never below 0.
		if d, ok := r.Info["daemon_cpu_ms_per_step"].(float64); !ok || d < 0 {
			t.Errorf("%s %s: daemon CPU per step %v", r.System, r.Op, r.Info["daemon_cpu_ms_per_step"])
		}
		if _, ok := r.Info["reset_wait_ms_p50"]; mode == "overlap" && r.System != bench.SysRLFork && !ok {
			t.Errorf("%s %s: no reset_wait_ms_p50", r.System, r.Op)
		}
		// 2 steps (1 untimed) of 2 branches: 4 resets; each branch held a spare before
		// the first (deltabox-spares), and plain sandboxes never hold one.
		spares, _ := r.Info["resets_from_spare"].(float64)
		switch {
		case r.System == bench.SysRLSpares && (r.Info["resets"] != float64(4) || spares < 2):
			t.Errorf("%s %s: resets %v, from a spare %v: want 4, at least the first 2", r.System, r.Op, r.Info["resets"], spares)
		case r.System == bench.SysRLDeltaBox && (r.Info["resets"] != float64(4) || spares != 0):
			t.Errorf("%s %s: resets %v, from a spare %v: want 4 and none", r.System, r.Op, r.Info["resets"], spares)
		}
	}
	for _, s := range systems {
		for _, op := range []string{"rl-2", "rl-2-overlap"} {
			if !seen[s+" "+op] {
				t.Errorf("no row %s %s", s, op)
			}
		}
	}
	benchLeftovers(t, d, "rl")
	if podman != "" && podmanWhy == "" {
		podmanLeftovers(t, podman, f)
	}
}

// podmanLeftovers fails t if a podman container of bench run f is left: its podman
// rows name their containers' prefix ("containers": "PREFIX*"), and other runs' (a
// bench beside the test) are not this run's.
func podmanLeftovers(t *testing.T, podman string, f *bench.File) {
	t.Helper()
	out, err := testutil.Command(t, time.Minute, podman, "--cgroup-manager=cgroupfs", "--events-backend=file", "ps", "-a", "--format", "{{.Names}}").Output()
	if err != nil {
		t.Fatalf("podman ps: %v", err)
	}
	named := false
	for _, r := range f.Results {
		c, _ := r.Info["containers"].(string)
		named = named || c != ""
		for _, name := range strings.Fields(string(out)) {
			if c != "" && strings.HasPrefix(name, strings.TrimSuffix(c, "*")) {
				t.Errorf("the bench left podman container %s", name)
			}
		}
	}
	if !named {
		t.Errorf("no podman row names its containers: the leftover check would see nothing")
	}
}
