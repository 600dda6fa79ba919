package bench

import (
	"fmt"
	"math"
	"strconv"
	"strings"
)

// The summary that opens docs/BENCHMARKS.md: every target the result files check, with
// its verdict and the section that holds its rows, then the headline figures beside the
// same runs' baselines and the published system's figures. It reads the files only, so
// that it cannot say more than they measured; each line is left out when its rows are.

// Published figures of the system DeltaBox follows (its paper: a first version and a
// later one). They are quoted, never measured here, and labelled so wherever shown.
const (
	pubCheckpointMS   = 14   // mean
	pubCheckpointV2MS = 10.8 // mean, later version
	pubRollbackMS     = 5    // mean (P95 <= 6 ms)
	pubRollbackV2MS   = 1.86 // mean, later version
	pubOverhead       = "3-6% (47-77% before)"
)

// Baseline systems of `bench fs` (fs.go names them inline).
const (
	fsReflink  = "cp-reflink"
	fsCopytree = "copytree"
)

// targetCheck is one File.Targets entry checked against one of its rows.
type targetCheck struct {
	T     Target
	Row   *Row // nil: no row measured it
	Value float64
	Met   bool
}

// targetChecks checks f's targets, one entry per target and matching row (a target with
// no row gives one entry with Row nil). writeSection's Targets table and the summary
// read the same verdicts.
func targetChecks(f *File) []targetCheck {
	var out []targetCheck
	for _, t := range f.Targets {
		found := false
		for i := range f.Results {
			r := &f.Results[i]
			if r.System != t.System || r.Op != t.Op {
				continue
			}
			found = true
			v, _ := r.Value(t.Stat)
			out = append(out, targetCheck{T: t, Row: r, Value: v, Met: v <= t.MaxMS})
		}
		if !found {
			out = append(out, targetCheck{T: t})
		}
	}
	return out
}

// summaryLine is one target of the summary.
type summaryLine struct {
	Target, Measured string
	Checked, Met     bool
	Where            string // the bench, whose section has the rows
}

// headline is one headline figure: DeltaBox's, and what it compares with.
type headline struct {
	What, DeltaBox, Against, Where string
}

// writeSummary writes the summary of files (nothing if they hold no target and no
// headline figure).
func writeSummary(b *strings.Builder, files []*File) {
	targets, heads := summaryTargets(files), summaryHeadlines(files)
	if len(targets) == 0 && len(heads) == 0 {
		return
	}
	met, checked := 0, 0
	for _, t := range targets {
		if t.Checked {
			checked++
			if t.Met {
				met++
			}
		}
	}
	b.WriteString("\n## Summary\n")
	fmt.Fprintf(b, "%d of %d targets met. Each line names the section below that holds its rows, commands and conditions; "+
		"ms are p50 unless said; cold: restored into a sandbox that never mounted the node. Published figures are the paper's, "+
		"quoted (means), not measured here.\n", met, checked)
	if len(targets) > 0 {
		b.WriteString("\n| Target | Measured | Result | Where |\n|---|---|---|---|\n")
		for _, t := range targets {
			res := "-"
			if t.Checked {
				res = "met"
				if !t.Met {
					res = "**missed**"
				}
			}
			fmt.Fprintf(b, "| %s | %s | %s | %s |\n", cell(t.Target), cell(t.Measured), res, sectionLink(t.Where))
		}
	}
	if len(heads) > 0 {
		b.WriteString("\n| Headline | DeltaBox | Against | Where |\n|---|---|---|---|\n")
		for _, h := range heads {
			fmt.Fprintf(b, "| %s | %s | %s | %s |\n", cell(h.What), cell(h.DeltaBox), cell(h.Against), sectionLink(h.Where))
		}
	}
}

// sectionLink links to the section of a bench (writeSection's "## BENCH" heading).
func sectionLink(bench string) string { return fmt.Sprintf("[%s](#%s)", bench, bench) }

// summaryTargets lists every target of files: File.Targets, the mcts verdicts, and the
// two targets that the latency and scale benches check in notes (CRIU's restore over
// DeltaBox's; the restore at the largest workspace over the smallest's).
func summaryTargets(files []*File) []summaryLine {
	var out []summaryLine
	for _, f := range files {
		scope := benchScope(f)
		for _, c := range targetChecks(f) {
			t := c.T
			what := fmt.Sprintf("%s %s <= %s ms", t.Op, strings.TrimSuffix(t.Stat, "_ms"), num(t.MaxMS))
			if t.System != SysDeltaBox {
				what = t.System + " " + what
			}
			if scope != "" {
				what += ", " + scope
			}
			if c.Row == nil {
				out = append(out, summaryLine{Target: what, Measured: "not measured", Where: f.Bench})
				continue
			}
			if c.Row.WorkspaceMB != 0 {
				what += ", " + mbCell(c.Row.WorkspaceMB)
			}
			out = append(out, summaryLine{Target: what, Measured: fmtMS(c.Value) + " ms", Checked: true, Met: c.Met, Where: f.Bench})
		}
		switch f.Bench {
		case "latency":
			if l, ok := criuTarget(f.Results); ok {
				l.Where = f.Bench
				out = append(out, l)
			}
		case "mcts":
			for _, v := range MCTSVerdicts(f.MCTS) {
				out = append(out, summaryLine{Target: "MCTS: " + v.Target, Measured: v.Measured, Checked: v.Checked, Met: v.Met, Where: f.Bench})
			}
		case "durable":
			for _, l := range durableTargets(f.Results) {
				l.Where = f.Bench
				out = append(out, l)
			}
		case "exec":
			if l, ok := execTarget(f.Results); ok {
				l.Where = f.Bench
				out = append(out, l)
			}
		case "scale":
			if lo, hi, ok := workspaceTarget(f.Results); ok {
				ratio := hi.P50 / lo.P50
				out = append(out, summaryLine{
					Target:   fmt.Sprintf("restore p50 at the largest workspace (%s) <= 1.5x the smallest's (%s)", mbCell(scaleX(hi)), mbCell(scaleX(lo))),
					Measured: fmt.Sprintf("%.2fx (%s vs %s ms)", ratio, fmtMS(hi.P50), fmtMS(lo.P50)),
					Checked:  true, Met: ratio <= 1.5, Where: f.Bench})
			}
		}
	}
	return out
}

// criuTarget is the latency bench's CRIU target: CRIU's restore p50 at least 30x
// DeltaBox's restore call (the note latency.go writes says the same).
func criuTarget(rows []Row) (summaryLine, bool) {
	criu, db, dbx := findRow(rows, SysCRIU, "restore"), findRow(rows, SysDeltaBox, "restore"), findRow(rows, SysDeltaBox, "restore+exec")
	if criu == nil || db == nil || db.P50 <= 0 {
		return summaryLine{}, false
	}
	// Rounded down to a tenth, as the bench's own note rounds them.
	ratio := math.Floor(10*criu.P50/db.P50) / 10
	m := fmt.Sprintf("%.1fx (%s vs %s ms", ratio, fmtMS(criu.P50), fmtMS(db.P50))
	if dbx != nil && dbx.P50 > 0 {
		m += fmt.Sprintf("; %.1fx with the next exec", math.Floor(10*criu.P50/dbx.P50)/10)
	}
	return summaryLine{Target: "restore >= 30x faster than CRIU's (CRIU: the process only)", Measured: m + ")", Checked: true, Met: ratio >= 30}, true
}

// durableTargets are the durable bench's targets: a restore of the 50 MB python from its
// image (timed to the first command's answer) within 1.5x of plain CRIU's restore of the
// same heap; an image's stored bytes per checkpoint at least 5x fewer than a full CRIU
// dump's, at every heap size measured (one line).
func durableTargets(rows []Row) []summaryLine {
	var out []summaryLine
	img, plain := findRowMB(rows, SysDurableImage, "restore", 50), findRowMB(rows, SysCRIUPlain, "restore", 50)
	if img != nil && plain != nil && img.P50 > 0 && plain.P50 > 0 {
		ratio := img.P50 / plain.P50
		out = append(out, summaryLine{
			Target:   "restore from a durable image p50 <= 1.5x plain CRIU's, a 50 MB python",
			Measured: fmt.Sprintf("%.2fx (%s vs %s ms)", ratio, fmtMS(img.P50), fmtMS(plain.P50)),
			Checked:  true, Met: ratio <= 1.5})
	}
	// Lazy restores (item 4's "lazily where that is faster"): faster to the first command
	// than the eager restore and plain CRIU, at every heap size measured.
	var lparts []string
	lmet := true
	for i := range rows {
		lz := &rows[i]
		if lz.System != SysDurableLazy || lz.Op != "restore" || lz.P50 <= 0 {
			continue
		}
		eager, plain := findRowMB(rows, SysDurableImage, "restore", lz.WorkspaceMB), findRowMB(rows, SysCRIUPlain, "restore", lz.WorkspaceMB)
		if eager == nil || plain == nil || eager.P50 <= 0 || plain.P50 <= 0 {
			continue
		}
		lmet = lmet && lz.P50 < eager.P50 && lz.P50 < plain.P50
		lparts = append(lparts, fmt.Sprintf("%d MB: %s ms vs %s ms eager, %s ms plain CRIU", lz.WorkspaceMB, fmtMS(lz.P50), fmtMS(eager.P50), fmtMS(plain.P50)))
	}
	if len(lparts) > 0 {
		out = append(out, summaryLine{
			Target:   "lazy restore from a durable image: first command p50 before the eager restore's and plain CRIU's",
			Measured: strings.Join(lparts, "; "), Checked: true, Met: lmet})
	}
	var parts []string
	met, found := true, false
	for i := range rows {
		inc := &rows[i]
		if inc.System != SysDurableIncr || inc.Op != "dump" || inc.P50 <= 0 {
			continue
		}
		full := findRowMB(rows, SysCRIUFull, "dump", inc.WorkspaceMB)
		if full == nil || full.P50 <= 0 {
			continue
		}
		ratio := full.P50 / inc.P50
		found, met = true, met && ratio >= 5
		parts = append(parts, fmt.Sprintf("%.0fx at %d MB (%s vs %s)", math.Floor(ratio), inc.WorkspaceMB, bytesCell(inc.P50), bytesCell(full.P50)))
	}
	if found {
		out = append(out, summaryLine{
			Target:   "image bytes stored per checkpoint >= 5x fewer than a full CRIU dump's (python heaps)",
			Measured: strings.Join(parts, "; "), Checked: true, Met: met})
	}
	return out
}

// findRowMB is the row of system and op at workspace (or heap) size mb, nil if none.
func findRowMB(rows []Row, system, op string, mb int) *Row {
	for i := range rows {
		if r := &rows[i]; r.System == system && r.Op == op && r.WorkspaceMB == mb {
			return r
		}
	}
	return nil
}

// bytesCell prints a byte count in KB or MB.
func bytesCell(b float64) string {
	if b >= 1e6 {
		return fmt.Sprintf("%.1f MB", b/1e6)
	}
	return fmt.Sprintf("%.0f KB", b/1e3)
}

// execTarget is the exec bench's target: a bash session call's p50 within
// execTargetGapMS of a python session call's (the same trivial call, the same run).
func execTarget(rows []Row) (summaryLine, bool) {
	b, p := findRow(rows, SysExecBash, ExecOpCall), findRow(rows, SysExecPython, ExecOpCall)
	if b == nil || p == nil {
		return summaryLine{}, false
	}
	gap := b.P50 - p.P50
	return summaryLine{
		Target:   fmt.Sprintf("bash session call p50 <= python session call p50 + %d ms", execTargetGapMS),
		Measured: fmt.Sprintf("%s ms vs %s ms (%+.3f ms)", fmtMS(b.P50), fmtMS(p.P50), gap),
		Checked:  true, Met: gap <= execTargetGapMS}, true
}

// benchScope says what a bench's operations carry, for the target lines.
func benchScope(f *File) string {
	switch f.Bench {
	case "fs":
		return "files only"
	case "latency":
		if r := findRow(f.Results, SysForkFloor, "fork"); r != nil {
			if mb, ok := r.Info["python_rss_mb"].(float64); ok {
				return fmt.Sprintf("files + a %.0f MB python", mb)
			}
		}
		return "files + a python session"
	}
	return ""
}

// summaryHeadlines picks the headline figures of files, each with the baselines of its
// own run (and the published figures where they measure the same thing).
func summaryHeadlines(files []*File) []headline {
	var out []headline
	for _, f := range files {
		switch f.Bench {
		case "latency":
			out = append(out, latencyHeadlines(f)...)
		case "fs":
			out = append(out, fsHeadlines(f)...)
		case "mcts":
			out = append(out, mctsHeadlines(f)...)
		case "scale":
			out = append(out, scaleHeadlines(f)...)
		case "warm":
			out = append(out, warmHeadlines(f)...)
		case "exec":
			out = append(out, execHeadlines(f)...)
		}
	}
	return out
}

func latencyHeadlines(f *File) []headline {
	var out []headline
	scope := benchScope(f)
	fork := findRow(f.Results, SysForkFloor, "fork")
	for _, op := range []struct {
		op, criuVerb string
		pub, pubV2   float64
	}{{"checkpoint", "dump", pubCheckpointMS, pubCheckpointV2MS}, {"restore", "restore", pubRollbackMS, pubRollbackV2MS}} {
		r := findRow(f.Results, SysDeltaBox, op.op)
		if r == nil {
			continue
		}
		db := fmt.Sprintf("%s ms (mean %s)", fmtMS(r.P50), fmtMS(r.Mean))
		if fork != nil {
			db += fmt.Sprintf("; %s ms above the process's own fork", fmtMS(r.P50-fork.P50))
		}
		against := []string{fmt.Sprintf("published %s ms mean (%s ms in its later version)", num(op.pub), num(op.pubV2))}
		if c := findRow(f.Results, SysCRIU, op.op); c != nil {
			against = append(against, fmt.Sprintf("CRIU %s %s ms", op.criuVerb, fmtMS(c.P50)))
		}
		for _, sys := range []string{SysFSOnly, SysCopytree} {
			if c := findRow(f.Results, sys, op.op); c != nil {
				against = append(against, fmt.Sprintf("%s %s ms", sys, fmtMS(c.P50)))
			}
		}
		if fork != nil && op.op == "checkpoint" {
			against = append(against, fmt.Sprintf("os.fork() alone %s ms", fmtMS(fork.P50)))
		}
		what := op.op
		if scope != "" {
			what += ", " + scope
		}
		if r.WorkspaceMB != 0 {
			what += ", " + mbCell(r.WorkspaceMB)
		}
		out = append(out, headline{What: what, DeltaBox: db, Against: strings.Join(against, "; "), Where: f.Bench})
	}
	return out
}

func fsHeadlines(f *File) []headline {
	largest := 0
	for _, r := range f.Results {
		if r.System == SysDeltaBox && r.WorkspaceMB > largest {
			largest = r.WorkspaceMB
		}
	}
	var out []headline
	for _, op := range []string{"checkpoint", "restore"} {
		r := findSized(f.Results, SysDeltaBox, op, largest)
		if r == nil {
			continue
		}
		var against []string
		for _, sys := range []string{fsReflink, fsCopytree} {
			if c := findSized(f.Results, sys, op, largest); c != nil {
				against = append(against, fmt.Sprintf("%s %s ms", sys, fmtMS(c.P50)))
			}
		}
		what := fmt.Sprintf("%s, files only, %s", op, mbCell(largest))
		if r.Layers != nil {
			what += fmt.Sprintf(", stacks %d-%d deep", r.Layers.Min, r.Layers.Max)
		}
		out = append(out, headline{What: what, DeltaBox: fmtMS(r.P50) + " ms", Against: strings.Join(against, "; "), Where: f.Bench})
	}
	return out
}

func mctsHeadlines(f *File) []headline {
	// One line for every think time: the summary fits on a screen.
	var dbx, against []string
	for _, think := range []float64{0, mctsThinkGoal} {
		d := findMCTS(f.MCTS, MCTSDeltaBox, think)
		if d == nil || d.TotalS <= 0 {
			continue
		}
		dbx = append(dbx, fmt.Sprintf("%s s think: %.2f%% (overhead %.2f%%)", thinkArg(think), 100*d.StateS/d.TotalS, 100*d.OverheadFrac))
		var others []string
		for _, sys := range []string{MCTSCopytree, MCTSGitReset, MCTSCRIUCopy} {
			if c := findMCTS(f.MCTS, sys, think); c != nil && c.TotalS > 0 {
				others = append(others, fmt.Sprintf("%s %.2f%%", sys, 100*c.StateS/c.TotalS))
			}
		}
		if len(others) > 0 {
			against = append(against, thinkArg(think)+" s: "+strings.Join(others, ", "))
		}
	}
	if len(dbx) == 0 {
		return nil
	}
	return []headline{{
		What:     "MCTS: state management / search time",
		DeltaBox: strings.Join(dbx, "; "),
		Against:  strings.Join(append([]string{"published " + pubOverhead}, against...), "; "), Where: f.Bench}}
}

// scaleHeadlines: the deepest stack, the largest workspace and the largest session
// heap, each against the smallest point of its dimension.
func scaleHeadlines(f *File) []headline {
	type ends struct{ lo, hi *Row }
	dims := map[string]*ends{}
	for i := range f.Results {
		r := &f.Results[i]
		p, ok := ParseScaleSystem(r.System)
		if !ok || r.Op != "restore" {
			continue
		}
		e := dims[p.Dim]
		if e == nil {
			e = &ends{}
			dims[p.Dim] = e
		}
		if e.lo == nil || p.X < scaleX(e.lo) {
			e.lo = r
		}
		if e.hi == nil || p.X > scaleX(e.hi) {
			e.hi = r
		}
	}
	var out []headline
	for _, d := range []struct{ dim, what, lo string }{
		{"depth", "restore at depth %v, files only", "depth %v"},
		{"ws", "restore, %v workspace, files only", "%v"},
		{"rss", "restore, files + a %v python heap", "a %v heap"},
	} {
		e := dims[d.dim]
		if e == nil || e.lo == e.hi {
			continue
		}
		hiX, loX := any(scaleX(e.hi)), any(scaleX(e.lo))
		if d.dim != "depth" {
			hiX, loX = mbCell(scaleX(e.hi)), mbCell(scaleX(e.lo))
		}
		what, lo := fmt.Sprintf(d.what, hiX), fmt.Sprintf(d.lo, loX)
		db := fmtMS(e.hi.P50) + " ms"
		if c := findRow(f.Results, e.hi.System, "restore-cold"); c != nil {
			db += fmt.Sprintf(" (%s cold)", fmtMS(c.P50))
		}
		out = append(out, headline{What: what, DeltaBox: db, Against: fmt.Sprintf("%s ms at %s", fmtMS(e.lo.P50), lo), Where: f.Bench})
	}
	return out
}

func warmHeadlines(f *File) []headline {
	on, off := findRow(f.Results, SysWarmOn, WarmOpPaused), findRow(f.Results, SysWarmOff, WarmOpPaused)
	if on == nil || off == nil {
		return nil
	}
	db := fmtMS(on.P50) + " ms with the warm-up"
	against := fmtMS(off.P50) + " ms without"
	ron, roff := findRow(f.Results, SysWarmOn, WarmOpRestore), findRow(f.Results, SysWarmOff, WarmOpRestore)
	if ron != nil && roff != nil {
		against += fmt.Sprintf("; the restore itself %s ms with, %s ms without", fmtMS(ron.P50), fmtMS(roff.P50))
	}
	return []headline{{What: "first command after a restore and a pause (rewrites the heap)", DeltaBox: db, Against: against, Where: f.Bench}}
}

// execHeadlines: a trivial command and a 100 MB output through each way in, beside
// podman exec (or why it did not run).
func execHeadlines(f *File) []headline {
	var out []headline
	for _, op := range []struct{ op, what string }{{ExecOpCall, "a trivial command (true)"}, {ExecOpOutLarge, "a command printing 100 MB"}} {
		var db []string
		for _, sys := range []struct{ sys, name string }{{SysExecBash, "bash session"}, {SysExecPython, "python session"}, {SysExecPlain, "exec"}} {
			if r := findRow(f.Results, sys.sys, op.op); r != nil && r.Unavailable() == "" {
				db = append(db, fmt.Sprintf("%s %s ms", sys.name, fmtMS(r.P50)))
			}
		}
		if len(db) == 0 {
			continue
		}
		against := "-"
		if r := findRow(f.Results, SysExecPodman, op.op); r != nil {
			if why := r.Unavailable(); why != "" {
				against = "podman exec unavailable: " + why
			} else {
				against = fmt.Sprintf("podman exec %s ms", fmtMS(r.P50))
			}
		}
		out = append(out, headline{What: op.what, DeltaBox: strings.Join(db, "; "), Against: against, Where: f.Bench})
	}
	return out
}

func findRow(rows []Row, system, op string) *Row {
	for i := range rows {
		if rows[i].System == system && rows[i].Op == op {
			return &rows[i]
		}
	}
	return nil
}

func findSized(rows []Row, system, op string, mb int) *Row {
	for i := range rows {
		if rows[i].System == system && rows[i].Op == op && rows[i].WorkspaceMB == mb {
			return &rows[i]
		}
	}
	return nil
}

func findMCTS(rows []MCTSRow, system string, think float64) *MCTSRow {
	for i := range rows {
		if rows[i].System == system && rows[i].ThinkS == think {
			return &rows[i]
		}
	}
	return nil
}

// num prints a quoted figure as it was published (14, 10.8, 1.86).
func num(v float64) string { return strconv.FormatFloat(v, 'f', -1, 64) }

// scaleX is the point a scale row was measured at (layers or MiB; 0 if not a scale row).
func scaleX(r *Row) int {
	p, _ := ParseScaleSystem(r.System)
	return p.X
}
