package bench

import (
	"fmt"
	"math"
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

	b.WriteString("\n### Results\n\nSeconds. `Commands (isolated)` is the same commands' time in the isolated reference run (the overhead's baseline); `Own commands` is their time in this row's run. `Overhead` = (total - think - commands (isolated)) / total; `State / total` is the state-management time alone over the total, measured directly.\n\n")
	b.WriteString("| System | Think per expansion | Total | Think | State | Commands (isolated) | Own commands | Overhead | State / total | Scores match |\n|---|--:|--:|--:|--:|--:|--:|--:|--:|---|\n")
	for _, r := range f.MCTS {
		if e, ok := r.Info["error"]; ok {
			fmt.Fprintf(b, "| %s | %s | failed: %s | | | | | | | false |\n", r.System, thinkArg(r.ThinkS), cell(fmt.Sprint(e)))
			continue
		}
		if why := r.Unavailable(); why != "" {
			fmt.Fprintf(b, "| %s | %s | unavailable: %s | | | | | | | - |\n", r.System, thinkArg(r.ThinkS), cell(why))
			continue
		}
		frac := "-"
		if r.TotalS > 0 {
			frac = fmt.Sprintf("%.2f%%", 100*r.StateS/r.TotalS)
		}
		fmt.Fprintf(b, "| %s | %s | %.2f | %s | %.3f | %s | %s | %.2f%% | %s | %v |\n", r.System, thinkArg(r.ThinkS), r.TotalS,
			infoNum(r.Info, "think_total_s", "%.2f"), r.StateS, infoNum(r.Info, "isolated_commands_s", "%.2f"),
			infoNum(r.Info, "own_commands_s", "%.2f"), 100*r.OverheadFrac, frac, r.ScoresMatch)
	}
	if n := mctsNoise(f.MCTS); n != "" {
		b.WriteString("\n" + n + "\n")
	}
	if n := mctsStateNote(f.MCTS); n != "" {
		b.WriteString("\n" + n + "\n")
	}

	b.WriteString("\n### State management\n\nOperations as counted and timed by each run (mean ms). A session rebuild is a fresh python session plus, for the replay systems, one call replaying the path's session code.\n\n")
	b.WriteString("| System | Think per expansion | Checkpoints | mean | Rollbacks | mean | Session rebuilds | mean | after rollback / after checkpoint |\n|---|--:|--:|--:|--:|--:|--:|--:|---|\n")
	for _, r := range f.MCTS {
		if _, ok := r.Info["error"]; ok || r.Unavailable() != "" {
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
		if r.Unavailable() != "" {
			continue // its reason is in the results table
		}
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

// mctsNoise says how much the commands' own time varied between the rows' runs, and
// what that does to the overhead at the largest think time ("" if it cannot tell).
func mctsNoise(rows []MCTSRow) string {
	lo, hi, dev := math.Inf(1), math.Inf(-1), 0.0
	var iso, total, think float64
	for _, r := range rows {
		own, ok1 := r.Info["own_commands_s"].(float64)
		ref, ok2 := r.Info["isolated_commands_s"].(float64)
		if !ok1 || !ok2 {
			continue
		}
		lo, hi, iso = math.Min(lo, own), math.Max(hi, own), ref
		dev = math.Max(dev, math.Abs(own-ref))
		if r.System == MCTSDeltaBox && r.ThinkS >= think {
			think, total = r.ThinkS, r.TotalS
		}
	}
	if math.IsInf(lo, 1) || total <= 0 {
		return ""
	}
	return fmt.Sprintf("The same commands took %.2f to %.2f s in the rows' runs, %.2f s in the reference run: on this machine their time varies by up to %.2f s between runs (other work, caches), which alone moves `Overhead` by up to %.1f points at %s s think (DeltaBox's total there: %.1f s). `State` and `State / total` are measured directly and do not depend on it.",
		lo, hi, iso, dev, 100*dev/total, thinkArg(think), total)
}

// mctsStateNote compares, per operation, DeltaBox's state management with
// copytree+replay's at the first think time both ran ("" if they did not).
func mctsStateNote(rows []MCTSRow) string {
	for _, d := range rows {
		if d.System != MCTSDeltaBox {
			continue
		}
		for _, c := range rows {
			if c.System != MCTSCopytree || c.ThinkS != d.ThinkS {
				continue
			}
			ent, ok1 := c.Info["workspace_entries"].(float64)
			byt, ok2 := c.Info["workspace_bytes"].(float64)
			if !ok1 || !ok2 {
				return ""
			}
			return fmt.Sprintf("Per operation at %s s think: a DeltaBox checkpoint took %s ms and a rollback %s ms (mean, files and the python session's process); copytree+replay's checkpoint took %s ms, its rollback %s ms plus %s ms to rebuild the session, on a workspace of %.0f entries and %.0f KiB.",
				thinkArg(d.ThinkS), infoNum(d.Info, "checkpoint_mean_ms", "%.1f"), infoNum(d.Info, "rollback_mean_ms", "%.1f"),
				infoNum(c.Info, "checkpoint_mean_ms", "%.1f"), infoNum(c.Info, "rollback_mean_ms", "%.1f"), infoNum(c.Info, "replay_mean_ms", "%.1f"),
				ent, byt/1024)
		}
	}
	return ""
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
		if why := r.Unavailable(); why != "" {
			fmt.Fprintf(&b, "%-18s %6s  unavailable: %s\n", r.System, thinkArg(r.ThinkS), why)
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
