package bench

import (
	"context"
	mrand "math/rand"
	"os/exec"
	"strings"
	"testing"
	"time"
)

func TestLatencyOptionsValidate(t *testing.T) {
	if err := DefaultLatencyOptions().Validate(); err != nil {
		t.Fatalf("defaults: %v", err)
	}
	for name, f := range map[string]func(*LatencyOptions){
		"step larger than heap":   func(o *LatencyOptions) { o.StepMB = o.HeapMB + 1 },
		"tree smaller than chain": func(o *LatencyOptions) { o.MaxNodes = o.Chain },
		"unknown baseline":        func(o *LatencyOptions) { o.Baselines = []string{"cp"} },
		"no baseline restores":    func(o *LatencyOptions) { o.BaselineRestores = 0 },
	} {
		o := DefaultLatencyOptions()
		f(&o)
		if o.Validate() == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

func TestLatPyStr(t *testing.T) {
	for in, want := range map[string]string{"'c001 0badf00d'\n": "c001 0badf00d", `"x"`: "x", "12\n": "12", "'": "'"} {
		if got := latPyStr(in); got != want {
			t.Errorf("latPyStr(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestLatReplayCode(t *testing.T) {
	o := DefaultLatencyOptions()
	got := o.replayCode([]latStep{{3, "c001"}, {9, "b0002"}})
	if len(got) != 3 || got[0] != o.initCode() || got[1] != `bench_step(3, "c001", 10)` || got[2] != `bench_step(9, "b0002", 10)` {
		t.Fatalf("replay code: %q", got)
	}
	if !strings.HasSuffix(got[0], "bench_init(1, 50, 1048576)") {
		t.Fatalf("init code ends with %q", got[0][len(got[0])-40:])
	}
}

func TestLatPickLeafSparesHeadRootAndInnerNodes(t *testing.T) {
	root := &latNode{id: "root", kids: 2}
	a := &latNode{id: "a", parent: root, kids: 1}
	b := &latNode{id: "b", parent: root}
	c := &latNode{id: "c", parent: a}
	pool := []*latNode{root, a, b, c}
	rng := mrand.New(mrand.NewSource(1))
	for i := 0; i < 50; i++ {
		if k := latPickLeaf(pool, c, root, rng); k != 2 {
			t.Fatalf("picked %d (%s), want b", k, pool[k].id)
		}
	}
	if k := latPickLeaf([]*latNode{root, c}, c, root, rng); k != -1 {
		t.Fatalf("picked %d with no removable leaf", k)
	}
}

func TestLatRestoreRatios(t *testing.T) {
	rows := []Row{
		{System: SysDeltaBox, Op: "restore", P50: 2},
		{System: SysDeltaBox, Op: "restore+exec", P50: 4},
		{System: SysCRIU, Op: "restore", P50: 100},
	}
	call, withExec, ok := latRestoreRatios(rows)
	if !ok || call != 50 || withExec != 25 {
		t.Fatalf("ratios %v %v %v", call, withExec, ok)
	}
	if _, _, ok := latRestoreRatios(rows[:2]); ok {
		t.Fatal("a ratio without a criu row")
	}
}

// TestLatWorkloadReplays: the host driver runs the heap code; replaying a node's path
// in a fresh process rebuilds the same heap, and another path gives another heap.
func TestLatWorkloadReplays(t *testing.T) {
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("no python3")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	o := DefaultLatencyOptions()
	o.HeapMB, o.StepMB = 4, 1
	h := &latHost{python: py, sock: "deltabox-test-" + randHex(4), dir: t.TempDir()}
	if err := h.start(ctx); err != nil {
		t.Fatal(err)
	}
	defer h.kill()
	path := []latStep{{1, "c001"}, {2, "c002"}}
	var live string
	for _, code := range o.replayCode(path) {
		out, err := h.call(ctx, code)
		if err != nil {
			t.Fatal(err)
		}
		live = latPyStr(out)
	}
	if !strings.HasPrefix(live, "c002 ") {
		t.Fatalf("digest %q", live)
	}
	if _, err := h.call(ctx, "1/0"); err == nil || !strings.Contains(err.Error(), "ZeroDivisionError") {
		t.Fatalf("failing call: %v", err)
	}
	if err := h.pingLabel(ctx, "c002"); err != nil {
		t.Fatalf("after a failing call: %v", err)
	}
	h.kill()
	replay := func(p []latStep) string {
		if err := h.start(ctx); err != nil {
			t.Fatal(err)
		}
		defer h.kill()
		var out string
		for _, code := range o.replayCode(p) {
			if out, err = h.call(ctx, code); err != nil {
				t.Fatal(err)
			}
		}
		return latPyStr(out)
	}
	if got := replay(path); got != live {
		t.Fatalf("replay gave %q, the live process %q", got, live)
	}
	other := replay([]latStep{{1, "c001"}, {3, "c002"}})
	if other == live {
		t.Fatalf("another path gave the same heap %q", other)
	}
}
