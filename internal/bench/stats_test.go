package bench

import (
	"encoding/json"
	"strings"
	"testing"
)

func TestPercentileNearestRank(t *testing.T) {
	var xs []float64
	for i := 20; i >= 1; i-- { // unsorted on purpose
		xs = append(xs, float64(i))
	}
	d := Summarize(xs)
	if d.N != 20 || d.P50 != 10 || d.P95 != 19 || d.P99 != 20 || d.Min != 1 || d.Max != 20 || d.Mean != 10.5 {
		t.Fatalf("got %+v", d)
	}
	if xs[0] != 20 {
		t.Fatal("Summarize sorted its input")
	}
	var h []float64
	for i := 1; i <= 200; i++ {
		h = append(h, float64(i))
	}
	d = Summarize(h)
	if d.P50 != 100 || d.P95 != 190 || d.P99 != 198 {
		t.Fatalf("n=200: got %+v", d)
	}
	if d := Summarize([]float64{7}); d.P50 != 7 || d.P99 != 7 {
		t.Fatalf("n=1: got %+v", d)
	}
	if d := Summarize(nil); d.N != 0 {
		t.Fatalf("empty: got %+v", d)
	}
}

func TestLayerDist(t *testing.T) {
	l := LayerDist([]int{1, 100, 50, 51})
	if l.Min != 1 || l.Max != 100 || l.P50 != 50 || l.Mean != 50.5 {
		t.Fatalf("got %+v", l)
	}
	if LayerDist(nil) != nil {
		t.Fatal("empty should be nil")
	}
}

func TestReportMarkdown(t *testing.T) {
	f := &File{
		Bench:   "fs",
		Command: "deltabox bench fs --sizes 10 --json bench-results/fs.json",
		Machine: Machine{Kernel: "Linux 6.18 x86_64", CPUs: 2, Date: "2026-01-01T00:00:00Z"},
		Results: []Row{
			{System: "deltabox", Op: "checkpoint", WorkspaceMB: 10, P50: 0.8, P95: 1.2, P99: 2, N: 200, Layers: &Layers{Min: 2, Max: 100, Mean: 60},
				Commands: []string{"client.Checkpoint"}, Info: map[string]any{"daemon_p50_ms": 0.5}},
			{System: "deltabox", Op: "restore", WorkspaceMB: 10, P50: 1.6, N: 200, Commands: []string{"client.Restore"}},
			{System: "copytree", Op: "restore", WorkspaceMB: 10, P50: 120, N: 20, Commands: []string{"rm -rf WS", "cp -a --reflink=never SNAP_k WS"}},
			{System: "x", Op: "latency", P50: 3, N: 5, Commands: []string{"a | b"}},
		},
		Targets: []Target{{System: "deltabox", Op: "checkpoint", Stat: "p50_ms", MaxMS: 1}, {System: "deltabox", Op: "restore", Stat: "p50_ms", MaxMS: 1.5}},
		Notes:   []string{"a note"},
	}
	// Round-trip through JSON, as the report reads files.
	b, _ := json.Marshal(f)
	var g File
	if err := json.Unmarshal(b, &g); err != nil {
		t.Fatal(err)
	}
	md := Markdown([]*File{&g}, []string{"bench-results/fs.json"})
	for _, want := range []string{
		"## fs", "### Results, 10 MiB workspace", "### Results\n",
		"| deltabox | checkpoint | 0.800 | 1.200 | 2.000 |", "2-100 (mean 60.0)",
		"`rm -rf WS` then `cp -a --reflink=never SNAP_k WS`", "`a \\| b`",
		"| deltabox checkpoint p50 <= 1.000 ms | 10 MiB | 0.800 ms | met |",
		"| deltabox restore p50 <= 1.500 ms | 10 MiB | 1.600 ms | **missed** |",
		"daemon_p50_ms 0.5", "- a note",
	} {
		if !strings.Contains(md, want) {
			t.Errorf("report lacks %q:\n%s", want, md)
		}
	}
}

func TestShellJoin(t *testing.T) {
	got := ShellJoin([]string{"bench", "fs", "--sizes", "10,1024", "--note", "it's a b", ""})
	want := `bench fs --sizes 10,1024 --note 'it'\''s a b' ''`
	if got != want {
		t.Fatalf("got %s, want %s", got, want)
	}
}

func TestTailPhasesAreTheSlowSamples(t *testing.T) {
	type s struct {
		d  float64
		ph map[string]int64
	}
	var ss []s
	for i := 1; i <= 100; i++ {
		ph := map[string]int64{"fork": 1000}
		if i > 95 {
			ph["fork"] = 9000 // the slow 5% spend it in the fork
			ph["squash"] = 7000
		}
		ss = append(ss, s{float64(i), ph})
	}
	got := tailPhases(ss, func(x s) float64 { return x.d }, func(x s) map[string]int64 { return x.ph })
	if got["fork"] != 9000 || got["squash"] != 7000 {
		t.Fatalf("tail phases = %v, want fork 9000 and squash 7000 (the samples at or above p95)", got)
	}
	if all := phaseMedians(ss, func(x s) map[string]int64 { return x.ph }); all["fork"] != 1000 {
		t.Fatalf("median fork over all = %v, want 1000", all["fork"])
	}
	if len(tailPhases([]s(nil), func(x s) float64 { return x.d }, func(x s) map[string]int64 { return x.ph })) != 0 {
		t.Fatal("tail phases of no samples should be empty")
	}
}
