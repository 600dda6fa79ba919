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

// TestBenchFanoutTiny runs `deltabox bench fanout` with tiny settings on a daemon with
// the fast path of forks on: each fork has its deltabox row (every branch carried its
// python by the durable path), its deltabox-fast and deltabox-family rows (by the fast
// path: a fork of a sandbox, then a fork of its node, which its family holds), its
// files+replay row and, where podman is installed (scripts/setup.sh installs it), its
// podman row with samples; the systems that cannot run are marked so with the reason,
// and the bench removed what it made, podman's containers too.
func TestBenchFanoutTiny(t *testing.T) {
	podman, _ := exec.LookPath("podman")
	if podman == "" && os.Getenv("CI") == "true" {
		t.Fatal("podman is not installed: scripts/setup.sh installs it for the benches' baselines")
	}
	// Where podman's checkpoint cannot work (a machine without hardware breakpoints),
	// its rows must say why.
	podmanWhy := bench.PodmanUnavailable()
	d := testutil.StartDaemon(t)
	out := filepath.Join(t.TempDir(), "fanout.json")
	cmd := testutil.Command(t, 5*time.Minute, testutil.Binary(t), "--socket", d.Socket, "bench", "fanout", "--counts", "1,2",
		"--heap-mb", "4", "--workspace-mb", "4", "--json", out)
	cmd.Env = append(os.Environ(), "DELTABOX_ROOT="+d.Root) // where the bench finds the branches' cgroups
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if b, err := cmd.Output(); err != nil {
		t.Fatalf("bench fanout: %v\n%s\n%s", err, b, stderr.String())
	}
	f, err := bench.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	if f.Bench != "fanout" || f.Description == "" {
		t.Fatalf("bench %q, description %q", f.Bench, f.Description)
	}
	got := map[string]bench.Row{}
	for _, r := range f.Results {
		got[r.System+" "+r.Op] = r
	}
	want := map[string][]int{"1": {0}, "2": {0, 1}} // the branches of each fork
	for _, n := range []string{"1", "2"} {
		op := "fork-" + n
		for _, sys := range []string{bench.SysFanoutDeltabox, bench.SysFanoutFast, bench.SysFanoutFamily, bench.SysFanoutReplay} {
			r, ok := got[sys+" "+op]
			if !ok {
				t.Fatalf("no row %s %s", sys, op)
			}
			if total, _ := r.Info["total_ms"].(float64); r.N == 0 || r.P50 <= 0 || total <= 0 {
				t.Errorf("row %s %s: n %d, p50 %v, info %v", sys, op, r.N, r.P50, r.Info)
			}
		}
		if pss, _ := got[bench.SysFanoutDeltabox+" "+op].Info["pss_added_mb"].(float64); pss <= 0 {
			t.Errorf("%s: deltabox's pss_added_mb %v, want the branches' PSS", op, got[bench.SysFanoutDeltabox+" "+op].Info["pss_added_mb"])
		}
		if p, _ := got[bench.SysFanoutDeltabox+" "+op].Info["paths"].(map[string]any); p["durable"] != float64(len(want[n])) {
			t.Errorf("%s: paths %v, want every branch durable", op, p)
		}
		for _, sys := range []string{bench.SysFanoutFast, bench.SysFanoutFamily} {
			if p, _ := got[sys+" "+op].Info["paths"].(map[string]any); p["fast"] != float64(len(want[n])) {
				t.Errorf("%s: %s paths %v (%v), want every branch fast", op, sys, p, got[sys+" "+op].Info["reason"])
			}
		}
		if pss, _ := got[bench.SysFanoutFast+" "+op].Info["pss_added_mb"].(float64); pss <= 0 {
			t.Errorf("%s: deltabox-fast's pss_added_mb %v, want the branches' PSS", op, got[bench.SysFanoutFast+" "+op].Info["pss_added_mb"])
		}
		if r := got[bench.SysFanoutCRIU+" "+op]; r.Unavailable() == "" {
			t.Errorf("row %s %s: not marked unavailable with its reason", bench.SysFanoutCRIU, op)
		}
		r := got[bench.SysFanoutPodman+" "+op]
		if podman == "" {
			if r.Unavailable() == "" {
				t.Errorf("row podman %s: podman is not installed, yet the row is not marked unavailable", op)
			}
			continue
		}
		if podmanWhy != "" {
			if !strings.Contains(r.Unavailable(), podmanWhy) {
				t.Errorf("row podman %s: unavailable %q, want %q", op, r.Unavailable(), podmanWhy)
			}
			continue
		}
		total, _ := r.Info["total_ms"].(float64)
		if pss, _ := r.Info["pss_added_mb"].(float64); r.N != len(want[n]) || r.P50 <= 0 || total <= 0 || pss <= 0 {
			t.Errorf("row podman %s: n %d (want %d), p50 %v, info %v, unavailable %q", op, r.N, len(want[n]), r.P50, r.Info, r.Unavailable())
		}
	}
	benchLeftovers(t, d, "fanout")
	if podman != "" && podmanWhy == "" {
		podmanLeftovers(t, podman, f)
	}
}
