package bench

import (
	"strings"
	"testing"
)

// TestExecSummary: the exec bench's target (bash call p50 within 2 ms of python's) and
// headlines, with podman's rows unavailable and why.
func TestExecSummary(t *testing.T) {
	r := func(sys, op string, p50 float64) Row { return Row{System: sys, Op: op, P50: p50, P99: p50 * 2, N: 10} }
	for _, c := range []struct {
		bash    float64
		verdict string
	}{{0.9, "met"}, {2.8, "**missed**"}} {
		f := &File{Bench: "exec", Results: append([]Row{
			r(SysExecPlain, ExecOpCall, 3.1), r(SysExecBash, ExecOpCall, c.bash), r(SysExecPython, ExecOpCall, 0.7),
			r(SysExecBash, ExecOpOutLarge, 900), r(SysExecPython, ExecOpOutLarge, 800), r(SysExecPlain, ExecOpOutLarge, 300),
		}, UnavailableRows(SysExecPodman, 0, "podman is not installed", ExecOpCall, ExecOpOutLarge)...)}
		md := Markdown([]*File{f}, []string{"exec.json"})
		for _, want := range []string{
			"| bash session call p50 <= python session call p50 + 2 ms | " + fmtMS(c.bash) + " ms vs 0.700 ms",
			"ms) | " + c.verdict + " | [exec](#exec) |",
			"| a trivial command (true) | bash session " + fmtMS(c.bash) + " ms; python session 0.700 ms; exec 3.100 ms | podman exec unavailable: podman is not installed | [exec](#exec) |",
			"| a command printing 100 MB | bash session 900.0 ms; python session 800.0 ms; exec 300.0 ms |",
			"| podman-exec | call | unavailable: podman is not installed |",
		} {
			if !strings.Contains(md, want) {
				t.Errorf("bash %v: the report lacks\n%s\nin\n%s", c.bash, want, md)
			}
		}
	}
}

// The bench's outputs are lines of 128 bytes, so that 1 MiB holds whole lines.
func TestExecLine(t *testing.T) {
	if len(execLine) != 127 {
		t.Fatalf("execLine is %d bytes, want 127 (and a newline)", len(execLine))
	}
}
