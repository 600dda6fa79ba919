package bench

import (
	"fmt"
	"strings"
)

func init() { sectionWriters["mcts"] = writeMCTSSection }

// writeMCTSSection renders `bench mcts`'s rows: the targets, one table of the runs,
// the state-management operations, the commands of each system and the details.
func writeMCTSSection(b *strings.Builder, f *File) {
	if len(f.MCTS) == 0 {
		return
	}
	b.WriteString("\n### Targets\n\n| Target | Measured | Result |\n|---|---|---|\n")
	for _, v := range MCTSVerdicts(f.MCTS) {
		res := "-"
		if v.Checked {
			res = "met"
			if !v.Met {
				res = "**missed**"
			}
		}
		fmt.Fprintf(b, "| %s | %s | %s |\n", cell(v.Target), cell(v.Measured), res)
	}

	b.WriteString("\n### Results\n\nSeconds. `commands` is the same commands' time in the isolated reference run (the overhead's baseline); `own commands` is their time in this row's run.\n\n")
	b.WriteString("| System | Think per expansion | Total | Think | State | Commands (isolated) | Own commands | Overhead | Scores match |\n|---|--:|--:|--:|--:|--:|--:|--:|---|\n")
	for _, r := range f.MCTS {
		if e, ok := r.Info["error"]; ok {
			fmt.Fprintf(b, "| %s | %s | failed: %s | | | | | | false |\n", r.System, thinkArg(r.ThinkS), cell(fmt.Sprint(e)))
			continue
		}
		fmt.Fprintf(b, "| %s | %s | %.2f | %s | %.3f | %s | %s | %.2f%% | %v |\n", r.System, thinkArg(r.ThinkS), r.TotalS,
			infoNum(r.Info, "think_total_s", "%.2f"), r.StateS, infoNum(r.Info, "isolated_commands_s", "%.2f"),
			infoNum(r.Info, "own_commands_s", "%.2f"), 100*r.OverheadFrac, r.ScoresMatch)
	}

	b.WriteString("\n### State management\n\nOperations as counted and timed by each run (mean ms). A session rebuild is a fresh python session plus, for the replay systems, one call replaying the path's session code.\n\n")
	b.WriteString("| System | Think per expansion | Checkpoints | mean | Rollbacks | mean | Session rebuilds | mean | after rollback / after checkpoint |\n|---|--:|--:|--:|--:|--:|--:|--:|---|\n")
	for _, r := range f.MCTS {
		if _, ok := r.Info["error"]; ok {
			continue
		}
		after := "-"
		if _, ok := r.Info["replay_n"]; ok {
			after = fmt.Sprintf("%s / %s", infoNum(r.Info, "session_rebuilds_after_rollback", "%.0f"), infoNum(r.Info, "session_rebuilds_after_checkpoint", "%.0f"))
		}
		fmt.Fprintf(b, "| %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", r.System, thinkArg(r.ThinkS),
			infoNum(r.Info, "checkpoint_n", "%.0f"), infoNum(r.Info, "checkpoint_mean_ms", "%.2f"),
			infoNum(r.Info, "rollback_n", "%.0f"), infoNum(r.Info, "rollback_mean_ms", "%.2f"),
			infoNum(r.Info, "replay_n", "%.0f"), infoNum(r.Info, "replay_mean_ms", "%.2f"), after)
	}

	b.WriteString("\n### Commands\n\nThe state-management commands of each system (N: a node's id, C: its commit, {id}: the sandbox).\n\n")
	seen := map[string]bool{}
	for _, r := range f.MCTS {
		if seen[r.System] || len(r.Commands) == 0 {
			continue
		}
		seen[r.System] = true
		fmt.Fprintf(b, "- %s:\n", r.System)
		for _, c := range r.Commands {
			fmt.Fprintf(b, "  - %s\n", c)
		}
	}

	b.WriteString("\n### Details\n\n")
	for _, r := range f.MCTS {
		var kv []string
		for _, k := range sortedKeys(r.Info) {
			v := compact(r.Info[k])
			if k == "command" {
				v = "`" + v + "`"
			}
			kv = append(kv, k+" "+v)
		}
		fmt.Fprintf(b, "- %s, %s s think: %s\n", r.System, thinkArg(r.ThinkS), cell(strings.Join(kv, "; ")))
	}
}

// infoNum formats a numeric Info value ("-" when absent).
func infoNum(info map[string]any, key, format string) string {
	switch v := info[key].(type) {
	case float64:
		return fmt.Sprintf(format, v)
	case int:
		return fmt.Sprintf(format, float64(v))
	}
	return "-"
}

// FormatMCTS is the rows and targets as plain text, for the terminal.
func FormatMCTS(f *File) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%-18s %6s %9s %9s %9s %10s %9s  %s\n", "system", "think", "total_s", "think_s", "state_s", "isolated_s", "overhead", "scores_match")
	for _, r := range f.MCTS {
		if e, ok := r.Info["error"]; ok {
			fmt.Fprintf(&b, "%-18s %6s  failed: %v\n", r.System, thinkArg(r.ThinkS), e)
			continue
		}
		fmt.Fprintf(&b, "%-18s %6s %9.2f %9s %9.3f %10s %8.2f%%  %v\n", r.System, thinkArg(r.ThinkS), r.TotalS,
			infoNum(r.Info, "think_total_s", "%.2f"), r.StateS, infoNum(r.Info, "isolated_commands_s", "%.2f"), 100*r.OverheadFrac, r.ScoresMatch)
	}
	for _, v := range MCTSVerdicts(f.MCTS) {
		res := "not checked"
		if v.Checked {
			res = "met"
			if !v.Met {
				res = "MISSED"
			}
		}
		fmt.Fprintf(&b, "target: %s: %s (%s)\n", v.Target, res, v.Measured)
	}
	return b.String()
}
