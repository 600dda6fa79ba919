package bench

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// summaryFiles are small result files of every bench, with the systems and ops the
// summary reads.
func summaryFiles() []*File {
	r := func(sys, op string, mb int, p50, p99 float64) Row {
		return Row{System: sys, Op: op, WorkspaceMB: mb, P50: p50, P99: p99, Mean: p50 + 0.1, N: 10}
	}
	fs := &File{Bench: "fs", Targets: []Target{
		{System: SysDeltaBox, Op: "checkpoint", Stat: "p50_ms", MaxMS: 1},
		{System: SysDeltaBox, Op: "restore", Stat: "p50_ms", MaxMS: 1.5},
	}, Results: []Row{
		r(SysDeltaBox, "checkpoint", 10, 0.7, 2), r(SysDeltaBox, "restore", 10, 0.6, 2),
		r(SysDeltaBox, "checkpoint", 1024, 1.2, 3), r(SysDeltaBox, "restore", 1024, 0.7, 2),
		r(fsReflink, "checkpoint", 1024, 1500, 1600), r(fsCopytree, "restore", 1024, 2500, 2600),
	}}
	fork := r(SysForkFloor, "fork", 1024, 3.5, 9)
	fork.Info = map[string]any{"python_rss_mb": 63.0}
	lat := &File{Bench: "latency", Targets: []Target{
		{System: SysDeltaBox, Op: "restore", Stat: "p99_ms", MaxMS: 4},
		{System: SysDeltaBox, Op: "nothing", Stat: "p50_ms", MaxMS: 1},
	}, Results: []Row{
		r(SysDeltaBox, "checkpoint", 1024, 5.4, 9), r(SysDeltaBox, "restore", 1024, 6.9, 3.9),
		r(SysDeltaBox, "restore+exec", 1024, 9.2, 20), fork,
		r(SysCRIU, "checkpoint", 0, 140, 900), r(SysCRIU, "restore", 0, 210, 300),
	}}
	mcts := &File{Bench: "mcts", MCTS: []MCTSRow{
		{System: MCTSDeltaBox, ThinkS: 2, TotalS: 100, StateS: 0.5, OverheadFrac: 0.01, ScoresMatch: true},
		{System: MCTSCopytree, ThinkS: 2, TotalS: 110, StateS: 11, OverheadFrac: 0.1, ScoresMatch: true},
	}}
	scale := &File{Bench: "scale", Results: []Row{
		r("deltabox-depth1", "restore", 0, 0.3, 1), r("deltabox-depth400", "restore", 0, 0.5, 1),
		r("deltabox-depth400", "restore-cold", 0, 4, 5),
		r("deltabox-ws10mb", "restore", 0, 0.2, 1), r("deltabox-ws4gb", "restore", 0, 0.4, 1),
	}}
	warm := &File{Bench: "warm", Results: []Row{
		r(SysWarmOff, WarmOpPaused, 0, 50, 60), r(SysWarmOn, WarmOpPaused, 0, 2.7, 4),
	}}
	return []*File{fs, lat, mcts, scale, warm}
}

func TestSummary(t *testing.T) {
	files := summaryFiles()
	md := Markdown(files, []string{"fs.json", "latency.json", "mcts.json", "scale.json", "warm.json"})
	i, j := strings.Index(md, "\n## Summary\n"), strings.Index(md, "\n## fs\n")
	if i < 0 || j < i {
		t.Fatalf("the summary must come first, before the sections:\n%s", md)
	}
	sum := md[i:j]
	for _, want := range []string{
		// Checked: 4 fs targets (2 targets x 2 sizes; 1 missed), the measured latency one,
		// CRIU's, 3 mcts verdicts (overhead, state time at 2 s, scores), scale's (missed).
		// Not checked: the latency target with no row, the mcts negative control (not run).
		"8 of 10 targets met.",
		"| checkpoint p50 <= 1 ms, files only, 10 MiB | 0.700 ms | met | [fs](#fs) |",
		"| checkpoint p50 <= 1 ms, files only, 1 GiB | 1.200 ms | **missed** | [fs](#fs) |",
		"| restore p99 <= 4 ms, files + a 63 MB python, 1 GiB | 3.900 ms | met | [latency](#latency) |",
		"| nothing p50 <= 1 ms, files + a 63 MB python | not measured | - | [latency](#latency) |",
		"| restore >= 30x faster than CRIU's (CRIU: the process only) | 30.4x (210.0 vs 6.900 ms; 22.8x with the next exec) | met | [latency](#latency) |",
		"| MCTS: deltabox overhead <= 3% at 2 s think | 1.00% | met | [mcts](#mcts) |",
		"| MCTS: deltabox state time <= 1/20 of copytree+replay's, 2 s think | 0.500 s vs 11.000 s: 22.0x less | met | [mcts](#mcts) |",
		"| restore p50 at the largest workspace (4 GiB) <= 1.5x the smallest's (10 MiB) | 2.00x (0.400 vs 0.200 ms) | **missed** | [scale](#scale) |",
		"| checkpoint, files only, 1 GiB | 1.200 ms | cp-reflink 1500 ms | [fs](#fs) |",
		"| restore, files only, 1 GiB | 0.700 ms | copytree 2500 ms | [fs](#fs) |",
		"| checkpoint, files + a 63 MB python, 1 GiB | 5.400 ms (mean 5.500); 1.900 ms above the process's own fork | published 14 ms mean (10.8 ms in its later version); CRIU dump 140.0 ms; os.fork() alone 3.500 ms | [latency](#latency) |",
		"| restore, files + a 63 MB python, 1 GiB | 6.900 ms (mean 7.000); 3.400 ms above the process's own fork | published 5 ms mean (1.86 ms in its later version); CRIU restore 210.0 ms | [latency](#latency) |",
		"| MCTS: state management / search time | 2 s think: 0.50% (overhead 1.00%) | published 3-6% (47-77% before); 2 s: copytree+replay 10.00% | [mcts](#mcts) |",
		"| MCTS: the negative control (fs-only, no replay) does not match | not run | - | [mcts](#mcts) |",
		"| restore at depth 400, files only | 0.500 ms (4.000 cold) | 0.300 ms at depth 1 | [scale](#scale) |",
		"| restore, 4 GiB workspace, files only | 0.400 ms | 0.200 ms at 10 MiB | [scale](#scale) |",
		"| first command after a restore and a pause (rewrites the heap) | 2.700 ms with the warm-up | 50.00 ms without | [warm](#warm) |",
	} {
		if !strings.Contains(sum, want) {
			t.Errorf("summary lacks\n%s\nin\n%s", want, sum)
		}
	}
	// Headlines of what was not run are left out: no 0 s think row, no heap rows.
	for _, absent := range []string{"0 s think", "python heap"} {
		if strings.Contains(sum, absent) {
			t.Errorf("summary mentions %q, which no file measured:\n%s", absent, sum)
		}
	}
	// The sections' own Targets tables say the same as the summary.
	if !strings.Contains(md, "| deltabox checkpoint p50 <= 1.000 ms | 1 GiB | 1.200 ms | **missed** |") ||
		!strings.Contains(md, "| deltabox nothing p50 <= 1.000 ms | - | not measured | - |") {
		t.Errorf("the fs and latency Targets tables changed:\n%s", md[j:])
	}
	if s := Markdown(nil, nil); strings.Contains(s, "## Summary") {
		t.Errorf("a summary with no results:\n%s", s)
	}
}

// The committed results make a summary that fits on one screen and lists every target
// the sections check.
func TestSummaryOfCommittedResults(t *testing.T) {
	dir := filepath.Join("..", "..", "bench-results")
	if _, err := os.Stat(dir); err != nil {
		t.Skipf("no committed results: %v", err)
	}
	md, err := Report(dir)
	if err != nil {
		t.Fatal(err)
	}
	i := strings.Index(md, "\n## Summary\n")
	j := strings.Index(md[i+1:], "\n## ") + i + 1
	if i < 0 || j <= i {
		t.Fatal("no summary section")
	}
	sum := md[i:j]
	if n := strings.Count(strings.TrimSpace(sum), "\n") + 1; n > 40 {
		t.Errorf("the summary takes %d lines, more than a screen (40):\n%s", n, sum)
	}
	files, _, err := readResults(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		for _, c := range targetChecks(f) {
			if c.Row == nil {
				continue
			}
			if want := fmtMS(c.Value) + " ms | "; !strings.Contains(sum, want) {
				t.Errorf("%s target %+v (%s ms) is not in the summary", f.Bench, c.T, fmtMS(c.Value))
			}
		}
		for _, v := range MCTSVerdicts(f.MCTS) {
			if !strings.Contains(sum, cell(v.Target)) {
				t.Errorf("mcts target %q is not in the summary", v.Target)
			}
		}
	}
}

// TestSummaryDurable: the durable bench's targets: the 50 MB restore from an image
// against plain CRIU's, and stored bytes per checkpoint against a full dump at every
// heap size (one line, missed if any size misses).
func TestSummaryDurable(t *testing.T) {
	r := func(sys, op string, mb int, p50 float64) Row {
		return Row{System: sys, Op: op, WorkspaceMB: mb, P50: p50, N: 10}
	}
	f := &File{Bench: "durable", Results: []Row{
		r(SysDurableIncr, "dump", 50, 345e3), r(SysCRIUFull, "dump", 50, 61e6),
		r(SysDurableImage, "restore", 50, 152.3), r(SysCRIUPlain, "restore", 50, 134.4),
		r(SysDurableIncr, "dump", 500, 150e6), r(SysCRIUFull, "dump", 500, 533e6),
		r(SysDurableImage, "restore", 500, 2000), r(SysCRIUPlain, "restore", 500, 961),
		r(SysDurableLazy, "restore", 50, 140), r(SysDurableLazy, "restore", 500, 180),
	}}
	md := Markdown([]*File{f}, []string{"durable.json"})
	for _, want := range []string{
		"1 of 3 targets met.",
		"| lazy restore from a durable image: first command p50 before the eager restore's and plain CRIU's | 50 MB: 140.0 ms vs 152.3 ms eager, 134.4 ms plain CRIU; 500 MB: 180.0 ms vs 2000 ms eager, 961.0 ms plain CRIU | **missed** | [durable](#durable) |",
		"| restore from a durable image p50 <= 1.5x plain CRIU's, a 50 MB python | 1.13x (152.3 vs 134.4 ms) | met | [durable](#durable) |",
		"| image bytes stored per checkpoint >= 5x fewer than a full CRIU dump's (python heaps) | 176x at 50 MB (345 KB vs 61.0 MB); 3x at 500 MB (150.0 MB vs 533.0 MB) | **missed** | [durable](#durable) |",
	} {
		if !strings.Contains(md, want) {
			t.Errorf("summary lacks\n%s\nin\n%s", want, md)
		}
	}
}

// Report reads every *.json bench file in dir and returns docs/BENCHMARKS.md (the CLI
// writes it with WriteReport).
func Report(dir string) (string, error) {
	files, names, err := readResults(dir)
	if err != nil {
		return "", err
	}
	return Markdown(files, names), nil
}
