package bench

import (
	"strings"
	"testing"
)

func TestScaleSystemNames(t *testing.T) {
	for _, c := range []struct {
		p    ScalePoint
		name string
	}{
		{ScalePoint{"depth", 1}, "deltabox-depth1"},
		{ScalePoint{"depth", 400}, "deltabox-depth400"},
		{ScalePoint{"ws", 10}, "deltabox-ws10mb"},
		{ScalePoint{"ws", 1024}, "deltabox-ws1gb"},
		{ScalePoint{"ws", 4096}, "deltabox-ws4gb"},
		{ScalePoint{"rss", 1536}, "deltabox-rss1536mb"},
		{ScalePoint{"rss", 2048}, "deltabox-rss2gb"},
	} {
		if got := c.p.system(); got != c.name {
			t.Errorf("%+v: got %q, want %q", c.p, got, c.name)
		}
		p, ok := ParseScaleSystem(c.name)
		if !ok || p != c.p {
			t.Errorf("parse %q: got %+v %v, want %+v", c.name, p, ok, c.p)
		}
	}
	if p, ok := ParseScaleSystem("deltabox-ws4GB"); !ok || p != (ScalePoint{"ws", 4096}) { // files before 2026-12-03
		t.Errorf("parse deltabox-ws4GB: got %+v %v", p, ok)
	}
	for _, bad := range []string{"deltabox", "deltabox-depth10MB", "deltabox-ws10", "cp-reflink", "deltabox-rssMB", "deltabox-ws10KB"} {
		if p, ok := ParseScaleSystem(bad); ok {
			t.Errorf("parse %q: got %+v, want no point", bad, p)
		}
	}
}

func TestScaleOptionsCheck(t *testing.T) {
	if err := DefaultScaleOptions().Check(); err != nil {
		t.Fatalf("defaults: %v", err)
	}
	for _, c := range []struct {
		edit func(*ScaleOptions)
		want string
	}{
		{func(o *ScaleOptions) { o.Depths = []int{10, 5} }, "increasing"},
		{func(o *ScaleOptions) { o.Depths = []int{MaxScaleDepth + 1} }, "depth"},
		{func(o *ScaleOptions) { o.Samples = 0 }, "samples"},
		{func(o *ScaleOptions) { o.RSSMB = []int{0} }, ">= 1 MiB"},
		{func(o *ScaleOptions) { o.Depths, o.WorkspacesMB, o.RSSMB = nil, nil, nil }, "nothing to measure"},
	} {
		o := DefaultScaleOptions()
		c.edit(&o)
		if err := o.Check(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("want an error about %q, got %v", c.want, err)
		}
	}
}

func TestScaleRows(t *testing.T) {
	var ss []opSample
	for i := 1; i <= 50; i++ {
		ss = append(ss, opSample{wall: float64(i), withExec: float64(i) + 5, daemon: float64(i) / 2, depth: 100, fast: i%2 == 0, mounted: true,
			phases: map[string]int64{"mount": int64(i)}})
	}
	rows := scaleRows(ScalePoint{"depth", 100}, "restore", ss, scaleRsCall)
	if len(rows) != 2 {
		t.Fatalf("got %d rows", len(rows))
	}
	r, e := rows[0], rows[1]
	if r.System != "deltabox-depth100" || r.Op != "restore" || r.N != 50 || r.P50 != 25 || r.P99 != 50 || r.Layers == nil || r.Layers.Min != 100 {
		t.Fatalf("restore row: %+v", r)
	}
	if r.Info["warm"] != 25 || r.Info["mounted"] != 50 || r.Info["daemon_p50_ms"] != 12.5 {
		t.Fatalf("restore info: %v", r.Info)
	}
	if e.Op != "restore+exec" || e.P50 != 30 || len(e.Commands) != 2 || e.Commands[0] != scaleRsCall || e.Commands[1] != scaleExCall {
		t.Fatalf("restore+exec row: %+v", e)
	}
	if rows := scaleRows(ScalePoint{"rss", 10}, "checkpoint", ss, scaleCkCall); rows[0].Info["prepared"] != 25 || rows[0].System != "deltabox-rss10mb" {
		t.Fatalf("checkpoint row: %+v", rows[0])
	}
	if scaleRows(ScalePoint{"ws", 10}, "restore", nil, scaleRsCall) != nil {
		t.Fatal("rows of no samples")
	}
}

// TestWorkspaceTargetNote checks the 1.5x target between the largest and the smallest
// workspace's restore p50, met and missed, and says nothing with one size.
func TestWorkspaceTargetNote(t *testing.T) {
	rows := []Row{
		{System: "deltabox-ws10mb", Op: "restore", P50: 0.3},
		{System: "deltabox-ws10mb", Op: "checkpoint", P50: 9},
		{System: "deltabox-ws4gb", Op: "restore", P50: 0.42},
		{System: "deltabox-ws1gb", Op: "restore", P50: 5},
		{System: "deltabox-rss2gb", Op: "restore", P50: 50},
	}
	if got, want := workspaceTargetNote(rows), "target restore p50 at the largest workspace (4gb) within 1.5x of the smallest's (10mb): met (0.420 vs 0.300 ms: 1.40x)"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
	rows[2].P50 = 0.46
	if got := workspaceTargetNote(rows); !strings.Contains(got, "MISSED (0.460 vs 0.300 ms: 1.53x)") {
		t.Errorf("missed: %q", got)
	}
	if got := workspaceTargetNote(rows[:2]); got != "" {
		t.Errorf("one size: %q", got)
	}
}
