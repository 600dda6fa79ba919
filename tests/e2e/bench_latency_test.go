package e2e

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"deltabox/internal/bench"
	"deltabox/internal/criu"
	"deltabox/internal/testutil"
)

// TestBenchLatencyTiny runs `deltabox bench latency` with tiny counts and checks that
// the four systems have checkpoint and restore rows with samples, that every restore
// was served by a process template and checked, and that the bench removed what it
// made (sandboxes, nodes, host copies, CRIU images).
func TestBenchLatencyTiny(t *testing.T) {
	d := testutil.StartDaemon(t)
	_, err := criu.Find()
	testutil.Require(t, err == nil, "no CRIU (scripts/setup.sh builds it): %v", err)
	_, err = exec.LookPath("python3")
	testutil.Require(t, err == nil, "no python3 on the host: %v", err)
	dir := t.TempDir()
	out := filepath.Join(dir, "latency.json")
	hostDir := filepath.Join(d.Root, "tmp", "bench-latency")
	shm := filepath.Join(dir, "shm")
	os.Mkdir(shm, 0o700)
	start := time.Now()
	cmd := exec.Command(testutil.Binary(t), "--socket", d.Socket, "bench", "latency", "--workspace-mb", "2", "--small-files", "100",
		"--heap-mb", "4", "--step-mb", "1", "--changes", "10", "--chain", "3", "--restores", "4", "--max-nodes", "5",
		"--baseline-checkpoints", "2", "--baseline-restores", "2", "--criu-keep", "2", "--host-dir", hostDir, "--tmpfs-dir", shm, "--json", out)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if b, err := cmd.Output(); err != nil {
		t.Fatalf("bench latency: %v\n%s\n%s", err, b, stderr.String())
	}
	t.Logf("bench latency took %v", time.Since(start))
	f, err := bench.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	if f.Bench != "latency" || f.Description == "" || len(f.Targets) != 4 {
		t.Fatalf("bench %q, description %q, %d targets", f.Bench, f.Description, len(f.Targets))
	}
	got := map[string]bench.Row{}
	for _, r := range f.Results {
		got[r.System+" "+r.Op] = r
	}
	want := map[string]int{
		"deltabox checkpoint": 7, "deltabox checkpoint+exec": 7, "deltabox restore": 4, "deltabox restore+exec": 4,
		"criu checkpoint": 2, "criu restore": 2, "copytree+replay checkpoint": 2, "copytree+replay restore": 2,
		"fs-only+replay checkpoint": 2, "fs-only+replay restore": 2,
		"kernel-fork fork": 4, // one per branch checkpoint
	}
	for k, n := range want {
		r, ok := got[k]
		if !ok {
			t.Errorf("no row %s", k)
			continue
		}
		if r.N != n || r.P50 <= 0 || r.P99 < r.P50 || len(r.Commands) == 0 {
			t.Errorf("row %s: n %d (want %d), p50 %v, p99 %v, commands %v", k, r.N, n, r.P50, r.P99, r.Commands)
		}
	}
	if len(got) != len(want) {
		t.Errorf("%d rows, want %d", len(got), len(want))
	}
	rs := got["deltabox restore"]
	if rs.Info["template_restores"] != float64(4) || rs.Info["state_checks_failed"] != float64(0) {
		t.Errorf("deltabox restore info: %v", rs.Info)
	}
	// The daemon's per-path counters: every deltabox restore forked its template back,
	// every fs-only one carried files only.
	if p, _ := rs.Info["daemon_restore_paths"].(map[string]any); p["process"] != float64(4) || p["files_only"] != float64(0) {
		t.Errorf("deltabox restore paths: %v", rs.Info["daemon_restore_paths"])
	}
	if p, _ := got["fs-only+replay restore"].Info["daemon_restore_paths"].(map[string]any); p["process"] != float64(0) || p["files_only"] != float64(2) {
		t.Errorf("fs-only restore paths: %v", got["fs-only+replay restore"].Info["daemon_restore_paths"])
	}
	// The reference fork is the session's own, timed in the process: it is below the
	// template restore, which contains one fork.
	if kf := got["kernel-fork fork"]; kf.P50 >= rs.P50 {
		t.Errorf("kernel-fork p50 %v >= deltabox restore p50 %v: the reference is not the floor it claims to be", kf.P50, rs.P50)
	}
	if _, ok := rs.Info["criu_restore_p50_over_deltabox_restore_p50"]; !ok {
		t.Errorf("no CRIU ratio in %v", rs.Info)
	}
	for _, k := range []string{"criu restore", "copytree+replay restore", "fs-only+replay restore"} {
		if got[k].Info["state_checks_failed"] != float64(0) {
			t.Errorf("%s: %v", k, got[k].Info)
		}
	}
	if ws := f.Workspaces; len(ws) != 1 || ws[0].MarkerChecks != 4 || ws[0].MarkerFailures != 0 || !ws[0].HostIdentical {
		t.Errorf("workspaces: %+v", ws)
	}
	// Nothing left behind.
	benchLeftovers(t, d, "latency")
	if _, err := os.Stat(hostDir); !os.IsNotExist(err) {
		t.Errorf("host directory left behind: %v", err)
	}
	if left, _ := os.ReadDir(shm); len(left) != 0 {
		t.Errorf("CRIU images left behind: %v", left)
	}
}
