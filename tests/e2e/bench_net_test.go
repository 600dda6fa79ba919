package e2e

import (
	"bytes"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"deltabox/internal/bench"
	"deltabox/internal/testutil"
)

// TestBenchNetTiny runs `deltabox bench net` with tiny counts: the four rows have their
// samples, and the bench removed its sandbox, nodes, namespace and veth.
func TestBenchNetTiny(t *testing.T) {
	_, err := exec.LookPath("ip")
	testutil.Require(t, err == nil, "bench net needs iproute2's ip")
	d := testutil.StartDaemon(t)
	out := filepath.Join(t.TempDir(), "net.json")
	cmd := testutil.Command(t, 5*time.Minute, testutil.Binary(t), "--socket", d.Socket, "bench", "net", "--requests", "5", "--samples", "2", "--json", out)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if b, err := cmd.Output(); err != nil {
		t.Fatalf("bench net: %v\n%s\n%s", err, b, stderr.String())
	}
	f, err := bench.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]int{bench.SysNetProxy + " " + bench.NetOpRequest: 5, bench.SysNetDirect + " " + bench.NetOpRequest: 5,
		bench.SysNetAfterNet + " " + bench.NetOpCheckpt: 2, bench.SysNetNoNet + " " + bench.NetOpCheckpt: 2}
	for _, r := range f.Results {
		if n, ok := want[r.System+" "+r.Op]; !ok || r.N != n || r.P50 <= 0 {
			t.Errorf("row %s %s: n %d, p50 %v", r.System, r.Op, r.N, r.P50)
		}
		delete(want, r.System+" "+r.Op)
	}
	if len(want) != 0 {
		t.Errorf("missing rows: %v", want)
	}
	benchLeftovers(t, d, "net")
	if ns, _ := exec.Command("ip", "netns", "list").Output(); strings.Contains(string(ns), "dbxbench") {
		t.Errorf("bench net left its namespace: %s", ns)
	}
}
