package e2e

import (
	"bytes"
	"path/filepath"
	"testing"
	"time"

	"deltabox/internal/bench"
	"deltabox/internal/testutil"
)

// TestBenchWarmTiny runs `deltabox bench warm` with tiny counts: every op has its
// samples for both systems, the warm-up pre-faulted memory in the sandbox created with
// warm_processes and none in the other (the per-sandbox option), and the bench removed
// what it made.
func TestBenchWarmTiny(t *testing.T) {
	d := testutil.StartDaemon(t)
	out := filepath.Join(t.TempDir(), "warm.json")
	cmd := testutil.Command(t, 5*time.Minute, testutil.Binary(t), "--socket", d.Socket, "bench", "warm", "--heap-mb", "8", "--samples", "2",
		"--rounds", "1", "--pause-ms", "150", "--json", out)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if b, err := cmd.Output(); err != nil {
		t.Fatalf("bench warm: %v\n%s\n%s", err, b, stderr.String())
	}
	f, err := bench.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	if f.Bench != "warm" || f.Description == "" {
		t.Fatalf("bench %q, description %q", f.Bench, f.Description)
	}
	got := map[string]bench.Row{}
	for _, r := range f.Results {
		got[r.System+" "+r.Op] = r
	}
	for _, sys := range []string{bench.SysWarmOff, bench.SysWarmOn} {
		for _, op := range []string{bench.WarmOpRestore, bench.WarmOpFirst, bench.WarmOpPaused, bench.WarmOpSecond, bench.WarmOpNextRestore} {
			r, ok := got[sys+" "+op]
			if !ok {
				t.Errorf("no row %s %s", sys, op)
				continue
			}
			if r.N != 2 || r.P50 <= 0 || len(r.Commands) == 0 {
				t.Errorf("row %s %s: n %d, p50 %v, commands %v", sys, op, r.N, r.P50, r.Commands)
			}
		}
	}
	if len(got) != 10 {
		t.Errorf("%d rows, want 10", len(got))
	}
	if w := got[bench.SysWarmOff+" "+bench.WarmOpRestore].Info["warmed_mib"]; w != float64(0) {
		t.Errorf("the sandbox without warm_processes warmed %v MiB", w)
	}
	if w, _ := got[bench.SysWarmOn+" "+bench.WarmOpRestore].Info["warmed_mib"].(float64); w < 1 {
		t.Errorf("the sandbox with warm_processes warmed %v MiB, want some of its 8 MiB heap", w)
	}
	benchLeftovers(t, d, "warm")
}
