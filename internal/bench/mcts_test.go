package bench

import (
	"encoding/json"
	"math"
	"strings"
	"testing"
)

// A trajectory as examples/mcts.py writes it (the fields the bench reads).
const sampleTrajectory = `{
 "config": {"think": 2.0, "state_points": 2.0},
 "task": {"id": "seed0-1bug", "bugs": ["decoder.colno"]},
 "nodes": [
  {"id": 0, "parent": null, "path": [], "score": 38.0, "tests_passed": 36, "state": 1.0},
  {"id": 1, "parent": 0, "path": ["a/fix"], "score": 40.0, "tests_passed": 38, "state": 1.0},
  {"id": 2, "parent": 1, "path": ["a/fix", "b/d1"], "score": 37.0, "tests_passed": 35, "state": 1.0},
  {"id": 3, "parent": 0, "path": ["b/d2"], "score": 36.0, "tests_passed": 34, "state": 1.0}
 ],
 "events": [
  {"type": "expand", "node": 1, "parent": 0},
  {"type": "expand", "node": 2, "parent": 1},
  {"type": "rollback", "node": 0, "src": 2},
  {"type": "expand", "node": 3, "parent": 0}
 ],
 "summary": {
  "search_seconds": 10.0, "expansions": 3, "rollbacks": 1, "fix_found": true, "fix_expansion": 1,
  "best_score": 40.0, "max_depth": 2, "state_intact_nodes": 3,
  "wall_seconds": 11.5,
  "timers": {
   "think": {"seconds": 6.0, "count": 3, "mean_ms": 2000},
   "checkpoint": {"seconds": 0.04, "count": 4, "mean_ms": 10},
   "restore": {"seconds": 0.01, "count": 1, "mean_ms": 10},
   "edit": {"seconds": 0.3, "count": 3, "mean_ms": 100},
   "session": {"seconds": 0.1, "count": 3, "mean_ms": 33},
   "tests": {"seconds": 3.9, "count": 4, "mean_ms": 975}
  },
  "search_timers": {
   "think": {"seconds": 6.0, "count": 3},
   "checkpoint": {"seconds": 0.04, "count": 4},
   "restore": {"seconds": 0.01, "count": 1},
   "edit": {"seconds": 0.3, "count": 3},
   "session": {"seconds": 0.1, "count": 3},
   "tests": {"seconds": 3.0, "count": 3}
  }
 }
}`

func sampleRef() *mctsReplay {
	return &mctsReplay{System: MCTSIsolated, CommandsS: 3.2, Nodes: []mctsNode{
		{ID: 0, Score: 38}, {ID: 1, Score: 40}, {ID: 2, Score: 37}, {ID: 3, Score: 36}}}
}

func TestMCTSDeltaBoxRow(t *testing.T) {
	var tr mctsTrajectory
	if err := json.Unmarshal([]byte(sampleTrajectory), &tr); err != nil {
		t.Fatal(err)
	}
	row, think := mctsDeltaBoxRow(&tr, 2, "python3 examples/mcts.py")
	if row.System != MCTSDeltaBox || row.ThinkS != 2 || row.TotalS != 10 || think != 6 {
		t.Fatalf("row %+v, think %v", row, think)
	}
	if math.Abs(row.StateS-0.05) > 1e-9 {
		t.Errorf("state_s %v, want checkpoint + restore = 0.05", row.StateS)
	}
	mctsFinish(&row, think, sampleRef(), tr.Nodes)
	if !row.ScoresMatch {
		t.Errorf("scores should match: %+v", row.Info)
	}
	// (10 - 6 - 3.2) / 10
	if math.Abs(row.OverheadFrac-0.08) > 1e-9 {
		t.Errorf("overhead %v, want 0.08", row.OverheadFrac)
	}
	if row.Info["rollback_n"] != 1 || row.Info["own_commands_s"] != 3.4 || row.Info["checkpoint_mean_ms"] != 10.0 || row.Info["setup_s"] != 1.5 {
		t.Errorf("info %v", row.Info)
	}
}

func TestMCTSScores(t *testing.T) {
	ref := sampleRef().Nodes
	ok, n, _ := mctsScores(ref, ref)
	if !ok || n != 0 {
		t.Errorf("identical scores: ok %v, %d bad", ok, n)
	}
	got := append([]mctsNode(nil), ref...)
	got[2].Score = 35
	ok, n, bad := mctsScores(ref, got)
	if ok || n != 1 || len(bad) != 1 || bad[0] != 2 {
		t.Errorf("one changed score: ok %v, %d bad %v", ok, n, bad)
	}
	ok, n, _ = mctsScores(ref, ref[:3]) // a node missing
	if ok || n != 1 {
		t.Errorf("a missing node: ok %v, %d bad", ok, n)
	}
	ok, _, _ = mctsScores(ref, append(append([]mctsNode(nil), ref...), mctsNode{ID: 9}))
	if ok {
		t.Errorf("an extra node must not match")
	}
	if ok, _, _ := mctsScores(nil, nil); ok {
		t.Errorf("no reference nodes must not match")
	}
}

func TestMCTSFingerprint(t *testing.T) {
	var a, b mctsTrajectory
	json.Unmarshal([]byte(sampleTrajectory), &a)
	json.Unmarshal([]byte(sampleTrajectory), &b)
	if a.fingerprint() != b.fingerprint() {
		t.Fatal("same trajectory, different fingerprints")
	}
	b.Nodes[0].Score = 1 // scores are not part of the shape
	b.Summary.SearchSeconds = 99
	if a.fingerprint() != b.fingerprint() {
		t.Error("scores or timings changed the fingerprint")
	}
	b.Events[2].Node = 1
	if a.fingerprint() == b.fingerprint() {
		t.Error("a different rollback target kept the fingerprint")
	}
	json.Unmarshal([]byte(sampleTrajectory), &b)
	b.Nodes[3].Path = []string{"b/d3"}
	if a.fingerprint() == b.fingerprint() {
		t.Error("a different path kept the fingerprint")
	}
}

func TestMCTSReplayRow(t *testing.T) {
	res := &mctsReplay{System: MCTSCopytree, ThinkS: 2, TotalS: 12, ThinkTotalS: 6, StateS: 1.5, CommandsS: 3.3,
		Commands: []string{"cp"}, Info: map[string]any{"sandbox": "sb-1", "checkpoint_n": 4.0},
		Nodes: sampleRef().Nodes}
	row, think := mctsReplayRow(res, "python3 -m workload.baselines")
	mctsFinish(&row, think, sampleRef(), res.Nodes)
	if _, ok := row.Info["sandbox"]; ok {
		t.Error("the replay's sandbox id is not a result")
	}
	if !row.ScoresMatch || math.Abs(row.OverheadFrac-(12-6-3.2)/12) > 1e-4 {
		t.Errorf("row %+v", row)
	}
}

func TestMCTSVerdicts(t *testing.T) {
	rows := []MCTSRow{
		{System: MCTSDeltaBox, ThinkS: 0, StateS: 1, OverheadFrac: 0.1, ScoresMatch: true},
		{System: MCTSCopytree, ThinkS: 0, StateS: 30, ScoresMatch: true},
		{System: MCTSNegative, ThinkS: 0, StateS: 3, ScoresMatch: false},
		{System: MCTSDeltaBox, ThinkS: 2, StateS: 1, OverheadFrac: 0.02, ScoresMatch: true},
		{System: MCTSCopytree, ThinkS: 2, StateS: 10, ScoresMatch: true},
	}
	v := MCTSVerdicts(rows)
	want := []struct {
		prefix string
		met    bool
	}{
		{"deltabox overhead <= 3% at 2 s", true},
		{"deltabox state time <= 1/20 of copytree+replay's, 0 s", true},
		{"deltabox state time <= 1/20 of copytree+replay's, 2 s", false},
		{"every system's node scores", true},
		{"the negative control", true},
	}
	if len(v) != len(want) {
		t.Fatalf("%d verdicts, want %d: %+v", len(v), len(want), v)
	}
	for i, w := range want {
		if !strings.HasPrefix(v[i].Target, w.prefix) || v[i].Met != w.met || !v[i].Checked {
			t.Errorf("verdict %d: %+v, want %q met=%v", i, v[i], w.prefix, w.met)
		}
	}

	// A negative control that matches, a system that does not, no 2 s run.
	rows = []MCTSRow{
		{System: MCTSDeltaBox, ThinkS: 0, StateS: 1, ScoresMatch: true},
		{System: MCTSGitReset, ThinkS: 0, StateS: 1, ScoresMatch: false},
		{System: MCTSNegative, ThinkS: 0, ScoresMatch: true},
	}
	v = MCTSVerdicts(rows)
	if v[0].Checked {
		t.Errorf("no 2 s run, yet the overhead target is checked: %+v", v[0])
	}
	if v[1].Checked {
		t.Errorf("no copytree row, yet the ratio is checked: %+v", v[1])
	}
	if v[2].Met || !strings.Contains(v[2].Measured, "git-reset+replay at 0 s") {
		t.Errorf("scores verdict %+v", v[2])
	}
	if v[3].Met {
		t.Errorf("a matching negative control must miss: %+v", v[3])
	}
}

func TestMCTSReport(t *testing.T) {
	f := &File{Bench: "mcts", MCTS: []MCTSRow{
		{System: MCTSDeltaBox, ThinkS: 2, TotalS: 210, StateS: 1.2, OverheadFrac: 0.01, ScoresMatch: true,
			Commands: []string{"POST checkpoint"}, Info: map[string]any{"think_total_s": 200.0, "isolated_commands_s": 8.0, "own_commands_s": 9.0, "checkpoint_n": 101.0, "checkpoint_mean_ms": 8.5, "command": "python3 examples/mcts.py"}},
		{System: MCTSCopytree, ThinkS: 2, TotalS: 215, StateS: 6, ScoresMatch: true, Commands: []string{"cp | x"},
			Info: map[string]any{"replay_n": 49.0, "replay_mean_ms": 30.0, "session_rebuilds_after_rollback": 49.0, "isolated_commands_s": 8.0, "own_commands_s": 7.5,
				"checkpoint_mean_ms": 25.0, "rollback_mean_ms": 40.0, "workspace_entries": 132.0, "workspace_bytes": 2048.0}},
		{System: MCTSCRIUCopy, ThinkS: 2, Info: map[string]any{"error": "no CRIU"}},
	}}
	md := Markdown([]*File{f}, []string{"bench-results/mcts.json"})
	for _, want := range []string{
		"### Targets", "| deltabox overhead <= 3% at 2 s think | 1.00% | met |",
		"| deltabox | 2 | 210.00 | 200.00 | 1.200 | 8.00 | 9.00 | 1.00% | 0.57% | true |",
		"The same commands took 7.50 to 9.00 s in the rows' runs, 8.00 s in the reference run: on this machine their time varies by up to 1.00 s between runs (other work, caches), which alone moves `Overhead` by up to 0.5 points at 2 s think (DeltaBox's total there: 210.0 s).",
		"| criu+copytree | 2 | failed: no CRIU |",
		"| copytree+replay | 2 | - | 25.00 | - | 40.00 | 49 | 30.00 | 49 / - |",
		"- copytree+replay:\n  - cp | x",
		"Per operation at 2 s think: a DeltaBox checkpoint took 8.5 ms and a rollback - ms (mean, files and the python session's process); copytree+replay's checkpoint took 25.0 ms, its rollback 40.0 ms plus 30.0 ms to rebuild the session, on a workspace of 132 entries and 2 KiB.",
		"command `python3 examples/mcts.py`",
	} {
		if !strings.Contains(md, want) {
			t.Errorf("report lacks %q:\n%s", want, md)
		}
	}
	txt := FormatMCTS(f)
	if !strings.Contains(txt, "criu+copytree") || !strings.Contains(txt, "target: deltabox overhead <= 3% at 2 s think: met") {
		t.Errorf("text:\n%s", txt)
	}
}

func TestMCTSOptions(t *testing.T) {
	o := DefaultMCTSOptions()
	if err := o.Check(); err != nil {
		t.Fatal(err)
	}
	if o.Expansions != 100 || o.Rollbacks != 49 || len(o.Thinks) != 2 || len(o.Systems) != len(MCTSBaselines) {
		t.Errorf("defaults %+v", o)
	}
	o.ShortMCTS()
	if o.Expansions != 6 || o.Rollbacks != 2 || len(o.Thinks) != 1 || o.Thinks[0] != 0 {
		t.Errorf("short %+v", o)
	}
	o.Systems = []string{"rsync"}
	if o.Check() == nil {
		t.Error("an unknown system passed the check")
	}
}
