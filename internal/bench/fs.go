// Package bench measures DeltaBox from the outside, as a user would: through the
// daemon's API with the Go client, beside baselines run on the same machine in the
// same invocation. Every bench writes a File (JSON); `deltabox bench report` turns the
// files of a directory into docs/BENCHMARKS.md.
package bench

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	mrand "math/rand"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/apitypes"
	"deltabox/internal/client"
	"deltabox/internal/deadline"
)

// FSOptions configures `deltabox bench fs`.
type FSOptions struct {
	SizesMB      []int  `json:"sizes_mb"`      // workspace sizes, one run each
	SmallFiles   int    `json:"small_files"`   // small files (capped at half the bytes)
	LargeFiles   int    `json:"large_files"`   // large files holding the rest
	Checkpoints  int    `json:"checkpoints"`   // timed checkpoints per size
	Restores     int    `json:"restores"`      // timed restores per size
	Changes      int    `json:"changes"`       // files changed before each checkpoint and restore
	MaxDepth     int    `json:"max_depth"`     // main chain length: restore targets have depth 1..MaxDepth
	LargeEvery   int    `json:"large_every"`   // every k-th change also writes into a large file (0: never)
	Seed         int64  `json:"seed"`          // workload and target choice
	BaselineRuns int    `json:"baseline_runs"` // timed checkpoints and restores per copy baseline and size
	BaselineKeep int    `json:"baseline_keep"` // snapshots a baseline keeps (older ones are deleted, untimed)
	Baselines    bool   `json:"baselines"`     // run the copy baselines
	Image        string `json:"image"`
	HostDir      string `json:"host_dir"` // baseline copies; must be on the store's reflink filesystem
	Socket       string `json:"socket"`

	Notes   []string  `json:"-"` // context the bench cannot see (where the daemon runs, ...)
	Command string    `json:"-"` // the command line, recorded in the output
	Log     io.Writer `json:"-"` // progress (nil: none)
}

// DefaultFSOptions are the parameters.
func DefaultFSOptions() FSOptions {
	return FSOptions{
		SizesMB: []int{1024}, SmallFiles: 20000, LargeFiles: 4, Checkpoints: 200, Restores: 200,
		Changes: 100, MaxDepth: 100, LargeEvery: 10, Seed: 1, BaselineRuns: 20, BaselineKeep: 10,
		Baselines: true, Image: "default",
	}
}

// Workspace describes one size's workspace and what happened to its tree.
type Workspace struct {
	MB         int    `json:"workspace_mb"`
	Bytes      int64  `json:"bytes"`
	Files      int    `json:"files"`
	SmallFiles int    `json:"small_files"`
	SmallBytes int64  `json:"small_bytes"`
	LargeFiles int    `json:"large_files"`
	SHA256     string `json:"sha256"` // checksumPy of the generated workspace, in the sandbox
	// HostIdentical: the baselines' host copy has the same checksum.
	HostIdentical bool    `json:"host_identical"`
	GenerateS     float64 `json:"generate_s"` // writing the workspace in the sandbox (exec)
	// InitialCheckpointMS is the untimed-in-rows checkpoint that freezes the freshly
	// generated workspace (all its files in one layer): the chain's root, depth 1.
	InitialCheckpointMS float64 `json:"initial_checkpoint_ms"`
	Sandbox             string  `json:"sandbox"`
	TreeNodes           int     `json:"tree_nodes"`
	MaxDepth            int     `json:"max_depth"`
	FilesChanged        *Layers `json:"files_changed_per_step"` // per change exec (min/p50/mean/max)
	ChangeExecP50MS     float64 `json:"change_exec_p50_ms"`
	MarkerChecks        int     `json:"marker_checks"`
	MarkerFailures      int     `json:"marker_failures"`
	// LoadAvg is the 1-minute load average when the deltabox part of this size
	// started and ended: other work on the machine disturbs the numbers.
	LoadAvg [2]float64 `json:"loadavg_deltabox"`
	// Baseline proof: shared/total extents of a large file of the first snapshot.
	SnapshotShared map[string]string `json:"snapshot_shared_extents,omitempty"`
}

type sample struct {
	wall, withExec, exec, exec2, daemon float64
	phases                              map[string]int64
	depth                               int
	mounted                             bool
	fast                                bool // restore: installed a warm state; checkpoint: used the prepared next state
}

type treeNode struct {
	id, label string
	depth     int
}

type fsRun struct {
	c     *client.Client
	o     FSOptions
	mb    int
	f     *File
	ws    *Workspace
	start time.Time
	rng   *mrand.Rand
	sb    string
	round int

	ckpts, rests []sample
	changeMS     []float64
	changed      []int
	dirty        bool // the sandbox's upper holds changes (a change step ran since the last op)
	dirtyRests   int  // restores that discarded a dirty upper
}

func (r *fsRun) logf(format string, a ...any) {
	progress(r.o.Log, r.start, fmt.Sprintf("%4d MB: ", r.mb)+format, a...)
}

func (r *fsRun) note(format string, a ...any) {
	r.f.Notes = append(r.f.Notes, mbCell(r.mb)+": "+fmt.Sprintf(format, a...))
}

func ms(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e6 }

func randHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// RunFS runs the filesystem bench for every size and returns its File. On error the
// File holds what was measured so far; the bench's sandbox, nodes and host copies are
// removed in every case.
func RunFS(ctx context.Context, c *client.Client, o FSOptions) (*File, error) {
	start := time.Now()
	f := &File{Bench: "fs", Command: o.Command, Machine: CurrentMachine(), Started: start.UTC()}
	settings, _ := json.Marshal(o)
	json.Unmarshal(settings, &f.Settings)
	f.Targets = []Target{
		{System: "deltabox", Op: "checkpoint", Stat: "p50_ms", MaxMS: 1},
		{System: "deltabox", Op: "restore", Stat: "p50_ms", MaxMS: 1.5},
	}
	f.Description = fsDescription(o)
	f.Notes = append(f.Notes, o.Notes...)
	if err := c.Health(ctx); err != nil {
		return f, err
	}
	if o.Baselines {
		if err := os.MkdirAll(o.HostDir, 0o700); err != nil {
			return f, fmt.Errorf("baseline directory: %w", err)
		}
		defer os.RemoveAll(o.HostDir)
		f.Machine.StoreFS = fsType(o.HostDir)
		if t := f.Machine.StoreFS; t != "xfs" && t != "btrfs" {
			f.Notes = append(f.Notes, fmt.Sprintf("the baselines ran on %s, not on the store's reflink filesystem: cp --reflink=auto copies data there", t))
		}
		if out, err := deadline.Command(ctx, shortTimeout, "python3", "--version").CombinedOutput(); err == nil {
			f.Machine.Python = strings.TrimSpace(string(out))
		} else {
			return f, fmt.Errorf("the copy baselines need python3 on the host to write the same workspace: %v", err)
		}
	}
	var errs error
	for _, mb := range o.SizesMB {
		r := &fsRun{c: c, o: o, mb: mb, f: f, start: start, rng: mrand.New(mrand.NewSource(o.Seed + int64(mb))),
			ws: &Workspace{MB: mb, MaxDepth: o.MaxDepth}}
		f.Workspaces = append(f.Workspaces, Workspace{})
		rows, err := r.deltabox(ctx)
		f.Results = append(f.Results, rows...)
		if err == nil && o.Baselines {
			syncfs(o.HostDir)
			rows, err = r.baselines(ctx)
			f.Results = append(f.Results, rows...)
		}
		f.Workspaces[len(f.Workspaces)-1] = *r.ws
		if err != nil {
			errs = fmt.Errorf("%d MB: %w", mb, err)
			break
		}
		syncfs(o.HostDir)
	}
	f.Finished = time.Now().UTC()
	f.DurationS = float64(int(time.Since(start).Seconds()*10)) / 10
	f.Machine.LoadAvgEnd = LoadAvg()
	if f.Machine.LoadAvgStart > 1 || f.Machine.LoadAvgEnd > 1 {
		f.Notes = append(f.Notes, fmt.Sprintf("1-minute load average %.2f at the start and %.2f at the end on %d CPUs: other work ran on the machine, so tails (p95/p99) are noisier than on an idle machine",
			f.Machine.LoadAvgStart, f.Machine.LoadAvgEnd, f.Machine.CPUs))
	}
	return f, errs
}

func fsDescription(o FSOptions) string {
	var b strings.Builder
	fmt.Fprintf(&b, "Filesystem checkpoint and restore of a sandbox's workspace (`/workspace`): about %d small files (64 B-4 KiB text, "+
		"at most half the bytes) in 1000 directories plus %d large files of random bytes holding the rest, written inside the sandbox "+
		"by a seeded Python script (seed %d). ", o.SmallFiles, o.LargeFiles, o.Seed)
	fmt.Fprintf(&b, "The generated workspace is checkpointed once (the root node, depth 1; not in the rows). Then a chain of checkpoints "+
		"reaches depth %[1]d, each after one exec that changes %[2]d files (90%% rewritten or appended, 5%% deleted, 5%% new; every %[3]dth "+
		"step also 64 KiB inside a large file). Then %[4]d restores go to random nodes of depth 1-%[1]d: the depths come in shuffled "+
		"rounds of 1-%[1]d (each depth equally often) and the node is drawn among the chain's and the branch nodes made so far at that "+
		"depth. Each restore follows %[2]d more changed files, so that it discards a dirty upper, and is checked (untimed): a marker "+
		"file must read the target's label. After some restores a branch checkpoint (again after %[2]d changes) brings the timed "+
		"checkpoints to %[5]d.\n\n", o.MaxDepth, o.Changes, o.LargeEvery, o.Restores, o.Checkpoints)
	b.WriteString("`deltabox` rows are the wall time of the Go client call (`client.Checkpoint`, `client.Restore`) on the daemon's unix " +
		"socket: what a user of the API waits for; the sandbox can run its next command when the call returns. The `+exec` rows add the " +
		"first command after it (`client.Exec` of `true`), timed in the same samples, to show that the sandbox is usable at once. " +
		"`layers` is the depth of the mounted stack (frozen layers under the fresh upper, image excluded). The daemon may mount states " +
		"ahead of time, in the background (a prepared next state for a checkpoint, warm states of nodes for a restore); its answers say " +
		"when an operation used one, counted in the details (`prepared`, `warm`), and the background work competes with the sandbox's " +
		"next command, which the `+exec` rows and the settled second command (`second_exec`) show.\n\n")
	fmt.Fprintf(&b, "Baselines run in the same invocation on a host copy of the same workspace (same script and seed, checksum compared), on "+
		"the store's filesystem, with the same %d-file changes before every operation: `cp-reflink` snapshots with `cp --reflink=auto -a` "+
		"(reflinked extents on XFS), `copytree` with `cp -a --reflink=never` (a full copy of the data; GNU cp rather than Python's "+
		"`shutil.copytree`, which on newer Pythons may reflink through copy_file_range). Restore is `rm -rf WS` then a copy of a random "+
		"earlier snapshot back to WS; the baselines keep their last %d snapshots. Which extents a snapshot shares is checked with FIEMAP. "+
		"Baselines have fewer samples (n says how many). Percentiles are nearest-rank.", o.Changes, o.BaselineKeep)
	return b.String()
}

// ---- deltabox ----

func (r *fsRun) py(ctx context.Context, script string, args ...string) (string, error) {
	argv := append([]string{"python3", "-c", script}, args...)
	res, err := r.c.Exec(ctx, r.sb, apitypes.ExecRequest{Argv: argv, TimeoutMS: (30 * time.Minute).Milliseconds()})
	if err != nil {
		return "", err
	}
	if res.ExitCode != 0 {
		return "", fmt.Errorf("python in the sandbox exited %d: %s", res.ExitCode, strings.TrimSpace(res.Stderr))
	}
	return res.Stdout, nil
}

// change runs one change step (changePy) in the sandbox, or on the host when dir is set.
func (r *fsRun) change(ctx context.Context, hostDir, label string) error {
	r.round++
	args := []string{"", strconv.FormatInt(r.o.Seed, 10), strconv.Itoa(r.round), strconv.Itoa(r.o.Changes), strconv.Itoa(r.o.LargeEvery), label}
	var out string
	var err error
	t := time.Now()
	if hostDir != "" {
		args[0] = hostDir
		out, err = hostPy(ctx, changePy, args...)
	} else {
		args[0] = "/workspace"
		out, err = r.py(ctx, changePy, args...)
	}
	if err != nil {
		return fmt.Errorf("change step %d: %w", r.round, err)
	}
	if hostDir == "" {
		r.changeMS = append(r.changeMS, ms(time.Since(t)))
		var st struct{ Files int }
		if err := json.Unmarshal([]byte(out), &st); err != nil {
			return fmt.Errorf("change step %d: %v: %q", r.round, err, out)
		}
		r.changed = append(r.changed, st.Files)
		r.dirty = r.dirty || st.Files > 0
	}
	return nil
}

func (r *fsRun) trueExec(ctx context.Context) error {
	res, err := r.c.Exec(ctx, r.sb, apitypes.ExecRequest{Argv: []string{"true"}})
	if err != nil {
		return err
	}
	if res.ExitCode != 0 {
		return fmt.Errorf("exec true exited %d: %s", res.ExitCode, res.Stderr)
	}
	return nil
}

func (r *fsRun) checkpoint(ctx context.Context, label string) (treeNode, error) {
	t0 := time.Now()
	res, err := r.c.Checkpoint(ctx, r.sb, label)
	t1 := time.Now()
	if err != nil {
		return treeNode{}, fmt.Errorf("checkpoint %s: %w", label, err)
	}
	if err := r.trueExec(ctx); err != nil {
		return treeNode{}, fmt.Errorf("exec after checkpoint %s: %w", label, err)
	}
	t2 := time.Now()
	// Untimed in the op: a second command, to compare the first one after the op with
	// a command on a settled sandbox.
	if err := r.trueExec(ctx); err != nil {
		return treeNode{}, fmt.Errorf("second exec after checkpoint %s: %w", label, err)
	}
	exec2 := ms(time.Since(t2))
	r.dirty = false
	r.ckpts = append(r.ckpts, sample{wall: ms(t1.Sub(t0)), withExec: ms(t2.Sub(t0)), exec: ms(t2.Sub(t1)), exec2: exec2,
		daemon: res.DurationMS, phases: res.PhasesUS, depth: res.Node.Depth, mounted: res.Mounted, fast: res.Prepared})
	return treeNode{id: res.Node.ID, label: label, depth: res.Node.Depth}, nil
}

func (r *fsRun) restore(ctx context.Context, n treeNode) error {
	t0 := time.Now()
	res, err := r.c.Restore(ctx, r.sb, n.id)
	t1 := time.Now()
	if err != nil {
		return fmt.Errorf("restore to %s (depth %d): %w", n.id, n.depth, err)
	}
	if err := r.trueExec(ctx); err != nil {
		return fmt.Errorf("exec after restore to %s: %w", n.id, err)
	}
	t2 := time.Now()
	if err := r.trueExec(ctx); err != nil {
		return fmt.Errorf("second exec after restore to %s: %w", n.id, err)
	}
	exec2 := ms(time.Since(t2))
	if r.dirty {
		r.dirtyRests++
	}
	r.dirty = false
	depth := n.depth
	if res.Node != nil {
		depth = res.Node.Depth
	}
	r.rests = append(r.rests, sample{wall: ms(t1.Sub(t0)), withExec: ms(t2.Sub(t0)), exec: ms(t2.Sub(t1)), exec2: exec2,
		daemon: res.DurationMS, phases: res.PhasesUS, depth: depth, mounted: res.Mounted, fast: res.Warm})
	// Untimed: the sandbox must now show the node's files.
	r.ws.MarkerChecks++
	out, err := r.c.Exec(ctx, r.sb, apitypes.ExecRequest{Argv: []string{"cat", "/workspace/.bench/marker"}})
	if err != nil || out.ExitCode != 0 || out.Stdout != n.label {
		r.ws.MarkerFailures++
		got := "?"
		if out != nil {
			got = out.Stdout + out.Stderr
		}
		if r.ws.MarkerFailures <= 3 {
			r.note("after restore to node %s (label %s) the marker read %q (err %v): the sandbox does not show the node's files", n.id, n.label, got, err)
		}
	}
	return nil
}

func (r *fsRun) deltabox(ctx context.Context) (rows []Row, err error) {
	c := r.c
	name := "bench-fs-" + randHex(4)
	r.logf("deltabox: create sandbox %s", name)
	r.ws.LoadAvg[0] = LoadAvg()
	defer func() { r.ws.LoadAvg[1] = LoadAvg() }()
	if _, err := c.Create(ctx, apitypes.CreateOptions{ID: name, Image: r.o.Image, Workdir: "/workspace"}); err != nil {
		return nil, fmt.Errorf("create sandbox: %w", err)
	}
	r.sb, r.ws.Sandbox = name, name
	var root string
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		if e := c.Remove(cctx, name); e != nil {
			err = errors.Join(err, fmt.Errorf("cleanup: remove sandbox %s: %w", name, e))
		}
		if root != "" {
			if _, e := c.RemoveNode(cctx, root); e != nil {
				err = errors.Join(err, fmt.Errorf("cleanup: remove node %s and its subtree: %w", root, e))
			}
		}
		r.logf("deltabox: removed sandbox %s and the tree under %s", name, root)
	}()

	r.logf("deltabox: generate the workspace in the sandbox")
	t := time.Now()
	out, err := r.py(ctx, genPy, "/workspace", strconv.FormatInt(r.o.Seed, 10), strconv.Itoa(r.mb), strconv.Itoa(r.o.SmallFiles), strconv.Itoa(r.o.LargeFiles))
	if err != nil {
		return nil, fmt.Errorf("generate workspace: %w", err)
	}
	r.ws.GenerateS = float64(int(time.Since(t).Seconds()*10)) / 10
	var meta struct {
		Small      int
		SmallBytes int64 `json:"small_bytes"`
		Large      [][2]any
		Bytes      int64
	}
	if err := json.Unmarshal([]byte(out), &meta); err != nil {
		return nil, fmt.Errorf("generate workspace: %v: %q", err, out)
	}
	r.ws.SmallFiles, r.ws.SmallBytes, r.ws.LargeFiles, r.ws.Bytes = meta.Small, meta.SmallBytes, len(meta.Large), meta.Bytes
	if out, err = r.py(ctx, checksumPy, "/workspace"); err != nil {
		return nil, fmt.Errorf("checksum workspace: %w", err)
	}
	var cs checksum
	if err := json.Unmarshal([]byte(out), &cs); err != nil {
		return nil, fmt.Errorf("checksum: %v: %q", err, out)
	}
	r.ws.SHA256, r.ws.Files = cs.SHA256, cs.Files
	r.logf("deltabox: %d files, %d bytes (%d small files) in %.1fs", cs.Files, cs.Bytes, meta.Small, r.ws.GenerateS)

	t = time.Now()
	res, err := c.Checkpoint(ctx, name, "base")
	if err != nil {
		return nil, fmt.Errorf("initial checkpoint: %w", err)
	}
	r.ws.InitialCheckpointMS = us(ms(time.Since(t)))
	root = res.Node.ID
	base := treeNode{id: root, label: "base", depth: res.Node.Depth}
	// The generated data is still dirty in the page cache: flush it before timing.
	if err := c.Sync(ctx); err != nil {
		return nil, err
	}
	syncfs(r.o.HostDir)
	pool := []treeNode{base}

	chain := r.o.MaxDepth - base.depth
	if chain > r.o.Checkpoints || r.o.Restores == 0 {
		chain = r.o.Checkpoints
	}
	if chain < 0 {
		chain = 0
	}
	branch := r.o.Checkpoints - chain
	r.logf("deltabox: chain of %d checkpoints from depth %d", chain, base.depth)
	for i := 1; i <= chain; i++ {
		label := fmt.Sprintf("c%03d", i)
		if err := r.change(ctx, "", label); err != nil {
			return nil, err
		}
		n, err := r.checkpoint(ctx, label)
		if err != nil {
			return nil, err
		}
		if n.depth <= r.o.MaxDepth {
			pool = append(pool, n)
		}
		if i%50 == 0 {
			r.logf("deltabox: %d checkpoints, depth %d, last %.3f ms", i, n.depth, r.ckpts[len(r.ckpts)-1].wall)
		}
	}
	r.logf("deltabox: %d restores to nodes of depth <= %d (%d candidates now), %d branch checkpoints", r.o.Restores, r.o.MaxDepth, len(pool), branch)
	targets := map[string]bool{}
	var depths []int
	bi := 0
	for j := 0; j < r.o.Restores; j++ {
		if err := r.change(ctx, "", fmt.Sprintf("dirty%03d", j)); err != nil {
			return nil, err
		}
		// Depths come in shuffled rounds of 1..MaxDepth, so that every depth is
		// restored to equally often; the node is drawn among those of that depth.
		if len(depths) == 0 {
			for _, p := range r.rng.Perm(r.o.MaxDepth) {
				depths = append(depths, p+1)
			}
		}
		want := depths[0]
		depths = depths[1:]
		var at []treeNode
		for _, c := range pool {
			if c.depth == want {
				at = append(at, c)
			}
		}
		if len(at) == 0 { // a shorter chain than MaxDepth (few checkpoints): any node
			at = pool
		}
		n := at[r.rng.Intn(len(at))]
		targets[n.id] = true
		if err := r.restore(ctx, n); err != nil {
			return nil, err
		}
		k := (j+1)*branch/r.o.Restores - j*branch/r.o.Restores
		for x := 0; x < k; x++ {
			bi++
			label := fmt.Sprintf("b%03d", bi)
			if err := r.change(ctx, "", label); err != nil {
				return nil, err
			}
			m, err := r.checkpoint(ctx, label)
			if err != nil {
				return nil, err
			}
			if m.depth <= r.o.MaxDepth {
				pool = append(pool, m)
			}
		}
		if (j+1)%50 == 0 {
			r.logf("deltabox: %d restores, last %.3f ms", j+1, r.rests[len(r.rests)-1].wall)
		}
	}
	if tr, err := c.Tree(ctx); err == nil {
		for _, n := range tr.Nodes {
			if n.Sandbox == name {
				r.ws.TreeNodes++
			}
		}
	}
	r.ws.FilesChanged = LayerDist(r.changed)
	r.ws.ChangeExecP50MS = us(Summarize(r.changeMS).P50)
	if r.ws.MarkerFailures > 0 {
		r.note("%d of %d restores showed the wrong files (marker check): a daemon bug", r.ws.MarkerFailures, r.ws.MarkerChecks)
	}
	for _, x := range []struct {
		op string
		ss []sample
	}{{"checkpoint", r.ckpts}, {"restore", r.rests}} {
		var first, second []float64
		for _, s := range x.ss {
			first, second = append(first, s.exec), append(second, s.exec2)
		}
		f, s := Summarize(first).P50, Summarize(second).P50
		if f > 1.5*s && f-s > 1 {
			r.note("the first command after a %[1]s took %[2]s ms (p50), the next one %[3]s ms: the sandbox runs its first command "+
				"%[4]s ms slower after the call has returned (work left running in the background, or caches of the new mount still cold); "+
				"the %[1]s+exec row includes it", x.op, fmtMS(f), fmtMS(s), fmtMS(f-s))
		}
	}
	var warm, prepared int
	for _, s := range r.rests {
		if s.fast {
			warm++
		}
	}
	for _, s := range r.ckpts {
		if s.fast {
			prepared++
		}
	}
	r.note("%d of %d restores installed a state the daemon had mounted ahead of time (warm), %d of %d checkpoints used a prepared "+
		"next state (from the daemon's answers; the tree had %d nodes); the mounting these save is done in the background",
		warm, len(r.rests), prepared, len(r.ckpts), r.ws.TreeNodes)
	return r.deltaboxRows(len(targets), len(pool), chain, branch), nil
}

func (r *fsRun) deltaboxRows(distinct, pool, chain, branch int) []Row {
	depths := func(ss []sample) []int {
		out := make([]int, len(ss))
		for i, s := range ss {
			out[i] = s.depth
		}
		return out
	}
	mounted := func(ss []sample) (n int) {
		for _, s := range ss {
			if s.mounted {
				n++
			}
		}
		return n
	}
	fast := func(ss []sample) (n int) {
		for _, s := range ss {
			if s.fast {
				n++
			}
		}
		return n
	}
	wall := func(s sample) float64 { return s.wall }
	withExec := func(s sample) float64 { return s.withExec }
	execT := func(s sample) float64 { return s.exec }
	exec2 := func(s sample) float64 { return s.exec2 }
	daemon := func(s sample) float64 { return s.daemon }
	overhead := func(s sample) float64 { return s.wall - s.daemon }
	const (
		ckCall = "client.Checkpoint(ctx, sandbox, label): POST /v1/sandboxes/{id}/checkpoint"
		rsCall = "client.Restore(ctx, sandbox, node): POST /v1/sandboxes/{id}/restore"
		exCall = `client.Exec(ctx, sandbox, {argv: ["true"]}): POST /v1/sandboxes/{id}/exec`
	)
	var rows []Row
	if len(r.ckpts) > 0 {
		d := Summarize(pick(r.ckpts, daemon))
		row := Summarize(pick(r.ckpts, wall)).Row("deltabox", "checkpoint", r.mb, ckCall)
		row.Layers = LayerDist(depths(r.ckpts))
		row.Info = map[string]any{
			"daemon_p50_ms": us(d.P50), "daemon_p95_ms": us(d.P95), "phases_p50_us": phasesP50(r.ckpts),
			"mounted": mounted(r.ckpts), "chain": chain, "branch": branch, "files_changed_before_each": r.o.Changes,
		}
		row.Info["client_minus_daemon_p50_ms"] = us(Summarize(pick(r.ckpts, overhead)).P50)
		// The daemon's answer says whether the next state was mounted ahead of time.
		row.Info["prepared"] = fast(r.ckpts)
		rows = append(rows, row)
		row = Summarize(pick(r.ckpts, withExec)).Row("deltabox", "checkpoint+exec", r.mb, ckCall, exCall)
		row.Layers = LayerDist(depths(r.ckpts))
		e, e2 := Summarize(pick(r.ckpts, execT)), Summarize(pick(r.ckpts, exec2))
		row.Info = map[string]any{"exec_p50_ms": us(e.P50), "exec_p95_ms": us(e.P95), "second_exec_p50_ms": us(e2.P50), "second_exec_p95_ms": us(e2.P95)}
		rows = append(rows, row)
	}
	if len(r.rests) > 0 {
		d := Summarize(pick(r.rests, daemon))
		row := Summarize(pick(r.rests, wall)).Row("deltabox", "restore", r.mb, rsCall)
		row.Layers = LayerDist(depths(r.rests))
		row.Info = map[string]any{
			"daemon_p50_ms": us(d.P50), "daemon_p95_ms": us(d.P95), "phases_p50_us": phasesP50(r.rests),
			"distinct_nodes": distinct, "candidate_nodes": pool, "mounted": mounted(r.rests),
			"dirty_upper": r.dirtyRests, "marker_checks_failed": r.ws.MarkerFailures,
		}
		row.Info["client_minus_daemon_p50_ms"] = us(Summarize(pick(r.rests, overhead)).P50)
		// The daemon's answer says whether the node's state was mounted ahead of time.
		row.Info["warm"] = fast(r.rests)
		rows = append(rows, row)
		row = Summarize(pick(r.rests, withExec)).Row("deltabox", "restore+exec", r.mb, rsCall, exCall)
		row.Layers = LayerDist(depths(r.rests))
		e, e2 := Summarize(pick(r.rests, execT)), Summarize(pick(r.rests, exec2))
		row.Info = map[string]any{"exec_p50_ms": us(e.P50), "exec_p95_ms": us(e.P95), "second_exec_p50_ms": us(e2.P50), "second_exec_p95_ms": us(e2.P95)}
		rows = append(rows, row)
	}
	return rows
}

// phasesP50 is the median of each daemon phase, in microseconds.
func phasesP50(ss []sample) map[string]float64 {
	return phaseMedians(ss, func(s sample) map[string]int64 { return s.phases })
}

// ---- baselines ----

type checksum struct {
	SHA256 string `json:"sha256"`
	Files  int    `json:"files"`
	Bytes  int64  `json:"bytes"`
}

// Deadlines of the benches' host commands. Writing a 1 GiB workspace (the generator)
// took 9-20 s here and copying one with reflinks well under a second: a host command
// still running after 10 minutes hangs. Version queries answer at once.
const (
	hostTimeout  = 10 * time.Minute
	shortTimeout = 30 * time.Second
)

// hostPy runs a python script on the host (the workspace generator, checksums).
func hostPy(ctx context.Context, script string, args ...string) (string, error) {
	cmd := deadline.Command(ctx, hostTimeout, "python3", append([]string{"-c", script}, args...)...)
	cmd.What = "python3 on the host (" + strings.Join(args, " ") + ")"
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("python3 on the host: %w: %s", err, strings.TrimSpace(stderr.String()))
	}
	return string(out), nil
}

// run runs a host command (cp, rm) to completion.
func run(ctx context.Context, name string, args ...string) error {
	cmd := deadline.Command(ctx, hostTimeout, name, args...)
	cmd.What = name + " " + strings.Join(args, " ")
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

func syncfs(dir string) {
	if dir == "" {
		return
	}
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return
	}
	unix.Syncfs(fd)
	unix.Close(fd)
}

func (r *fsRun) baselines(ctx context.Context) ([]Row, error) {
	host := filepath.Join(r.o.HostDir, fmt.Sprintf("ws-%dmb", r.mb))
	os.RemoveAll(host)
	if err := os.MkdirAll(host, 0o700); err != nil {
		return nil, err
	}
	defer os.RemoveAll(host)
	gen := filepath.Join(host, "gen")
	r.logf("baselines: generate the same workspace on the host in %s", host)
	if _, err := hostPy(ctx, genPy, gen, strconv.FormatInt(r.o.Seed, 10), strconv.Itoa(r.mb), strconv.Itoa(r.o.SmallFiles), strconv.Itoa(r.o.LargeFiles)); err != nil {
		return nil, err
	}
	out, err := hostPy(ctx, checksumPy, gen)
	if err != nil {
		return nil, err
	}
	var cs checksum
	if err := json.Unmarshal([]byte(out), &cs); err != nil {
		return nil, fmt.Errorf("host checksum: %v: %q", err, out)
	}
	r.ws.HostIdentical = cs.SHA256 == r.ws.SHA256
	if !r.ws.HostIdentical {
		r.note("the host copy of the workspace differs from the sandbox's (%d files, %d bytes vs %d files, %d bytes): "+
			"python versions differ? the baselines still copy a workspace of the same shape", cs.Files, cs.Bytes, r.ws.Files, r.ws.Bytes)
	}
	r.ws.SnapshotShared = map[string]string{}
	var rows []Row
	for _, b := range []struct{ system, flag string }{{"cp-reflink", "--reflink=auto"}, {"copytree", "--reflink=never"}} {
		rs, err := r.baseline(ctx, host, gen, b.system, b.flag)
		rows = append(rows, rs...)
		if err != nil {
			return rows, err
		}
		syncfs(host)
	}
	return rows, nil
}

func (r *fsRun) baseline(ctx context.Context, host, gen, system, flag string) ([]Row, error) {
	dir := filepath.Join(host, system)
	ws := filepath.Join(dir, "WS")
	defer os.RemoveAll(dir)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	// The starting workspace, untimed.
	if err := run(ctx, "cp", "-a", "--reflink=always", gen, ws); err != nil {
		return nil, err
	}
	syncfs(dir)
	n := r.o.BaselineRuns
	r.logf("baselines: %s, %d checkpoints and %d restores", system, n, n)
	type snap struct{ path, label string }
	var snaps []snap
	var ck, rs []float64
	for i := 0; i < n; i++ {
		label := fmt.Sprintf("%s-c%03d", system, i)
		if err := r.change(ctx, ws, label); err != nil {
			return nil, err
		}
		s := snap{filepath.Join(dir, fmt.Sprintf("SNAP_%03d", i)), label}
		t := time.Now()
		if err := run(ctx, "cp", "-a", flag, ws, s.path); err != nil {
			return nil, err
		}
		ck = append(ck, ms(time.Since(t)))
		if i == 0 {
			if sh, tot, err := sharedExtents(filepath.Join(s.path, "data", "blob0.bin")); err == nil {
				r.ws.SnapshotShared[system] = fmt.Sprintf("%d/%d", sh, tot)
			} else {
				r.ws.SnapshotShared[system] = err.Error()
			}
		}
		snaps = append(snaps, s)
		if r.o.BaselineKeep > 0 && len(snaps) > r.o.BaselineKeep {
			os.RemoveAll(snaps[0].path)
			snaps = snaps[1:]
		}
	}
	failures := 0
	for j := 0; j < n && len(snaps) > 0; j++ {
		if err := r.change(ctx, ws, fmt.Sprintf("%s-dirty%03d", system, j)); err != nil {
			return nil, err
		}
		s := snaps[r.rng.Intn(len(snaps))]
		t := time.Now()
		if err := run(ctx, "rm", "-rf", ws); err != nil {
			return nil, err
		}
		if err := run(ctx, "cp", "-a", flag, s.path, ws); err != nil {
			return nil, err
		}
		rs = append(rs, ms(time.Since(t)))
		if b, err := os.ReadFile(filepath.Join(ws, ".bench", "marker")); err != nil || string(b) != s.label {
			failures++
		}
	}
	if failures > 0 {
		r.note("%s: %d restores did not bring back the snapshot's marker", system, failures)
	}
	rc := Summarize(ck).Row(system, "checkpoint", r.mb, fmt.Sprintf("cp -a %s WS SNAP_i", flag))
	rc.Info = map[string]any{"snapshot_shared_extents": r.ws.SnapshotShared[system]}
	rr := Summarize(rs).Row(system, "restore", r.mb, "rm -rf WS", fmt.Sprintf("cp -a %s SNAP_k WS", flag))
	rr.Info = map[string]any{"snapshots_kept": len(snaps), "dirty_workspace": len(rs)}
	return []Row{rc, rr}, nil
}

// ---- table ----

// FormatTable prints rows as a plain-text table.
func FormatTable(rows []Row) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%-11s %-16s %7s %10s %10s %10s %10s %10s %5s  %s\n", "SYSTEM", "OP", "WS_MB", "P50_MS", "P95_MS", "P99_MS", "MEAN_MS", "MAX_MS", "N", "LAYERS")
	for _, r := range rows {
		if why := r.Unavailable(); why != "" {
			fmt.Fprintf(&b, "%-11s %-16s %7s  unavailable: %s\n", r.System, r.Op, mbString(r.WorkspaceMB), why)
			continue
		}
		fmt.Fprintf(&b, "%-11s %-16s %7s %10s %10s %10s %10s %10s %5d  %s\n", r.System, r.Op, mbString(r.WorkspaceMB),
			fmtMS(r.P50), fmtMS(r.P95), fmtMS(r.P99), fmtMS(r.Mean), fmtMS(r.Max), r.N, layersString(r.Layers))
	}
	return b.String()
}

// FormatTargets says, per target and row, whether it was met.
func FormatTargets(f *File) string {
	var b strings.Builder
	for _, t := range f.Targets {
		for _, r := range f.Results {
			if r.System != t.System || r.Op != t.Op {
				continue
			}
			v, _ := r.Value(t.Stat)
			verdict := "met"
			if v > t.MaxMS {
				verdict = "MISSED"
			}
			fmt.Fprintf(&b, "target %s %s %s <= %s ms at %s MB: %s ms, %s\n", t.System, t.Op, strings.TrimSuffix(t.Stat, "_ms"),
				fmtMS(t.MaxMS), mbString(r.WorkspaceMB), fmtMS(v), verdict)
		}
	}
	return b.String()
}

func mbString(mb int) string {
	if mb == 0 {
		return "-"
	}
	return strconv.Itoa(mb)
}

func fmtMS(v float64) string {
	switch {
	case v < 10:
		return strconv.FormatFloat(v, 'f', 3, 64)
	case v < 100:
		return strconv.FormatFloat(v, 'f', 2, 64)
	case v < 1000:
		return strconv.FormatFloat(v, 'f', 1, 64)
	}
	return strconv.FormatFloat(v, 'f', 0, 64)
}

func layersString(l *Layers) string {
	if l == nil {
		return "-"
	}
	if l.Min == l.Max {
		return strconv.Itoa(l.Min)
	}
	return fmt.Sprintf("%d-%d (mean %.1f)", l.Min, l.Max, l.Mean)
}

// sortedKeys returns m's keys in order.
func sortedKeys[V any](m map[string]V) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}
