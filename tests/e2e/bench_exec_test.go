package e2e

import (
	"bytes"
	"path/filepath"
	"testing"
	"time"

	"deltabox/internal/bench"
	"deltabox/internal/testutil"
)

// TestBenchExecTiny runs `deltabox bench exec` with tiny counts: every op has its
// samples for exec and both sessions (the bench checks each answer's size and
// truncation count itself), and the bench removed its sandbox.
func TestBenchExecTiny(t *testing.T) {
	d := testutil.StartDaemon(t)
	out := filepath.Join(t.TempDir(), "exec.json")
	cmd := testutil.Command(t, 5*time.Minute, testutil.Binary(t), "--socket", d.Socket, "bench", "exec", "--samples", "5",
		"--samples-1mb", "2", "--samples-100mb", "1", "--no-baseline", "--json", out)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if b, err := cmd.Output(); err != nil {
		t.Fatalf("bench exec: %v\n%s\n%s", err, b, stderr.String())
	}
	f, err := bench.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	if f.Bench != "exec" || f.Description == "" {
		t.Fatalf("bench %q, description %q", f.Bench, f.Description)
	}
	got := map[string]bench.Row{}
	for _, r := range f.Results {
		got[r.System+" "+r.Op] = r
	}
	for _, c := range []struct {
		op string
		n  int
	}{{bench.ExecOpCall, 5}, {bench.ExecOpOutSmall, 2}, {bench.ExecOpOutLarge, 1}} {
		for _, sys := range []string{bench.SysExecPlain, bench.SysExecBash, bench.SysExecPython} {
			r, ok := got[sys+" "+c.op]
			if !ok {
				t.Errorf("no row %s %s", sys, c.op)
				continue
			}
			if r.N != c.n || r.P50 <= 0 || len(r.Commands) != 1 || r.Info["daemon_p50_ms"] == nil {
				t.Errorf("row %s %s: n %d, p50 %v, commands %v, info %v", sys, c.op, r.N, r.P50, r.Commands, r.Info)
			}
		}
	}
	if len(got) != 9 {
		t.Errorf("%d rows, want 9 (no podman rows with --no-baseline)", len(got))
	}
	benchLeftovers(t, d, "exec")
}
