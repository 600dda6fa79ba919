package bench

import (
	"fmt"
	"sort"
	"strings"
)

func init() { sectionWriters["latency"] = writeLatencyReading }

// writeLatencyReading puts the deltabox rows beside the kernel's own fork of the same
// process (the kernel-fork reference row) and lists where the daemon's time goes, from
// the results themselves, so that the reading cannot go stale.
func writeLatencyReading(b *strings.Builder, f *File) {
	rows := map[string]Row{}
	for _, r := range f.Results {
		rows[r.System+" "+r.Op] = r
	}
	fork, ok := rows[SysForkFloor+" fork"]
	if !ok {
		return
	}
	b.WriteString("\n### Reading: the kernel's fork is the floor\n\n")
	rss := "the same"
	if v, ok := fork.Info["python_rss_mb"].(float64); ok {
		rss = fmt.Sprintf("the same %.0f MB", v)
	}
	fmt.Fprintf(b, "The session's own `os.fork()` (row `kernel-fork`: %s process at the same moments) takes p50 %s ms, p95 %s ms: "+
		"the page-table copy and the anon_vma chains of a fork on these VMs (it includes CPython's at-fork handlers; the "+
		"checkpoint's `fork` phase below, a bare injected clone3 with the timer reads around it, is of the same size). Every "+
		"template checkpoint and every template restore contains one such fork, so no fork-based fast path can be faster here; "+
		"the rest is what DeltaBox adds.\n\n",
		rss, fmtMS(fork.P50), fmtMS(fork.P95))
	b.WriteString("| Operation | p50 (ms) | kernel fork p50 (ms) | rest p50 (ms) | daemon phases, p50 (µs) |\n|---|--:|--:|--:|---|\n")
	for _, op := range []string{"checkpoint", "checkpoint-answer", "restore", "restore-spare"} {
		r, ok := rows[SysDeltaBox+" "+op]
		if !ok {
			continue
		}
		fmt.Fprintf(b, "| %s | %s | %s | %s | %s |\n", op, fmtMS(r.P50), fmtMS(fork.P50), fmtMS(r.P50-fork.P50), phasesCell(r.Info["phases_p50_us"]))
	}
	if r, ok := rows[SysDeltaBox+" restore-spare"]; ok {
		fmt.Fprintf(b, "\nA `restore-spare` forks nothing on its path: its node's copies were forked and placed ahead, in a namespace "+
			"of their own ([spares](design/spares.md)), and the restore swaps them in (%v of %v served by a spare; a spare held "+
			"%v MB pss_anon p50, %v MB of it alone).\n", r.Info["from_spare"], r.Info["restores"], r.Info["spare_pss_mb_p50"], r.Info["spare_private_mb_p50"])
	}
	if _, ok := rows[SysDeltaBox+" checkpoint-answer"]; ok {
		b.WriteString("\nA `checkpoint-answer` answers before its fork (its rest is negative: it is below the floor); the fork and " +
			"the steps after it run after the answer, and the sandbox's next call waits for them (its `+exec` row).\n")
	}
	b.WriteString("\nCheckpoint `fork` is the template's clone3 (the kernel fork) with the timer and signal reads around it (one " +
		"batch of injected calls), the template's setsid and its parking; `seize` is PTRACE_SEIZE and the inspection of the stopped " +
		"process (/proc reads, PROCMAP_QUERY for its shared mappings, one injected mprotect per read-only one), its parts " +
		"`seize_hold` (the sessions' processes), `seize_others` (the rest of the PID namespace) and `seize_kstate` (the kernel " +
		"state); `move` is one batch " +
		"(setns, chdir, reopens) onto the new state. Restore `templates` takes the node's templates (held by the tracer once parked) " +
		"and their terminals; `processes` is the template's clone3 with the PID of the live process, then one batch: the move onto " +
		"the restored state, setsid and the terminal; `kill` ends the live process after handing its memory to a holder (its exit " +
		"skips the page freeing)")
	if m, _ := rows[SysDeltaBox+" restore"].Info["phases_p50_us"].(map[string]any); m["reap"] != nil {
		b.WriteString(", and `reap` has init reap it (and kill anything else the sandbox runs).\n")
	} else { // results from before restores timed the reap apart
		b.WriteString(" and has init reap it.\n")
	}
}

func phasesCell(v any) string {
	m, ok := v.(map[string]any)
	if !ok {
		return "-"
	}
	type kv struct {
		k string
		v float64
	}
	var out []kv
	for k, x := range m {
		if f, ok := x.(float64); ok && f >= 50 {
			out = append(out, kv{k, f})
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].v > out[j].v })
	var s []string
	for _, e := range out {
		s = append(s, fmt.Sprintf("%s %.0f", e.k, e.v))
	}
	return strings.Join(s, ", ")
}
