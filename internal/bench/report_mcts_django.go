package bench

import (
	"fmt"
	"strings"
)

func init() { sectionWriters["mcts-django"] = writeMCTSDjangoSection }

// writeMCTSDjangoSection renders `bench mcts --workload django`: the mcts tables, then
// the rows' state_frac beside the seed's SWE-bench table and the workload's size beside
// SWE-bench's (quoted from its documentation, not measured here).
func writeMCTSDjangoSection(b *strings.Builder, f *File) {
	writeMCTSSection(b, f)
	if len(f.MCTS) == 0 {
		return
	}
	v := mctsStateFracVerdict(f.MCTS)
	res := "-"
	if v.Checked {
		res = "met"
		if !v.Met {
			res = "**missed**"
		}
	}
	fmt.Fprintf(b, "\n### Beside the seed's table\n\nThe seed reports, on SWE-bench, state management taking %.0f-%.0f%% of trajectory time with coupled-filesystem baselines and %.0f-%.0f%% with DeltaBox. `state_frac` = state / total of each row here (the negative control apart: its scores are wrong by design).\n\n",
		100*seedBeforeLo, 100*seedBeforeHi, 100*seedAfterLo, 100*seedAfterHi)
	fmt.Fprintf(b, "Target %s: %s (%s).\n\n", v.Target, res, v.Measured)
	b.WriteString("| System | Think per expansion | state_frac | Seed's range |\n|---|--:|--:|---|\n")
	for _, r := range f.MCTS {
		if r.TotalS <= 0 || r.Unavailable() != "" || r.System == MCTSNegative {
			continue
		}
		seed := fmt.Sprintf("%.0f-%.0f%% (coupled filesystem)", 100*seedBeforeLo, 100*seedBeforeHi)
		switch r.System {
		case MCTSDeltaBox:
			seed = fmt.Sprintf("%.0f-%.0f%% (DeltaBox)", 100*seedAfterLo, 100*seedAfterHi)
		case MCTSFSReplay:
			seed = "- (DeltaBox's files without process state: not in the seed's table)"
		}
		fmt.Fprintf(b, "| %s | %s | %.2f%% | %s |\n", r.System, thinkArg(r.ThinkS), 100*r.StateS/r.TotalS, seed)
	}
	for _, r := range f.MCTS {
		if r.System != MCTSDeltaBox {
			continue
		}
		files, _ := r.Info["workload_files"].(float64)
		bytes, _ := r.Info["workload_bytes"].(float64)
		envF, _ := r.Info["workload_env_files"].(float64)
		envB, _ := r.Info["workload_env_bytes"].(float64)
		gitB, _ := r.Info["workload_git_bytes"].(float64)
		if files == 0 {
			break
		}
		b.WriteString("\n### Workload size\n\n| | Files | MB |\n|---|--:|--:|\n")
		fmt.Fprintf(b, "| this workload, with its environment | %.0f | %.1f |\n", files, bytes/1e6)
		fmt.Fprintf(b, "| this workload, without the environment (repository, its .git of %.1f MB included) | %.0f | %.1f |\n", gitB/1e6, files-envF, (bytes-envB)/1e6)
		fmt.Fprintf(b, "| SWE-bench django task (quoted, not measured) | the same code base at older commits; /testbed is a full clone (the project's history in .git) | instance images build on ~60 environment images of ~100 GB in all (SWE-bench's docker harness notes): a conda env and an OS per image, ~1.7 GB each |\n")
		b.WriteString("\nThe environment here is Django's two requirements from Debian (asgiref, sqlparse) over the image's Python; SWE-bench's is a conda environment with its own Python and more packages, and its .git holds the project's history: a copy of SWE-bench's repository and environment moves more bytes than this workspace's.\n")
		break
	}
}
