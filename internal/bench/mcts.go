package bench

// `deltabox bench mcts`: one tree search (examples/mcts.py: UCT over a scripted agent
// fixing bugs in CPython's json package, with its real tests) run with DeltaBox, then
// the same trajectory replayed with the baselines (workload/baselines.py), each node's
// score checked against an isolated reference run.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"deltabox/internal/client"
	"deltabox/internal/criu"
	"deltabox/internal/deadline"
)

// Systems of the mcts bench. MCTSNegative is the negative control: its scores must
// differ from the reference.
const (
	MCTSDeltaBox  = "deltabox"
	MCTSIsolated  = "isolated"
	MCTSCopytree  = "copytree+replay"
	MCTSFSReplay  = "fs-only+replay"
	MCTSNegative  = "fs-only"
	MCTSGitReset  = "git-reset+replay"
	MCTSCRIUCopy  = "criu+copytree"
	mctsThinkGoal = 2.0 // the think time of the overhead target
)

// MCTSBaselines are the replay systems, in the order they run.
var MCTSBaselines = []string{MCTSCopytree, MCTSFSReplay, MCTSNegative, MCTSGitReset, MCTSCRIUCopy}

// MCTSOptions configures `deltabox bench mcts`.
type MCTSOptions struct {
	Thinks     []float64 `json:"thinks"` // think seconds per expansion; every system runs at each
	Expansions int       `json:"expansions"`
	Rollbacks  int       `json:"rollbacks"`
	K          int       `json:"k"`    // proposals per node
	Bugs       int       `json:"bugs"` // bugs injected into the task
	Seed       int       `json:"seed"`
	Systems    []string  `json:"systems"` // baselines to run (MCTSBaselines by default)
	Short      bool      `json:"short"`
	Workload   string    `json:"workload"` // MCTSJSONLib or MCTSDjango (mcts_workload.go)
	Repo       string    `json:"-"`        // the repository with examples/ and workload/
	Python     string    `json:"python"`   // the host's python3, which drives the search and the replays
	CRIU       string    `json:"criu"`
	CRIUImages string    `json:"criu_images"` // tmpfs directory for CRIU's images
	Socket     string    `json:"socket"`
	// TemplateBudgetMB is the search sandbox's template_budget_mb (0: the daemon's
	// default): under a small one, nodes are evicted and restored from their durable
	// images, counted in the row's info (evicted_nodes, image_restores).
	TemplateBudgetMB int `json:"template_budget_mb,omitempty"`

	WorkDir string    `json:"-"` // trajectories and results (default: a temporary directory, removed unless Keep)
	Keep    bool      `json:"-"` // keep the temporary work directory
	Notes   []string  `json:"-"`
	Command string    `json:"-"`
	Log     io.Writer `json:"-"`
}

// DefaultMCTSOptions are the parameters: 100 expansions and 49 rollbacks, at
// 0 s and 2 s of think per expansion.
func DefaultMCTSOptions() MCTSOptions {
	return MCTSOptions{Thinks: []float64{0, 2}, Expansions: 100, Rollbacks: 49, K: 4, Bugs: 2, Workload: MCTSJSONLib,
		Systems: append([]string(nil), MCTSBaselines...), Python: "python3",
		CRIU: "/opt/deltabox/criu/sbin/criu", CRIUImages: "/dev/shm"}
}

// ShortMCTS turns o into the short mode (for CI): a few nodes, think 0 only.
func (o *MCTSOptions) ShortMCTS() {
	o.Short = true
	o.Thinks = []float64{0}
	o.Expansions, o.Rollbacks, o.K, o.Bugs = 6, 2, 3, 1
	o.shortWorkload()
}

// Check validates o.
func (o MCTSOptions) Check() error {
	if o.Expansions < 1 || o.Rollbacks < 0 || o.K < 1 || o.Bugs < 1 || len(o.Thinks) == 0 {
		return fmt.Errorf("want --expansions >= 1, --rollbacks >= 0, --k >= 1, --bugs >= 1 and at least one think time")
	}
	if err := o.checkWorkload(); err != nil {
		return err
	}
	for _, t := range o.Thinks {
		if t < 0 {
			return fmt.Errorf("think times must be >= 0 s")
		}
	}
	for _, s := range o.Systems {
		if !slices.Contains(MCTSBaselines, s) {
			return fmt.Errorf("unknown system %q (baselines: %s)", s, strings.Join(MCTSBaselines, ", "))
		}
	}
	return nil
}

// FindRepo returns the repository holding examples/mcts.py and workload/baselines.py:
// dir if given, else the current directory or one of its parents, else the
// executable's directory or one of its parents.
func FindRepo(dir string) (string, error) {
	ok := func(d string) bool {
		for _, f := range []string{"examples/mcts.py", "workload/baselines.py", "clients/python/deltabox/__init__.py"} {
			if _, err := os.Stat(filepath.Join(d, f)); err != nil {
				return false
			}
		}
		return true
	}
	if dir != "" {
		if !ok(dir) {
			return "", fmt.Errorf("%s lacks examples/mcts.py, workload/baselines.py or clients/python", dir)
		}
		return filepath.Abs(dir)
	}
	var starts []string
	if wd, err := os.Getwd(); err == nil {
		starts = append(starts, wd)
	}
	if exe, err := os.Executable(); err == nil {
		starts = append(starts, filepath.Dir(exe))
	}
	for _, s := range starts {
		for d := s; ; d = filepath.Dir(d) {
			if ok(d) {
				return d, nil
			}
			if filepath.Dir(d) == d {
				break
			}
		}
	}
	return "", fmt.Errorf("cannot find the repository (examples/mcts.py, workload/); run from it or pass --repo")
}

// ---- what the Python side writes ----

type mctsTimer struct {
	Seconds float64 `json:"seconds"`
	Count   int     `json:"count"`
	MeanMS  float64 `json:"mean_ms"`
}

type mctsNode struct {
	ID          int      `json:"id"`
	Parent      *int     `json:"parent"`
	Path        []string `json:"path"`
	Score       float64  `json:"score"`
	TestsPassed int      `json:"tests_passed"`
	State       float64  `json:"state"`
	CommandsS   float64  `json:"commands_s"` // isolated reference only
}

type mctsEvent struct {
	Type   string `json:"type"`
	Node   int    `json:"node"`
	Parent *int   `json:"parent"`
}

// mctsTrajectory is the part of examples/mcts.py's trajectory.json the bench reads.
type mctsTrajectory struct {
	Config  map[string]any `json:"config"`
	Task    map[string]any `json:"task"`
	Nodes   []mctsNode     `json:"nodes"`
	Events  []mctsEvent    `json:"events"`
	Summary struct {
		SearchSeconds    float64              `json:"search_seconds"`
		WallSeconds      float64              `json:"wall_seconds"`
		Expansions       int                  `json:"expansions"`
		Rollbacks        int                  `json:"rollbacks"`
		ExtraRollbacks   int                  `json:"extra_rollbacks"`
		FixFound         bool                 `json:"fix_found"`
		FixExpansion     *int                 `json:"fix_expansion"`
		BestScore        float64              `json:"best_score"`
		MaxDepth         int                  `json:"max_depth"`
		StateIntactNodes int                  `json:"state_intact_nodes"`
		Timers           map[string]mctsTimer `json:"timers"`
		// SearchTimers are the agent's timers over the search alone (no setup, no
		// root tests).
		SearchTimers map[string]mctsTimer `json:"search_timers"`
		// Tree is the tree the search built (examples/mcts.py search_tree), for its
		// picture (mcts_tree.go).
		Tree []MCTSTreeNode `json:"tree"`
		// SandboxStats: the search sandbox's counters at the end of the search.
		SandboxStats *struct {
			EvictedNodes    int `json:"evicted_nodes"`
			ImageRestores   int `json:"image_restores"`
			ProcessRestores int `json:"process_restores"`
			// TemplateUsedBytes: what the sandbox's templates held at the end.
			TemplateUsedBytes int64 `json:"template_used_bytes"`
			// The complete durable images of the search's nodes but the root, at the
			// end: what they stored, and what full CRIU dumps of the same processes
			// take.
			ImagesComplete   int   `json:"images_complete"`
			ImageStoredBytes int64 `json:"image_stored_bytes"`
			ImageFullBytes   int64 `json:"image_full_bytes"`
		} `json:"sandbox_stats"`
	} `json:"summary"`
}

// fingerprint identifies a trajectory's shape: the nodes (parent, path) and the order
// of expansions and rollbacks.
func (t *mctsTrajectory) fingerprint() string {
	var b strings.Builder
	for _, n := range t.Nodes {
		p := -1
		if n.Parent != nil {
			p = *n.Parent
		}
		fmt.Fprintf(&b, "n%d<%d:%s;", n.ID, p, strings.Join(n.Path, ","))
	}
	for _, e := range t.Events {
		if e.Type == "expand" || e.Type == "rollback" {
			fmt.Fprintf(&b, "%s%d;", e.Type[:1], e.Node)
		}
	}
	return b.String()
}

// mctsReplay is what `python3 -m workload.baselines` writes.
type mctsReplay struct {
	System      string               `json:"system"`
	ThinkS      float64              `json:"think_s"`
	TotalS      float64              `json:"total_s"`
	ThinkTotalS float64              `json:"think_total_s"`
	StateS      float64              `json:"state_s"`
	CommandsS   float64              `json:"commands_s"`
	Timers      map[string]mctsTimer `json:"timers"`
	Nodes       []mctsNode           `json:"nodes"`
	Commands    []string             `json:"commands"`
	Info        map[string]any       `json:"info"`
	WallS       float64              `json:"wall_s"`
}

// ---- rows (pure) ----

func round4(x float64) float64 { return math.Round(x*1e4) / 1e4 }

// mctsDeltaBoxRow is the DeltaBox row of a search's trajectory.
func mctsDeltaBoxRow(t *mctsTrajectory, think float64, cmdline string) (MCTSRow, float64) {
	tm := t.Summary.SearchTimers
	for k, v := range tm {
		if v.Count > 0 && v.MeanMS == 0 {
			v.MeanMS = math.Round(v.Seconds/float64(v.Count)*1e6) / 1e3
			tm[k] = v
		}
	}
	state := tm["checkpoint"].Seconds + tm["restore"].Seconds
	own := tm["edit"].Seconds + tm["session"].Seconds + tm["tests"].Seconds
	info := map[string]any{
		"command":            cmdline,
		"think_total_s":      round4(tm["think"].Seconds),
		"own_commands_s":     round4(own),
		"checkpoint_n":       tm["checkpoint"].Count,
		"checkpoint_mean_ms": tm["checkpoint"].MeanMS,
		"rollback_n":         tm["restore"].Count,
		"rollback_mean_ms":   tm["restore"].MeanMS,
		"nodes":              len(t.Nodes),
		"expansions":         t.Summary.Expansions,
		"rollbacks":          t.Summary.Rollbacks,
		"max_depth":          t.Summary.MaxDepth,
		"fix_found":          t.Summary.FixFound,
		"best_score":         t.Summary.BestScore,
		"session_intact":     fmt.Sprintf("%d/%d nodes", t.Summary.StateIntactNodes, max(0, len(t.Nodes)-1)),
		"setup_s":            round4(t.Summary.WallSeconds - t.Summary.SearchSeconds),
	}
	if t.Summary.FixExpansion != nil {
		info["fix_expansion"] = *t.Summary.FixExpansion
	}
	if t.Summary.ExtraRollbacks > 0 {
		info["extra_rollbacks"] = t.Summary.ExtraRollbacks
	}
	if st := t.Summary.SandboxStats; st != nil {
		info["evicted_nodes"] = st.EvictedNodes
		info["image_restores"] = st.ImageRestores
		info["process_restores"] = st.ProcessRestores
		info["template_used_bytes"] = st.TemplateUsedBytes
		if st.ImagesComplete > 0 {
			info["images_complete"] = st.ImagesComplete
			info["image_stored_bytes_per_checkpoint"] = st.ImageStoredBytes / int64(st.ImagesComplete)
			info["image_full_bytes_per_checkpoint"] = st.ImageFullBytes / int64(st.ImagesComplete)
		}
	}
	return MCTSRow{
		System: MCTSDeltaBox, ThinkS: think, TotalS: round4(t.Summary.SearchSeconds), StateS: round4(state),
		Commands: []string{
			"sb.checkpoint(label): POST /v1/sandboxes/{id}/checkpoint (files and the python session's process)",
			"sb.restore(node): POST /v1/sandboxes/{id}/restore",
		},
		Info: info,
	}, tm["think"].Seconds
}

// mctsReplayRow is a baseline's row.
func mctsReplayRow(r *mctsReplay, cmdline string) (MCTSRow, float64) {
	info := map[string]any{"command": cmdline, "think_total_s": round4(r.ThinkTotalS), "own_commands_s": round4(r.CommandsS)}
	for k, v := range r.Info {
		if k != "sandbox" {
			info[k] = v
		}
	}
	return MCTSRow{System: r.System, ThinkS: r.ThinkS, TotalS: round4(r.TotalS), StateS: round4(r.StateS),
		Commands: r.Commands, Info: info}, r.ThinkTotalS
}

// mctsScores compares a run's node scores with the reference's: it returns whether
// every reference node has the same score, and how many do not (a missing node counts).
func mctsScores(ref, got []mctsNode) (bool, int, []int) {
	byID := map[int]mctsNode{}
	for _, n := range got {
		byID[n.ID] = n
	}
	var bad []int
	for _, r := range ref {
		g, ok := byID[r.ID]
		if !ok || math.Abs(g.Score-r.Score) > 1e-9 {
			bad = append(bad, r.ID)
		}
	}
	return len(bad) == 0 && len(ref) > 0 && len(got) == len(ref), len(bad), bad
}

// mctsFinish sets a row's overhead and score check against the reference.
func mctsFinish(row *MCTSRow, thinkTotal float64, ref *mctsReplay, nodes []mctsNode) {
	match, n, bad := mctsScores(ref.Nodes, nodes)
	row.ScoresMatch = match
	if row.Info == nil {
		row.Info = map[string]any{}
	}
	row.Info["isolated_commands_s"] = round4(ref.CommandsS)
	row.Info["nodes_scored"] = len(nodes)
	if n > 0 {
		row.Info["score_mismatches"] = n
		if len(bad) > 8 {
			bad = bad[:8]
		}
		row.Info["score_mismatch_nodes"] = bad
	}
	if row.TotalS > 0 {
		row.OverheadFrac = math.Round((row.TotalS-thinkTotal-ref.CommandsS)/row.TotalS*1e5) / 1e5
	}
	mctsStateFrac(row)
}

// MCTSVerdict is one target of the mcts bench, checked against its rows.
type MCTSVerdict struct {
	Target   string
	Measured string
	Met      bool
	Checked  bool // false: the rows cannot tell (not run)
}

// MCTSVerdicts checks the targets: DeltaBox's overhead at 2 s of think
// <= 3%; DeltaBox's state-management time at least 20x less than copytree+replay's in
// the same run (at each think time); every system's scores match the reference; the
// negative control's do not.
func MCTSVerdicts(rows []MCTSRow) []MCTSVerdict {
	var out []MCTSVerdict
	find := func(system string, think float64) *MCTSRow {
		for i := range rows {
			if rows[i].System == system && rows[i].ThinkS == think {
				return &rows[i]
			}
		}
		return nil
	}
	if d := find(MCTSDeltaBox, mctsThinkGoal); d != nil {
		out = append(out, MCTSVerdict{Target: "deltabox overhead <= 3% at 2 s think",
			Measured: fmt.Sprintf("%.2f%%", 100*d.OverheadFrac), Met: d.OverheadFrac <= 0.03, Checked: true})
	} else {
		out = append(out, MCTSVerdict{Target: "deltabox overhead <= 3% at 2 s think", Measured: "not run at 2 s think"})
	}
	var thinks []float64
	for _, r := range rows {
		if r.System == MCTSDeltaBox {
			thinks = append(thinks, r.ThinkS)
		}
	}
	for _, t := range thinks {
		d, c := find(MCTSDeltaBox, t), find(MCTSCopytree, t)
		tgt := fmt.Sprintf("deltabox state time <= 1/20 of copytree+replay's, %s s think", strconv.FormatFloat(t, 'f', -1, 64))
		if c == nil || d == nil || d.StateS <= 0 {
			out = append(out, MCTSVerdict{Target: tgt, Measured: "not measured"})
			continue
		}
		ratio := c.StateS / d.StateS
		out = append(out, MCTSVerdict{Target: tgt, Measured: fmt.Sprintf("%.3f s vs %.3f s: %.1fx less", d.StateS, c.StateS, ratio),
			Met: ratio >= 20, Checked: true})
	}
	var good, all int
	var bad, skipped []string
	neg, negMatch := 0, 0
	for _, r := range rows {
		if r.Unavailable() != "" {
			skipped = append(skipped, fmt.Sprintf("%s at %s s", r.System, strconv.FormatFloat(r.ThinkS, 'f', -1, 64)))
			continue
		}
		if r.System == MCTSNegative {
			neg++
			if r.ScoresMatch {
				negMatch++
			}
			continue
		}
		all++
		if r.ScoresMatch {
			good++
		} else {
			bad = append(bad, fmt.Sprintf("%s at %s s", r.System, strconv.FormatFloat(r.ThinkS, 'f', -1, 64)))
		}
	}
	m := fmt.Sprintf("%d of %d rows", good, all)
	if len(bad) > 0 {
		m += "; not: " + strings.Join(bad, ", ")
	}
	if len(skipped) > 0 {
		m += "; unavailable here: " + strings.Join(skipped, ", ")
	}
	out = append(out, MCTSVerdict{Target: "every system's node scores equal the isolated reference's", Measured: m,
		Met: all > 0 && good == all, Checked: all > 0})
	if neg > 0 {
		out = append(out, MCTSVerdict{Target: "the negative control (fs-only, no replay) does not match",
			Measured: fmt.Sprintf("%d of %d rows match", negMatch, neg), Met: negMatch == 0, Checked: true})
	} else {
		out = append(out, MCTSVerdict{Target: "the negative control (fs-only, no replay) does not match", Measured: "not run"})
	}
	return out
}

// ---- running ----

type mctsRun struct {
	c     *client.Client
	o     MCTSOptions
	f     *File
	criu  *criu.Runner // how CRIU runs here, once criu+copytree is about to run
	start time.Time
	dir   string
	env   []string
	refs  map[string]*mctsReplay // isolated reference by trajectory fingerprint
}

func (r *mctsRun) logf(format string, a ...any) {
	progress(r.o.Log, r.start, format, a...)
}

// stepTimeout bounds one python step (the search, or one replay) at think seconds per
// expansion. A node's commands took about 1 s here (edit, session call, CPython's json
// tests) and its isolated rebuild a few seconds more: 20 s per node and 10 minutes of
// setup are a hang, not a slow run.
func (o MCTSOptions) stepTimeout(think float64) time.Duration {
	perNode := 20*time.Second + time.Duration(think*float64(time.Second))
	return 10*time.Minute + time.Duration(o.Expansions+o.Rollbacks)*perNode
}

// python runs the host's python3 in the repository with the client and the
// workload importable, and env added to its environment; its stderr goes to the log.
// It returns the pasteable command line.
func (r *mctsRun) python(ctx context.Context, timeout time.Duration, env []string, args ...string) (string, error) {
	cmd := deadline.Command(ctx, timeout, r.o.Python, args...)
	cmd.Dir = r.o.Repo
	cmd.Env = append(append([]string(nil), r.env...), env...)
	var out bytes.Buffer
	cmd.Stdout = &out
	var errb bytes.Buffer
	if r.o.Log != nil {
		cmd.Stderr = io.MultiWriter(r.o.Log, &errb)
	} else {
		cmd.Stderr = &errb
	}
	// Recorded with the work directory as $WORK (it is temporary unless --workdir).
	line := strings.ReplaceAll(ShellJoin(append(append([]string(nil), env...), "python3"))+" "+ShellJoin(args), r.dir, "$WORK")
	cmd.What = line
	if err := cmd.Run(); err != nil {
		tail := strings.TrimSpace(errb.String() + out.String())
		if len(tail) > 2000 {
			tail = "..." + tail[len(tail)-2000:]
		}
		if errors.Is(err, context.DeadlineExceeded) {
			return line, fmt.Errorf("%w: %s", err, tail)
		}
		return line, fmt.Errorf("%s: %v: %s", line, err, tail)
	}
	return line, nil
}

func thinkArg(t float64) string { return strconv.FormatFloat(t, 'f', -1, 64) }

// RunMCTS runs the search with DeltaBox and the baselines at every think time.
// On error the File holds what was measured so far.
func RunMCTS(ctx context.Context, c *client.Client, o MCTSOptions) (f *File, err error) {
	start := time.Now()
	f = &File{Bench: mctsBenchName(o), Command: o.Command, Machine: CurrentMachine(), Started: start.UTC()}
	settings, _ := json.Marshal(o)
	json.Unmarshal(settings, &f.Settings)
	f.Description = mctsDescription(o)
	f.Notes = append(f.Notes, o.Notes...)
	defer func() {
		f.Finished = time.Now().UTC()
		f.DurationS = float64(int(time.Since(start).Seconds()*10)) / 10
		f.Machine.LoadAvgEnd = LoadAvg()
		if f.Machine.LoadAvgStart > 1 || f.Machine.LoadAvgEnd > 1 {
			f.Notes = append(f.Notes, fmt.Sprintf("1-minute load average %.2f at the start and %.2f at the end on %d CPUs: other work ran on the machine; command times (and so overheads) vary with it",
				f.Machine.LoadAvgStart, f.Machine.LoadAvgEnd, f.Machine.CPUs))
		}
	}()
	if err := o.Check(); err != nil {
		return f, err
	}
	if err := c.Health(ctx); err != nil {
		return f, err
	}
	if v, err := deadline.Command(ctx, 30*time.Second, o.Python, "--version").CombinedOutput(); err == nil {
		f.Machine.Python = strings.TrimSpace(string(v))
	} else {
		return f, fmt.Errorf("the search and the replays need %s on the host: %v", o.Python, err)
	}
	r := &mctsRun{c: c, o: o, f: f, start: start, refs: map[string]*mctsReplay{}}
	r.dir = o.WorkDir
	if r.dir == "" {
		if r.dir, err = os.MkdirTemp("", "deltabox-bench-mcts-"); err != nil {
			return f, err
		}
		if !o.Keep {
			defer os.RemoveAll(r.dir)
		} else {
			r.logf("work directory (kept): %s", r.dir)
		}
	} else if err := os.MkdirAll(r.dir, 0o755); err != nil {
		return f, err
	}
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		if k == "PYTHONPATH" || k == "PYTHONHOME" || k == "DELTABOX_SOCKET" {
			continue
		}
		r.env = append(r.env, kv)
	}
	r.env = append(r.env, "DELTABOX_SOCKET="+o.Socket, "PYTHONDONTWRITEBYTECODE=1", "PYTHONUNBUFFERED=1",
		"PYTHONPATH="+filepath.Join(o.Repo, "clients", "python")+string(os.PathListSeparator)+o.Repo)

	var errs []error
	var first *mctsTrajectory
	for _, think := range o.Thinks {
		if err := ctx.Err(); err != nil {
			return f, err
		}
		tr, err := r.one(ctx, think)
		if err != nil {
			errs = append(errs, err)
			if tr == nil {
				break
			}
		}
		if first == nil {
			first = tr
		} else if tr.fingerprint() != first.fingerprint() {
			f.Notes = append(f.Notes, fmt.Sprintf("the search at %s s think made a different trajectory than at %s s (a different node or order): each was replayed and checked against its own isolated reference", thinkArg(think), thinkArg(o.Thinks[0])))
		}
	}
	r.notes(first)
	return f, errors.Join(errs...)
}

// one runs every system at one think time; it returns DeltaBox's trajectory.
func (r *mctsRun) one(ctx context.Context, think float64) (*mctsTrajectory, error) {
	o := r.o
	sub := filepath.Join(r.dir, "think"+thinkArg(think))
	if err := os.MkdirAll(sub, 0o755); err != nil {
		return nil, err
	}
	r.logf("think %s s: deltabox: examples/mcts.py, %d expansions, %d rollbacks", thinkArg(think), o.Expansions, o.Rollbacks)
	args := []string{"examples/mcts.py", "--quiet", "--workload", o.Workload, "--out", sub, "--think", thinkArg(think), "--seed", strconv.Itoa(o.Seed),
		"--expansions", strconv.Itoa(o.Expansions), "--rollbacks", strconv.Itoa(o.Rollbacks),
		"--k", strconv.Itoa(o.K), "--bugs", strconv.Itoa(o.Bugs)}
	if o.TemplateBudgetMB != 0 {
		args = append(args, "--template-budget-mb", strconv.Itoa(o.TemplateBudgetMB))
	}
	line, err := r.python(ctx, o.stepTimeout(think), nil, args...)
	if err != nil {
		return nil, fmt.Errorf("deltabox: %w", err)
	}
	trPath := filepath.Join(sub, "trajectory.json")
	var tr mctsTrajectory
	if b, err := os.ReadFile(trPath); err != nil {
		return nil, err
	} else if err := json.Unmarshal(b, &tr); err != nil {
		return nil, fmt.Errorf("%s: %w", trPath, err)
	}
	row, thinkTotal := mctsDeltaBoxRow(&tr, think, line)
	mctsWorkloadInfo(&row, &tr)
	r.logf("think %s s: deltabox: %d nodes, total %.2f s, state %.3f s", thinkArg(think), len(tr.Nodes), row.TotalS, row.StateS)
	if st := tr.Summary.SandboxStats; st != nil && o.TemplateBudgetMB != 0 {
		note := fmt.Sprintf("deltabox at %s s think, template_budget_mb %d: %d nodes evicted over the budget, %d of %d process restores from durable images",
			thinkArg(think), o.TemplateBudgetMB, st.EvictedNodes, st.ImageRestores, st.ProcessRestores)
		r.logf("%s", note)
		r.f.Notes = append(r.f.Notes, note)
	}
	if st := tr.Summary.SandboxStats; st != nil && st.ImagesComplete > 0 && st.ImageStoredBytes > 0 {
		note := fmt.Sprintf("deltabox at %s s think: durable images of %d checkpoints (the root's apart) stored %.0f KB each on average, against %.0f KB for a full CRIU dump of the same processes (%.1fx less)",
			thinkArg(think), st.ImagesComplete, float64(st.ImageStoredBytes)/float64(st.ImagesComplete)/1e3,
			float64(st.ImageFullBytes)/float64(st.ImagesComplete)/1e3, float64(st.ImageFullBytes)/float64(st.ImageStoredBytes))
		r.logf("%s", note)
		r.f.Notes = append(r.f.Notes, note)
	}

	fp := tr.fingerprint()
	ref := r.refs[fp]
	if ref == nil {
		r.logf("think %s s: isolated reference: every node from scratch, its own commands timed", thinkArg(think))
		var line string
		ref, line, err = r.replay(ctx, trPath, MCTSIsolated, think, sub)
		if err != nil {
			return &tr, fmt.Errorf("isolated reference: %w", err)
		}
		r.refs[fp] = ref
		r.f.Notes = append(r.f.Notes, fmt.Sprintf("isolated reference (%s s think trajectory, `%s`): the %d expanded nodes' commands took %.3f s (edits, session calls, tests); rebuilding their parents' states took %.1f s, untimed",
			thinkArg(think), line, len(ref.Nodes)-1, ref.CommandsS, ref.Timers["rebuild"].Seconds))
		if _, n, bad := mctsScores(ref.Nodes, tr.Nodes); n > 0 {
			r.f.Notes = append(r.f.Notes, fmt.Sprintf("DIVERGENCE: at %s s think, DeltaBox's search scored %d node(s) differently from the isolated reference (nodes %v)", thinkArg(think), n, bad))
		}
	}
	mctsFinish(&row, thinkTotal, ref, tr.Nodes)
	r.f.MCTS = append(r.f.MCTS, row)

	var errs []error
	for _, sys := range o.Systems {
		if err := ctx.Err(); err != nil {
			return &tr, err
		}
		if sys == MCTSCRIUCopy && !r.probeCRIU(ctx).Usable() {
			// A row that says why, instead of a replay that would wait for ever.
			r.logf("think %s s: %s: unavailable, not run: %s", thinkArg(think), sys, r.criu.Reason)
			r.f.MCTS = append(r.f.MCTS, MCTSRow{System: sys, ThinkS: think, Info: map[string]any{"unavailable": "CRIU is unusable here: " + r.criu.Reason}})
			continue
		}
		r.logf("think %s s: %s", thinkArg(think), sys)
		res, line, err := r.replay(ctx, trPath, sys, think, sub)
		if err != nil {
			// Still a row: the system could not run, and why.
			r.f.MCTS = append(r.f.MCTS, MCTSRow{System: sys, ThinkS: think, Info: map[string]any{"error": err.Error()}})
			r.f.Notes = append(r.f.Notes, fmt.Sprintf("%s at %s s think failed: %v", sys, thinkArg(think), err))
			errs = append(errs, fmt.Errorf("%s: %w", sys, err))
			continue
		}
		row, thinkTotal := mctsReplayRow(res, line)
		mctsFinish(&row, thinkTotal, ref, res.Nodes)
		if sys == MCTSCRIUCopy {
			row.Info["criu_mode"] = string(r.criu.Mode)
		}
		r.f.MCTS = append(r.f.MCTS, row)
		r.logf("think %s s: %s: total %.2f s, state %.3f s, scores match %v", thinkArg(think), sys, row.TotalS, row.StateS, row.ScoresMatch)
	}
	return &tr, errors.Join(errs...)
}

// probeCRIU runs CRIU's self-test once per bench (criu.Probe) and records the answer.
func (r *mctsRun) probeCRIU(ctx context.Context) *criu.Runner {
	if r.criu == nil {
		r.criu = criu.Probe(ctx, r.o.CRIU)
		r.f.Machine.CRIU = r.criu
		r.f.Notes = append(r.f.Notes, "criu: "+criuNote(r.criu))
		r.logf("criu: %s", r.criu)
	}
	return r.criu
}

func (r *mctsRun) replay(ctx context.Context, trPath, system string, think float64, dir string) (*mctsReplay, string, error) {
	out := filepath.Join(dir, strings.ReplaceAll(system, "+", "-")+".json")
	args := []string{"-m", "workload.baselines", "--trajectory", trPath, "--system", system, "--think", thinkArg(think), "--out", out}
	var env []string
	if system == MCTSCRIUCopy {
		args = append(args, "--criu", r.o.CRIU, "--images", r.o.CRIUImages)
		env = r.criu.Env() // workload/baselines.py runs every criu command with it
	}
	line, err := r.python(ctx, r.o.stepTimeout(think), env, args...)
	if err != nil {
		return nil, line, err
	}
	b, err := os.ReadFile(out)
	if err != nil {
		return nil, line, err
	}
	var res mctsReplay
	if err := json.Unmarshal(b, &res); err != nil {
		return nil, line, fmt.Errorf("%s: %w", out, err)
	}
	return &res, line, nil
}

// notes adds what a reader needs to judge the rows.
func (r *mctsRun) notes(tr *mctsTrajectory) {
	f := r.f
	if tr != nil {
		f.Notes = append(f.Notes, fmt.Sprintf("task %v (bugs %v), %d nodes, %d expansions and %d rollbacks; fix found: %v",
			tr.Task["id"], tr.Task["bugs"], len(tr.Nodes), tr.Summary.Expansions, tr.Summary.Rollbacks, tr.Summary.FixFound))
	}
	if n := mctsSeedNote(f.MCTS, r.o.Workload); n != "" {
		f.Notes = append(f.Notes, n)
	}
	vs := MCTSVerdicts(f.MCTS)
	if r.o.Workload == MCTSDjango {
		vs = append(vs, mctsStateFracVerdict(f.MCTS))
	}
	for _, v := range vs {
		if !v.Checked {
			continue
		}
		verdict := "met"
		if !v.Met {
			verdict = "MISSED"
		}
		f.Notes = append(f.Notes, fmt.Sprintf("target %s: %s (%s)", v.Target, verdict, v.Measured))
	}
}

func mctsDescription(o MCTSOptions) string {
	return fmt.Sprintf(`One tree search, run with DeltaBox and then replayed with five other ways of managing state, at each think time (%s s per expansion). The search is examples/mcts.py: %s, %d expansions and %d rollbacks, %d proposals per node. A node's score is the relevant tests passed + 2 if the agent's python session remembers exactly the node's path (its working memory): a rollback that loses the session's process state loses those points from depth 2 on. The search writes trajectory.json (every node's path, its commands, its score; every rollback).

**Rows.** `+"`total_s`"+` is the wall time of the search from the root's checkpoint to the last node (the sandbox's creation, the task's installation and the root's test run are excluded in every row). `+"`state_s`"+` is the time in state management: DeltaBox's checkpoint and restore calls as the client waits for them; for a baseline its checkpoints, rollbacks and session rebuilds (a fresh python session and the replay of the path's recorded session code). `+"`overhead_frac`"+` = (total - think - the same commands' time in the isolated reference run) / total, so it counts state management and whatever it slows down (e.g. the first command after a checkpoint). `+"`scores_match`"+`: every node's score equals the **isolated reference run's**, in which each node's parent state is rebuilt from scratch (the recorded install command, a fresh session, the path's recorded edits and session calls, untimed) before the node's own commands run (timed): a reference that owes nothing to any checkpoint mechanism, DeltaBox's included. DeltaBox's own scores are checked against it like every other row's.

**Where the baselines run.** Every replay runs the recorded commands in a plain DeltaBox sandbox used as a machine (exec and python sessions through the API, no checkpoint), the same image, paths and python as the search, so command times and test results are comparable; file copies for the baselines also run inside it (`+"`cp -a --reflink=auto`"+` on the sandbox's overlay upper, on the store's XFS: the copies share extents). An exec through the API costs a few ms (`+"`exec_true_p50_ms`"+` in each row's details), which the copy and git baselines pay once per checkpoint and rollback, as DeltaBox pays an API call. The session replay sends the path's recorded session code in one call (the cheapest way to rebuild the memory).

- `+"`copytree+replay`"+`: checkpoint = `+"`cp -a --reflink=auto /workspace /snap/N`"+`; rollback = `+"`rm -rf /workspace && cp -a --reflink=auto /snap/N /workspace`"+`, kill the session; a fresh session replays the path's session code before the next session call.
- `+"`fs-only+replay`"+`: DeltaBox's own filesystem checkpoint and restore, without process state: the session is killed before each checkpoint (the node then holds no process template, as with a daemon run with DELTABOX_FASTPATH=0, whose checkpoints end sessions), so a fresh session replays the path after rollbacks and also when a chain continues after a checkpoint; the details split the two (a filesystem-only system whose processes survived checkpoints would pay only the first).
- `+"`fs-only`"+` (negative control): as fs-only+replay, the fresh session does not replay: its scores must differ.
- `+"`git-reset+replay`"+`: checkpoint = `+"`git add -A && git commit`"+` of /workspace/repo into a separate git directory (the repository's own .git, which the agent never changes, is not tracked); rollback = `+"`git reset --hard C && git clean -ffdx`"+`, then the session replay.
- `+"`criu+copytree`"+`: files as copytree+replay; the session is dumped at each checkpoint and restored at each rollback by CRIU (images on tmpfs), no replay. CRIU cannot dump the sandbox's own session process (`+"`criu dump`"+` of it fails: "Can't dump a pid namespace without the process init"), so this row's session is a host python process running the same exec-in-one-globals loop as the daemon's python session, over pipes; its stdin and stdout are handed to the restored process with `+"`--inherit-fd`"+`. Its session calls skip the daemon (faster than the other rows'), which its own command time shows.

Think time is real wall time (time.sleep) before each expansion, in every row; nothing a baseline does overlaps it, while DeltaBox's background work after a checkpoint may. Each row's details give the command line that ran it, with $WORK for the bench's work directory (the trajectories and the per-system results; kept with --keep or --workdir).`,
		floatsString(o.Thinks), mctsWorkloadText(o), o.Expansions, o.Rollbacks, o.K)
}

func floatsString(v []float64) string {
	var s []string
	for _, x := range v {
		s = append(s, thinkArg(x))
	}
	return strings.Join(s, " and ")
}
