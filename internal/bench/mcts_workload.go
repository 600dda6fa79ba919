package bench

// The mcts bench's workloads, and each row's share of trajectory time spent on state.
//
// jsonlib (CPython's json package, ~0.5 MB) is cheap to copy, so it says little about the
// repositories agents work in; django is SWE-bench-sized: Django 4.2's repository (git,
// ~6,700 source files), its own test suite run by tests/runtests.py on sqlite, and the
// Python environment the tests need, all in the workspace (62 MB, ~7,700 files, prepared
// by scripts/setup.sh from Debian's packages: workload/prepare_django.py).

import (
	"fmt"
	"math"
	"strings"
)

// Workloads of the mcts bench.
const (
	MCTSJSONLib = "jsonlib"
	MCTSDjango  = "django"
)

// MCTSWorkloads are the workloads `bench mcts --workload` takes.
var MCTSWorkloads = []string{MCTSJSONLib, MCTSDjango}

// The seed's table (SWE-bench): the share of trajectory time spent on state management
// with coupled-filesystem baselines, and with DeltaBox.
const (
	seedBeforeLo, seedBeforeHi = 0.47, 0.77
	seedAfterLo, seedAfterHi   = 0.03, 0.06
	// stateFracGoal is the target share for DeltaBox at mctsThinkGoal of think.
	stateFracGoal = 0.03
)

func (o MCTSOptions) checkWorkload() error {
	switch o.Workload {
	case MCTSJSONLib, MCTSDjango:
		return nil
	case "":
		return fmt.Errorf("no workload: want --workload %s", strings.Join(MCTSWorkloads, " or "))
	}
	return fmt.Errorf("unknown workload %q: want %s", o.Workload, strings.Join(MCTSWorkloads, " or "))
}

// shortWorkload sizes the short mode per workload: django's nodes cost a test run of
// Django's runner (~1 s) and its replays copy 62 MB per checkpoint, so its short form
// has fewer nodes to stay within CI's 3 minutes with every system.
func (o *MCTSOptions) shortWorkload() {
	if o.Workload == MCTSDjango {
		o.Expansions, o.Rollbacks = 4, 1
	}
}

// mctsStateFrac sets the row's state_frac: state_s / total_s, the share of the
// trajectory's wall time spent on state management (what the seed's table reports).
func mctsStateFrac(row *MCTSRow) {
	if row.TotalS <= 0 {
		return
	}
	if row.Info == nil {
		row.Info = map[string]any{}
	}
	row.Info["state_frac"] = math.Round(row.StateS/row.TotalS*1e5) / 1e5
}

// mctsStateFracVerdict: DeltaBox's share of trajectory time on state at 2 s of think,
// at most 3%.
func mctsStateFracVerdict(rows []MCTSRow) MCTSVerdict {
	tgt := fmt.Sprintf("deltabox state_frac <= %.0f%% at 2 s think", 100*stateFracGoal)
	for _, r := range rows {
		if r.System == MCTSDeltaBox && r.ThinkS == mctsThinkGoal && r.TotalS > 0 {
			f := r.StateS / r.TotalS
			return MCTSVerdict{Target: tgt, Measured: fmt.Sprintf("%.2f%%", 100*f), Met: f <= stateFracGoal, Checked: true}
		}
	}
	return MCTSVerdict{Target: tgt, Measured: "not run at 2 s think"}
}

// mctsSeedNote puts the rows' state_frac beside the seed's table.
func mctsSeedNote(rows []MCTSRow, workload string) string {
	var parts []string
	for _, r := range rows {
		if r.TotalS <= 0 || r.Unavailable() != "" || r.System == MCTSNegative {
			continue
		}
		parts = append(parts, fmt.Sprintf("%s at %s s think %.1f%%", r.System, thinkArg(r.ThinkS), 100*r.StateS/r.TotalS))
	}
	if len(parts) == 0 {
		return ""
	}
	return fmt.Sprintf("state_frac (state_s / total_s) on the %s workload, beside the seed's SWE-bench table (state management %.0f-%.0f%% of trajectory time with coupled-filesystem baselines, %.0f-%.0f%% with DeltaBox): %s",
		workload, 100*seedBeforeLo, 100*seedBeforeHi, 100*seedAfterLo, 100*seedAfterHi, strings.Join(parts, "; "))
}

// mctsWorkloadText is the description's sentence on what the search works on.
func mctsWorkloadText(o MCTSOptions) string {
	if o.Workload == MCTSDjango {
		return fmt.Sprintf("UCT over a deterministic scripted agent that fixes bugs put back into Django 4.2's own code (%d bug(s), seed %d; workload/djangowl.py), scored by Django's own test suite run for real (`tests/runtests.py --settings=test_sqlite` on the affected modules), in a SWE-bench-sized workspace: Django's repository (git) and the Python environment its tests need, from Debian's packages (workload/prepare_django.py; the workload's README gives the sources, their sha256 and its size)", o.Bugs, o.Seed)
	}
	return fmt.Sprintf("UCT over a deterministic scripted agent that fixes bugs injected into CPython's own json package (%d bug(s), seed %d), scored by CPython's own tests run for real", o.Bugs, o.Seed)
}

// mctsBenchName is the File's bench: "mcts" for jsonlib (the section the summary
// reads), "mcts-django" for django (a section of its own in the report).
func mctsBenchName(o MCTSOptions) string {
	if o.Workload == MCTSDjango {
		return "mcts-django"
	}
	return "mcts"
}

// mctsWorkloadInfo copies the workload's size, as examples/mcts.py recorded it from
// the workload's manifest, into DeltaBox's row: files and bytes, and for django the
// environment's apart.
func mctsWorkloadInfo(row *MCTSRow, tr *mctsTrajectory) {
	if len(tr.Summary.Tree) > 0 {
		row.Info["tree"] = tr.Summary.Tree
	}
	w, _ := tr.Config["workload"].(map[string]any)
	if w == nil {
		return
	}
	row.Info["workload"] = w["name"]
	row.Info["workload_files"] = w["files"]
	row.Info["workload_bytes"] = w["bytes"]
	if sz, _ := w["size"].(map[string]any); sz != nil {
		for _, k := range []string{"repo_files", "repo_bytes", "env_files", "env_bytes", "git_bytes", "pyc_files", "pyc_bytes"} {
			if v, ok := sz[k]; ok {
				row.Info["workload_"+k] = v
			}
		}
	}
}
