package e2e

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"deltabox/internal/bench"
	"deltabox/internal/criu"
	"deltabox/internal/testutil"
)

// TestBenchLatencyTiny runs `deltabox bench latency` with tiny counts and checks that
// the four systems have checkpoint and restore rows with samples, that every restore
// was served by a process template and checked (restore-spare's by a spare), and that the bench removed what it
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
	cmd := testutil.Command(t, 5*time.Minute, testutil.Binary(t), "--socket", d.Socket, "bench", "latency", "--workspace-mb", "2", "--small-files", "100",
		"--heap-mb", "4", "--step-mb", "1", "--changes", "10", "--chain", "3", "--restores", "4", "--spare-restores", "3", "--max-nodes", "5",
		"--baseline-checkpoints", "2", "--baseline-restores", "2", "--criu-keep", "2", "--host-dir", hostDir, "--tmpfs-dir", shm, "--json", out)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdout, err := cmd.Output()
	if err != nil {
		t.Fatalf("bench latency: %v\n%s\n%s", err, stdout, stderr.String())
	}
	t.Logf("bench latency took %v", time.Since(start))
	f, err := bench.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	if f.Bench != "latency" || f.Description == "" || len(f.Targets) != 6 {
		t.Fatalf("bench %q, description %q, %d targets", f.Bench, f.Description, len(f.Targets))
	}
	got := map[string]bench.Row{}
	for _, r := range f.Results {
		got[r.System+" "+r.Op] = r
	}
	want := map[string]int{
		// The chain's 3 and every other branch checkpoint answer complete, the other 2 early.
		"deltabox checkpoint": 5, "deltabox checkpoint+exec": 5, "deltabox checkpoint-answer": 2, "deltabox checkpoint-answer+exec": 2,
		"deltabox restore": 4, "deltabox restore+exec": 4,
		"deltabox restore-spare": 3, "deltabox restore-spare+exec": 3, // the fork's node in its branch, each from a spare
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
	// An early answer comes before its node is complete: the node's complete_ms (read
	// once the next call has waited for it) is above the answer's own time.
	ca := got["deltabox checkpoint-answer"]
	complete, _ := ca.Info["complete_ms_p50"].(float64)
	if answer, _ := ca.Info["daemon_p50_ms"].(float64); !(answer > 0) || complete <= answer {
		t.Errorf("deltabox checkpoint-answer info: %v, want complete_ms_p50 above daemon_p50_ms", ca.Info)
	}
	if sp := got["deltabox restore-spare"]; sp.Info["from_spare"] != float64(3) || !(sp.Info["spare_pss_mb_p50"].(float64) > 0) {
		t.Errorf("deltabox restore-spare info: %v, want every restore from a spare, and the spares' Pss", sp.Info)
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
	// template restore, which contains one fork. A floor is a minimum: with 4 and 5
	// samples, medians at load 8 crossed (CI run s37a: a fork's p50 23 ms, the restores'
	// 19.9), while the fastest fork is under the fastest restore whatever the load.
	if kf := got["kernel-fork fork"]; kf.Min >= rs.Min {
		t.Errorf("kernel-fork min %v >= deltabox restore min %v (p50 %v and %v): the reference is not the floor it claims to be", kf.Min, rs.Min, kf.P50, rs.P50)
	}
	if _, ok := rs.Info["criu_restore_p50_over_deltabox_restore_p50"]; !ok {
		t.Errorf("no CRIU ratio in %v", rs.Info)
	}
	// How CRIU ran here (criu.Probe): recorded with the machine and in the rows.
	if c := f.Machine.CRIU; c == nil || !c.Usable() || c.ProbeS <= 0 {
		t.Errorf("machine.criu: %+v", c)
	} else {
		t.Logf("CRIU ran in %s mode (self-test %.2f s)", c.Mode, c.ProbeS)
		for _, k := range []string{"criu checkpoint", "criu restore"} {
			if got[k].Info["criu_mode"] != string(c.Mode) {
				t.Errorf("%s: criu_mode %v, want %s", k, got[k].Info["criu_mode"], c.Mode)
			}
		}
		if !strings.Contains(string(stdout), "note: criu: ") {
			t.Errorf("the output does not say how CRIU ran:\n%s", stdout)
		}
	}
	for _, k := range []string{"criu restore", "copytree+replay restore", "fs-only+replay restore"} {
		if got[k].Info["state_checks_failed"] != float64(0) {
			t.Errorf("%s: %v", k, got[k].Info)
		}
	}
	// 4 restores and 3 restore-spare ones checked.
	if ws := f.Workspaces; len(ws) != 1 || ws[0].MarkerChecks != 7 || ws[0].MarkerFailures != 0 || !ws[0].HostIdentical {
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

// hangingCRIU writes a criu that never finishes, like CRIU 4.1.1 on a machine that does
// not deliver hardware breakpoints, with a child of its own; each run appends its PID
// and its child's to the returned file.
func hangingCRIU(t *testing.T) (bin, pids string) {
	t.Helper()
	dir := t.TempDir()
	bin, pids = filepath.Join(dir, "criu"), filepath.Join(dir, "pids")
	script := fmt.Sprintf("#!/bin/sh\nsleep 1000 &\necho $$ $! >> %s\nwait\n", pids)
	if err := os.WriteFile(bin, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return bin, pids
}

// noneLeft checks that no process the hanging criu ran is alive (a zombie waits for
// init, which reaps about once a second here).
func noneLeft(t *testing.T, pids string) {
	t.Helper()
	b, err := os.ReadFile(pids)
	if err != nil {
		t.Fatalf("the fake criu never ran: %v", err)
	}
	for _, p := range strings.Fields(string(b)) {
		for deadline := time.Now().Add(3 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			st, err := os.ReadFile("/proc/" + p + "/stat")
			if err != nil || strings.Contains(string(st), ") Z ") {
				break
			}
			if time.Now().After(deadline) {
				t.Errorf("process %s of the fake criu is still alive: %s", p, st)
				break
			}
		}
	}
}

// TestBenchLatencyCRIUHangs: with a criu that never returns, the bench finishes, marks
// the criu baseline unavailable with the self-test's reason, and leaves no process.
func TestBenchLatencyCRIUHangs(t *testing.T) {
	d := testutil.StartDaemon(t)
	_, err := exec.LookPath("python3")
	testutil.Require(t, err == nil, "no python3 on the host: %v", err)
	fake, pids := hangingCRIU(t)
	out := filepath.Join(t.TempDir(), "latency.json")
	start := time.Now()
	cmd := testutil.Command(t, 3*time.Minute, testutil.Binary(t), "--socket", d.Socket, "bench", "latency", "--workspace-mb", "1", "--small-files", "10",
		"--heap-mb", "2", "--step-mb", "1", "--changes", "2", "--chain", "1", "--restores", "0", "--max-nodes", "2",
		"--baselines", "criu", "--criu", fake, "--json", out)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdout, err := cmd.Output()
	took := time.Since(start)
	if err != nil {
		t.Fatalf("bench latency with a hanging criu: %v\n%s\n%s", err, stdout, stderr.String())
	}
	t.Logf("bench latency with a hanging criu took %v:\n%s", took, stdout)
	f, err := bench.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	if c := f.Machine.CRIU; c == nil || c.Mode != criu.Unusable || c.Bin != fake || c.ProbeS > (2*criu.ProbeTimeout+5*time.Second).Seconds() {
		t.Errorf("machine.criu: %+v", c)
	}
	n := 0
	for _, r := range f.Results {
		if r.System != bench.SysCRIU {
			continue
		}
		n++
		if why := r.Unavailable(); r.N != 0 || !strings.Contains(why, "did not finish within "+criu.ProbeTimeout.String()) {
			t.Errorf("row criu %s: n %d, unavailable %q", r.Op, r.N, why)
		}
	}
	if n != 2 {
		t.Errorf("%d criu rows, want checkpoint and restore marked unavailable", n)
	}
	if !strings.Contains(string(stdout), "unavailable: CRIU is unusable here") {
		t.Errorf("the table does not say the baseline was unavailable:\n%s", stdout)
	}
	noneLeft(t, pids)
	benchLeftovers(t, d, "latency")
}
