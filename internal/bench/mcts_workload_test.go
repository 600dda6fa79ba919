package bench

import (
	"strings"
	"testing"
)

func TestMCTSWorkloadOptions(t *testing.T) {
	o := DefaultMCTSOptions()
	if o.Workload != MCTSJSONLib || mctsBenchName(o) != "mcts" {
		t.Errorf("default workload %q, bench %q", o.Workload, mctsBenchName(o))
	}
	o.Workload = MCTSDjango
	if err := o.Check(); err != nil {
		t.Fatal(err)
	}
	o.ShortMCTS()
	if o.Expansions != 4 || o.Rollbacks != 1 || mctsBenchName(o) != "mcts-django" {
		t.Errorf("django short: %d expansions, %d rollbacks, bench %q", o.Expansions, o.Rollbacks, mctsBenchName(o))
	}
	o.Workload = "sympy"
	if err := o.Check(); err == nil || !strings.Contains(err.Error(), "jsonlib or django") {
		t.Errorf("an unknown workload: %v", err)
	}
}

func TestMCTSStateFrac(t *testing.T) {
	rows := []MCTSRow{
		{System: MCTSDeltaBox, ThinkS: 2, TotalS: 100, StateS: 2.5},
		{System: MCTSCopytree, ThinkS: 2, TotalS: 200, StateS: 120},
		{System: MCTSNegative, ThinkS: 2, TotalS: 90, StateS: 1},
	}
	for i := range rows {
		mctsStateFrac(&rows[i])
	}
	if f := rows[1].Info["state_frac"]; f != 0.6 {
		t.Errorf("state_frac %v, want 0.6", f)
	}
	v := mctsStateFracVerdict(rows)
	if !v.Checked || !v.Met || v.Measured != "2.50%" {
		t.Errorf("verdict %+v", v)
	}
	rows[0].StateS = 3.5
	if v := mctsStateFracVerdict(rows); !v.Checked || v.Met {
		t.Errorf("3.5%% met the 3%% target: %+v", v)
	}
	if v := mctsStateFracVerdict(rows[1:]); v.Checked {
		t.Errorf("checked without a deltabox row at 2 s: %+v", v)
	}
	n := mctsSeedNote(rows, MCTSDjango)
	if !strings.Contains(n, "47-77%") || !strings.Contains(n, "copytree+replay at 2 s think 60.0%") || strings.Contains(n, MCTSNegative+" at") {
		t.Errorf("note: %s", n)
	}
	f := &File{Bench: "mcts-django", MCTS: rows}
	md := Markdown([]*File{f}, []string{"mcts-django.json"})
	if !strings.Contains(md, "## mcts-django") || !strings.Contains(md, "### Beside the seed's table") || !strings.Contains(md, "| copytree+replay | 2 | 60.00% | 47-77% (coupled filesystem) |") {
		t.Errorf("report:\n%s", md)
	}
}
