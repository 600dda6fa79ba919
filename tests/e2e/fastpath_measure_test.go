package e2e

import (
	"fmt"
	"math/rand"
	"os"
	"sort"
	"strconv"
	"testing"
	"time"

	"deltabox/internal/state"
	"deltabox/internal/testutil"
)

// Measurements of the process fast path, run on demand only (they take a minute and
// load the machine): DELTABOX_MEASURE=1 go test -count=1 -run TestMeasure -v ./tests/e2e/
// They print figures instead of asserting them; docs/DESIGN.md quotes them.

func measureOn(t *testing.T) {
	t.Helper()
	if os.Getenv("DELTABOX_MEASURE") != "1" {
		t.Skip("a measurement: set DELTABOX_MEASURE=1 to run it")
	}
}

func pct(d []float64, p float64) float64 {
	if len(d) == 0 {
		return 0
	}
	s := append([]float64(nil), d...)
	sort.Float64s(s)
	i := int(p * float64(len(s)-1))
	return s[i]
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// TestMeasureOpLatency: checkpoints and restores with a bash and a python session (50 MB
// of heap) alive, n of each (DELTABOX_MEASURE_N, default 50), restores to random nodes;
// the client's time per operation and the daemon's.
func TestMeasureOpLatency(t *testing.T) {
	measureOn(t)
	n := 50
	if v, err := strconv.Atoi(os.Getenv("DELTABOX_MEASURE_N")); err == nil && v > 0 {
		n = v
	}
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "lat")
	if _, err := d.C.StartSession(dbxCtx(t), "lat", state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	sessRun(t, d, "lat", "main", "V=0")
	sessRun(t, d, "lat", "py", "a = bytearray(50 << 20)")
	var nodes []string
	var cpC, cpD, rsC, rsD []float64
	phases := map[string][]float64{}
	rng := rand.New(rand.NewSource(1))
	for i := 0; i < n; i++ {
		sessRun(t, d, "lat", "main", fmt.Sprintf("V=%d; echo %d > /workspace/f%d", i, i, i%10))
		sessRun(t, d, "lat", "py", fmt.Sprintf("a[%d] = 1", i*4096))
		t0 := time.Now()
		r := dbxCheckpoint(t, d, "lat", "")
		cpC = append(cpC, ms(time.Since(t0)))
		cpD = append(cpD, r.DurationMS)
		for k, v := range r.PhasesUS {
			phases["checkpoint "+k] = append(phases["checkpoint "+k], float64(v)/1000)
		}
		nodes = append(nodes, r.Node.ID)
	}
	for i := 0; i < n; i++ {
		sessRun(t, d, "lat", "main", "V=x; echo x > /workspace/x")
		node := nodes[rng.Intn(len(nodes))]
		t0 := time.Now()
		r := dbxRestore(t, d, "lat", node)
		rsC = append(rsC, ms(time.Since(t0)))
		rsD = append(rsD, r.DurationMS)
		for k, v := range r.PhasesUS {
			phases["restore "+k] = append(phases["restore "+k], float64(v)/1000)
		}
		if r.Processes != 2 {
			t.Fatalf("restore took %d processes: %v", r.Processes, r.ProcessErrors)
		}
	}
	t.Logf("checkpoint (n=%d): client p50 %.2f ms p95 %.2f ms; daemon p50 %.2f ms p95 %.2f ms", n, pct(cpC, .5), pct(cpC, .95), pct(cpD, .5), pct(cpD, .95))
	var names []string
	for k := range phases {
		names = append(names, k)
	}
	sort.Strings(names)
	for _, k := range names {
		t.Logf("  phase %-24s p50 %.2f ms", k, pct(phases[k], .5))
	}
	t.Logf("restore    (n=%d): client p50 %.2f ms p95 %.2f ms; daemon p50 %.2f ms p95 %.2f ms", n, pct(rsC, .5), pct(rsC, .95), pct(rsD, .5), pct(rsD, .95))
}

// TestMeasureWarm: the first command after a restore, a python loop writing one byte in
// each page of a 50 MB heap, with the async warm-up off and on (DELTABOX_WARM_PROC):
// right after the restore, and after a 300 ms pause (an agent thinking); the restore's
// own latency; and the same command once the pages are private (the floor).
func TestMeasureWarm(t *testing.T) {
	measureOn(t)
	n := 15
	if v, err := strconv.Atoi(os.Getenv("DELTABOX_MEASURE_N")); err == nil && v > 0 {
		n = v
	}
	const touch = "for i in range(0, len(a), 4096): a[i] = 1"
	for _, mode := range []string{"0", "1", "0", "1"} {
		t.Setenv("DELTABOX_WARM_PROC", mode)
		d := testutil.StartDaemon(t)
		dbxCreate(t, d, "w")
		if _, err := d.C.StartSession(dbxCtx(t), "w", state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
			t.Fatal(err)
		}
		sessRun(t, d, "w", "py", "a = bytearray(50 << 20)")
		node := dbxCheckpoint(t, d, "w", "").Node.ID
		var rs, now, paused, floor, rsSmall, kill []float64
		run := func() float64 {
			r, err := d.C.Run(dbxCtx(t), "w", "py", touch, 30*time.Second)
			if err != nil || r.ExitCode != 0 {
				t.Fatalf("%v %+v", err, r)
			}
			return r.DurationMS
		}
		for i := 0; i < n; i++ {
			t0 := time.Now()
			dbxRestore(t, d, "w", node)
			rs = append(rs, ms(time.Since(t0)))
			now = append(now, run())
			floor = append(floor, run())
			dbxRestore(t, d, "w", node)
			time.Sleep(300 * time.Millisecond)
			paused = append(paused, run())
		}
		// A restore after a pause and a command that writes one page: the warm-up made
		// the whole heap private, which the restore's kill then frees.
		for i := 0; i < n; i++ {
			dbxRestore(t, d, "w", node)
			time.Sleep(300 * time.Millisecond)
			sessRun(t, d, "w", "py", "a[0] = 2")
			t0 := time.Now()
			r := dbxRestore(t, d, "w", node)
			rsSmall = append(rsSmall, ms(time.Since(t0)))
			kill = append(kill, float64(r.PhasesUS["kill"])/1000)
		}
		info, _ := d.C.Get(dbxCtx(t), "w")
		t.Logf("DELTABOX_WARM_PROC=%s (n=%d): restore client p50 %.2f ms; first command right after p50 %.1f ms, after 300 ms p50 %.1f ms; pages already private p50 %.1f ms; restore after a pause and a one-page command p50 %.2f ms (its kill phase %.2f ms); warmed %d MiB",
			mode, n, pct(rs, .5), pct(now, .5), pct(paused, .5), pct(floor, .5), pct(rsSmall, .5), pct(kill, .5), info.Stats.WarmedBytes>>20)
		d.Stop()
	}
}
