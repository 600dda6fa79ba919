package e2e

import (
	"bytes"
	"context"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"deltabox/internal/bench"
	"deltabox/internal/testutil"
)

// benchLeftovers fails t if the daemon still has sandboxes or nodes after bench name.
func benchLeftovers(t *testing.T, d *testutil.Daemon, name string) {
	t.Helper()
	tr, err := d.C.Tree(dbxCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	l, err := d.C.List(dbxCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	if len(tr.Nodes) != 0 || len(l) != 0 {
		t.Errorf("bench %s left %d nodes and %d sandboxes behind", name, len(tr.Nodes), len(l))
	}
}

// TestBenchScaleTiny runs `deltabox bench scale` with tiny settings and checks that
// every point has its rows with samples, and that the bench removed what it made.
func TestBenchScaleTiny(t *testing.T) {
	d := testutil.StartDaemon(t)
	out := filepath.Join(t.TempDir(), "scale.json")
	start := time.Now()
	cmd := testutil.Command(t, 5*time.Minute, testutil.Binary(t), "--socket", d.Socket, "bench", "scale", "--depths", "1,5", "--workspaces-mb", "10",
		"--rss-mb", "10", "--samples", "5", "--cold-samples", "2", "--small-files", "200", "--json", out)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if b, err := cmd.Output(); err != nil {
		t.Fatalf("bench scale: %v\n%s\n%s", err, b, stderr.String())
	}
	t.Logf("bench scale took %v", time.Since(start))
	f, err := bench.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	if f.Bench != "scale" || f.Description == "" {
		t.Fatalf("bench %q, description %q", f.Bench, f.Description)
	}
	got := map[string]bench.Row{}
	for _, r := range f.Results {
		got[r.System+" "+r.Op] = r
	}
	want := map[string]int{}
	for _, s := range []string{"deltabox-depth1", "deltabox-depth5", "deltabox-ws10mb"} {
		want[s+" restore-cold"], want[s+" restore-cold+exec"] = 2, 2
	}
	for _, s := range []string{"deltabox-depth1", "deltabox-depth5", "deltabox-ws10mb", "deltabox-rss10mb"} {
		for _, op := range []string{"checkpoint", "checkpoint+exec", "restore", "restore+exec"} {
			want[s+" "+op] = 5
		}
	}
	for k, n := range want {
		r, ok := got[k]
		if !ok {
			t.Errorf("no row %s", k)
			continue
		}
		if r.N != n || r.P50 <= 0 || r.P99 < r.P50 || r.Layers == nil || len(r.Commands) == 0 {
			t.Errorf("row %s: n %d (want %d), p50 %v, p99 %v, layers %v, commands %v", k, r.N, n, r.P50, r.P99, r.Layers, r.Commands)
		}
	}
	if len(got) != len(want) {
		t.Errorf("%d rows, want %d", len(got), len(want))
	}
	if l := got["deltabox-depth5 restore"].Layers; l != nil && (l.Min != 5 || l.Max != 5) {
		t.Errorf("depth 5 restores mounted %+v layers", l)
	}
	if l := got["deltabox-depth5 checkpoint"].Layers; l != nil && l.Min != 6 {
		t.Errorf("checkpoints from depth 5 made nodes of depth %+v", l)
	}
	if w := got["deltabox-depth5 restore-cold"].Info["warm"]; w != float64(0) {
		t.Errorf("cold restores found warm states: %v", w)
	}
	if v, _ := got["deltabox-rss10mb restore"].Info["session_vmrss_mb"].(float64); v < 10 {
		t.Errorf("the python session held %v MiB", v)
	}
	for _, n := range f.Notes {
		if bytes.Contains([]byte(n), []byte("daemon bug")) {
			t.Errorf("note: %s", n)
		}
	}
	benchLeftovers(t, d, "scale")
}

// TestBenchScaleInterruptedCleansUp: an interrupted bench scale still removes its
// sandboxes and nodes.
func TestBenchScaleInterruptedCleansUp(t *testing.T) {
	d := testutil.StartDaemon(t)
	cmd := testutil.Command(t, 2*time.Minute, testutil.Binary(t), "--socket", d.Socket, "bench", "scale", "--depths", "1,40", "--workspaces-mb", "",
		"--rss-mb", "", "--samples", "100000")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// Interrupt once the chain has nodes.
	deadline := time.Now().Add(20 * time.Second)
	for {
		tr, err := d.C.Tree(context.Background())
		if err == nil && len(tr.Nodes) >= 10 {
			break
		}
		if time.Now().After(deadline) {
			cmd.Process.Kill()
			cmd.Wait()
			t.Fatalf("the bench made no nodes in 20 s:\n%s", stderr.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	cmd.Process.Signal(syscall.SIGINT)
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err == nil {
			t.Fatalf("an interrupted bench exited 0:\n%s", stderr.String())
		}
	case <-time.After(30 * time.Second):
		cmd.Process.Kill()
		t.Fatalf("the bench did not end within 30 s of SIGINT:\n%s", stderr.String())
	}
	benchLeftovers(t, d, "scale")
}
