package bench

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func sampleFiles() (fs, scale *File) {
	m := Machine{Kernel: "Linux 6.18.44-fc x86_64", CPUs: 2, MemMB: 24000, Date: "2026-12-02T18:00:00Z", Revision: "abc123"}
	start := time.Date(2026, 12, 2, 18, 0, 0, 0, time.UTC)
	row := func(system, op string, mb int, p50 float64, n int) Row {
		return Row{System: system, Op: op, WorkspaceMB: mb, P50: p50, P95: p50 * 2, P99: p50 * 3, Mean: p50, Min: p50 / 2, Max: p50 * 3, N: n,
			Commands: []string{"x"}}
	}
	fs = &File{Bench: "fs", Machine: m, Started: start, Results: []Row{
		row("deltabox", "checkpoint", 10, 1.0, 200), row("deltabox", "restore", 10, 0.9, 200),
		row("cp-reflink", "checkpoint", 10, 242, 20), row("copytree", "restore", 10, 2300, 20),
	}}
	scale = &File{Bench: "scale", Machine: m, Started: start}
	for _, d := range []int{1, 10, 100, 400} {
		s := ScalePoint{"depth", d}.system()
		scale.Results = append(scale.Results, row(s, "checkpoint", 0, 1, 100), row(s, "restore", 0, 0.9, 100),
			row(s, "restore+exec", 0, 6, 100), row(s, "restore-cold", 0, 1+float64(d)*0.012, 50))
	}
	for _, mb := range []int{10, 100, 1024, 4096} {
		s := ScalePoint{"ws", mb}.system()
		scale.Results = append(scale.Results, row(s, "checkpoint", 0, 1, 100), row(s, "restore", 0, 1, 100), row(s, "restore-cold", 0, 2, 50))
	}
	for _, mb := range []int{10, 100, 1024, 2048} {
		s := ScalePoint{"rss", mb}.system()
		r := row(s, "restore", 0, 10+float64(mb)/10, 100)
		r.Info = map[string]any{"warm": 100, "session_vmrss_mb": mb + 10}
		scale.Results = append(scale.Results, row(s, "checkpoint", 0, 5+float64(mb)/20, 100), r)
	}
	return fs, scale
}

// TestReportWritesFigures: the report writes one SVG per figure into plots/ next to
// the markdown, links each from its bench's section, and gives the same bytes for
// the same inputs.
func TestReportWritesFigures(t *testing.T) {
	dir := t.TempDir()
	res := filepath.Join(dir, "bench-results")
	fs, scale := sampleFiles()
	if err := WriteFile(filepath.Join(res, "fs.json"), fs); err != nil {
		t.Fatal(err)
	}
	if err := WriteFile(filepath.Join(res, "scale.json"), scale); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "docs", "BENCHMARKS.md")
	want := []string{"fs-p50.svg", "scale-depth.svg", "scale-workspace.svg", "scale-rss.svg"}
	read := func() (string, map[string][]byte) {
		if err := WriteReport(res, out); err != nil {
			t.Fatal(err)
		}
		md, err := os.ReadFile(out)
		if err != nil {
			t.Fatal(err)
		}
		svgs := map[string][]byte{}
		for _, w := range want {
			b, err := os.ReadFile(filepath.Join(dir, "docs", "plots", w))
			if err != nil {
				t.Fatalf("figure not written: %v", err)
			}
			svgs[w] = b
		}
		return string(md), svgs
	}
	md, svgs := read()
	for _, w := range want {
		b := svgs[w]
		if !bytes.HasPrefix(b, []byte("<?xml")) || !bytes.Contains(b, []byte("<svg")) || !bytes.HasSuffix(bytes.TrimSpace(b), []byte("</svg>")) {
			t.Errorf("%s is not an SVG document: %.80q", w, b)
		}
		if !strings.Contains(md, "](plots/"+w+")") {
			t.Errorf("the report does not link %s", w)
		}
		// Machine, samples and date are stated in the figure.
		for _, s := range []string{"Linux 6.18.44 x86_64, 2 CPUs", "n = ", "2026-12-02"} {
			if !bytes.Contains(b, []byte(s)) {
				t.Errorf("%s does not state %q", w, s)
			}
		}
	}
	if i, j := strings.Index(md, "](plots/fs-p50.svg)"), strings.Index(md, "\n## scale"); i < 0 || j < 0 || i > j {
		t.Errorf("the fs figure is not in the fs section")
	}
	if !strings.Contains(md, "### By tree depth") || !strings.Contains(md, "| 400 | ") || !strings.Contains(md, "(VmRSS 2058 MiB)") {
		t.Errorf("the scale section has no summary tables:\n%s", md)
	}
	md2, svgs2 := read()
	if md2 != md {
		t.Error("the markdown differs between two runs on the same inputs")
	}
	for _, w := range want {
		if !bytes.Equal(svgs[w], svgs2[w]) {
			t.Errorf("%s differs between two runs on the same inputs", w)
		}
	}
}

func TestLogTicks(t *testing.T) {
	var got []float64
	for _, tk := range (logTicks{}).Ticks(0.5, 30) {
		got = append(got, tk.Value)
	}
	if want := []float64{0.5, 1, 2, 5, 10, 20}; len(got) != len(want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	if n := len((logTicks{}).Ticks(0.1, 10000)); n != 6 {
		t.Fatalf("over five decades: %d ticks, want the 6 powers of ten", n)
	}
}
