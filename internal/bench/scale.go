package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	mrand "math/rand"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/client"
	"deltabox/internal/errdefs"
)

// ScaleOptions configures `deltabox bench scale`: restore (and checkpoint) latency
// against the depth of the snapshot tree, the size of the workspace and the memory
// of a live python session. An empty list skips that dimension.
type ScaleOptions struct {
	Depths       []int `json:"depths"`        // depth of the restored node (layers in its stack)
	WorkspacesMB []int `json:"workspaces_mb"` // MiB of files in /workspace
	RSSMB        []int `json:"rss_mb"`        // MiB of heap a python session holds
	// Samples is the number of timed restores and timed checkpoints per point.
	Samples int `json:"samples"`
	// ColdSamples is the number of timed cold restores per depth and workspace point:
	// each in a sandbox that has never mounted the node (warm states are per sandbox).
	ColdSamples int    `json:"cold_samples"`
	Files       int    `json:"files"` // files written before every checkpoint and restore
	SmallFiles  int    `json:"small_files"`
	LargeFiles  int    `json:"large_files"`
	Seed        int64  `json:"seed"`
	Image       string `json:"image"`
	Socket      string `json:"socket"`

	Notes   []string  `json:"-"`
	Command string    `json:"-"`
	Log     io.Writer `json:"-"`
}

// DefaultScaleOptions are the points; a full run takes about 10 minutes on 2 cores.
func DefaultScaleOptions() ScaleOptions {
	return ScaleOptions{
		Depths:       []int{1, 10, 50, 100, 200, 400, 1000},
		WorkspacesMB: []int{10, 100, 1024, 4096},
		RSSMB:        []int{10, 100, 1024, 2048},
		Samples:      100, ColdSamples: 100, Files: 5, SmallFiles: 20000, LargeFiles: 4, Seed: 1, Image: "default",
	}
}

// MaxScaleDepth is the deepest point. A node's depth here is its chain's length (one
// layer per checkpoint); past the daemon's squash depth the layers a restore mounts
// stay fewer (docs/design/squash.md), so overlayfs's 500 lowers no longer bound it.
const MaxScaleDepth = 5000

// Check validates the options.
func (o ScaleOptions) Check() error {
	var errs []error
	if o.Samples < 1 || o.ColdSamples < 0 || o.Files < 1 {
		errs = append(errs, fmt.Errorf("samples and files must be >= 1, cold samples >= 0"))
	}
	for i, d := range o.Depths {
		if d < 1 || d > MaxScaleDepth {
			errs = append(errs, fmt.Errorf("depth %d: want 1-%d", d, MaxScaleDepth))
		}
		if i > 0 && d <= o.Depths[i-1] {
			errs = append(errs, fmt.Errorf("depths must be increasing: %v", o.Depths))
		}
	}
	for _, l := range [][]int{o.WorkspacesMB, o.RSSMB} {
		for _, v := range l {
			if v < 1 {
				errs = append(errs, fmt.Errorf("sizes must be >= 1 MiB: %v", l))
			}
		}
	}
	if len(o.Depths)+len(o.WorkspacesMB)+len(o.RSSMB) == 0 {
		errs = append(errs, fmt.Errorf("nothing to measure: every dimension is empty"))
	}
	return errors.Join(errs...)
}

// SizeName names a size in MiB the way the scale rows do: 10MB, 100MB, 1GB, 4GB.
func SizeName(mb int) string {
	if mb >= 1024 && mb%1024 == 0 {
		return strconv.Itoa(mb/1024) + "GB"
	}
	return strconv.Itoa(mb) + "MB"
}

// ScalePoint is where a scale row was measured, parsed from its system name
// (deltabox-depth100, deltabox-ws4gb, deltabox-rss10mb: the fast-path issue's names;
// files written before 2026-12-03 say ws4GB, rss10MB, which parse too).
type ScalePoint struct {
	Dim string // depth, ws or rss
	X   int    // layers, or MiB
}

var scaleSystemRE = regexp.MustCompile(`^deltabox-(depth|ws|rss)(\d+)(MB|GB|mb|gb)?$`)

// ParseScaleSystem parses a scale row's system name.
func ParseScaleSystem(system string) (ScalePoint, bool) {
	m := scaleSystemRE.FindStringSubmatch(system)
	if m == nil || (m[1] == "depth") != (m[3] == "") {
		return ScalePoint{}, false
	}
	x, err := strconv.Atoi(m[2])
	if err != nil {
		return ScalePoint{}, false
	}
	if m[3] == "GB" || m[3] == "gb" {
		x *= 1024
	}
	return ScalePoint{Dim: m[1], X: x}, true
}

func (p ScalePoint) system() string {
	if p.Dim == "depth" {
		return "deltabox-depth" + strconv.Itoa(p.X)
	}
	return "deltabox-" + p.Dim + strings.ToLower(SizeName(p.X))
}

// opSample is one timed operation.
type opSample struct {
	wall, withExec, daemon float64 // ms: the call, the call and the next exec, inside the daemon
	exec, exec2            float64 // ms: the first exec after the call, and the one after it
	phases                 map[string]int64
	depth                  int
	fast                   bool // restore: warm state; checkpoint: prepared next state
	mounted                bool
	processes              int
}

type scaleNode struct {
	id, label string
	depth     int
}

// scaleSandbox is one sandbox of the bench and what it must show next.
type scaleSandbox struct {
	c      *client.Client
	name   string
	marker string // the label the workspace's marker file must hold ("" : none yet)
	py     bool   // a python session "py" holds a variable mark equal to marker
	round  int
	// markerFailures counts restores after which the marker (or the session's mark)
	// was not the node's: a daemon bug.
	markerFailures int
	failures       []string  // the first few, for the notes
	firstCallMS    []float64 // python: the session call after each restore (untimed in rows)
}

type scaleRun struct {
	c     *client.Client
	o     ScaleOptions
	f     *File
	start time.Time
	rng   *mrand.Rand
	// cleanup holds what the run created, removed at the end in reverse order.
	sandboxes []string
	roots     []string
	created   map[string]bool // every sandbox the run created
}

func (r *scaleRun) logf(format string, a ...any) {
	progress(r.o.Log, r.start, "scale: "+format, a...)
}

const (
	scaleCkCall  = "client.Checkpoint(ctx, sandbox, label): POST /v1/sandboxes/{id}/checkpoint"
	scaleRsCall  = "client.Restore(ctx, sandbox, node): POST /v1/sandboxes/{id}/restore"
	scaleExCall  = `client.Exec(ctx, sandbox, {argv: ["true"]}): POST /v1/sandboxes/{id}/exec`
	scaleChanges = `m=$(cat /workspace/.scale/marker 2>/dev/null || true)
[ "$m" = "$1" ] && echo ok || echo "mismatch:$m"
d=/workspace/.scale/$2
mkdir -p "$d"
for ((i = 1; i <= $3; i++)); do echo "$2 $i" > "$d/f$i"; done
printf %s "$2" > /workspace/.scale/marker`
)

// RunScale runs the scale bench and returns its File. On error the File holds what
// was measured so far; every sandbox and node the bench made is removed in every case.
func RunScale(ctx context.Context, c *client.Client, o ScaleOptions) (f *File, err error) {
	start := time.Now()
	f = &File{Bench: "scale", Command: o.Command, Machine: CurrentMachine(), Started: start.UTC()}
	settings, _ := json.Marshal(o)
	json.Unmarshal(settings, &f.Settings)
	f.Description = scaleDescription(o)
	f.Notes = append(f.Notes, o.Notes...)
	if err := o.Check(); err != nil {
		return f, err
	}
	if err := c.Health(ctx); err != nil {
		return f, err
	}
	r := &scaleRun{c: c, o: o, f: f, start: start, rng: mrand.New(mrand.NewSource(o.Seed)), created: map[string]bool{}}
	defer func() {
		err = errors.Join(err, r.cleanup())
		f.Finished = time.Now().UTC()
		f.DurationS = float64(int(time.Since(start).Seconds()*10)) / 10
		f.Machine.LoadAvgEnd = LoadAvg()
		if f.Machine.LoadAvgStart > 1 || f.Machine.LoadAvgEnd > 1 {
			f.Notes = append(f.Notes, fmt.Sprintf("1-minute load average %.2f at the start and %.2f at the end on %d CPUs: other work ran on the machine, so tails (p95/p99) are noisier than on an idle machine",
				f.Machine.LoadAvgStart, f.Machine.LoadAvgEnd, f.Machine.CPUs))
		}
	}()
	if len(o.Depths) > 0 {
		if err := r.depths(ctx); err != nil {
			return f, fmt.Errorf("depth: %w", err)
		}
	}
	for _, mb := range o.WorkspacesMB {
		if err := r.workspace(ctx, mb); err != nil {
			return f, fmt.Errorf("workspace %s: %w", SizeName(mb), err)
		}
	}
	if n := workspaceTargetNote(f.Results); n != "" {
		f.Notes = append(f.Notes, n)
	}
	for _, mb := range o.RSSMB {
		if err := r.rss(ctx, mb); err != nil {
			return f, fmt.Errorf("rss %s: %w", SizeName(mb), err)
		}
	}
	return f, nil
}

// workspaceTargetNote checks the evaluation issue's target on the workspace rows: the
// restore p50 at the largest workspace within 1.5x of the smallest's (the issue names
// 4 GB and 10 MB). "" with fewer than two workspace sizes.
func workspaceTargetNote(rows []Row) string {
	lo, hi, ok := workspaceTarget(rows)
	if !ok {
		return ""
	}
	ratio := hi.P50 / lo.P50
	verdict := "met"
	if ratio > 1.5 {
		verdict = "MISSED"
	}
	return fmt.Sprintf("target restore p50 at the largest workspace (%s) within 1.5x of the smallest's (%s): %s (%.3f vs %.3f ms: %.2fx)",
		strings.ToLower(SizeName(scaleX(hi))), strings.ToLower(SizeName(scaleX(lo))), verdict, hi.P50, lo.P50, ratio)
}

// workspaceTarget returns the restore rows of the smallest and the largest workspace
// (the two the workspace target compares); ok is false with fewer than two sizes.
func workspaceTarget(rows []Row) (lo, hi *Row, ok bool) {
	var loMB, hiMB int
	for i, r := range rows {
		p, ok := ParseScaleSystem(r.System)
		if !ok || p.Dim != "ws" || r.Op != "restore" {
			continue
		}
		if lo == nil || p.X < loMB {
			lo, loMB = &rows[i], p.X
		}
		if hi == nil || p.X > hiMB {
			hi, hiMB = &rows[i], p.X
		}
	}
	if lo == nil || loMB == hiMB || lo.P50 <= 0 {
		return nil, nil, false
	}
	return lo, hi, true
}

func scaleDescription(o ScaleOptions) string {
	var b strings.Builder
	fmt.Fprintf(&b, "How checkpoint and restore latency scales with the depth of the snapshot tree (nodes of depth %s), "+
		"the size of the workspace (%s MiB of files) and the memory of a live python session (%s MiB of heap). "+
		"Before every checkpoint and every restore one exec (`bash -c`, untimed) writes %d new files and a marker into `/workspace/.scale/`, "+
		"so that every checkpoint freezes a change and every restore discards a dirty upper; the same exec first checks (untimed) that the "+
		"marker holds the label of the node last restored or checkpointed.\n\n",
		intsString(o.Depths), intsString(o.WorkspacesMB), intsString(o.RSSMB), o.Files)
	fmt.Fprintf(&b, "- **depth**: one sandbox builds a chain of checkpoints to depth %d (one layer per level). At each depth point d, "+
		"%d times: restore to the chain's node of depth d (`restore` rows), then checkpoint there (`checkpoint` rows: the new node "+
		"has depth d+1), so that the next restore comes from the new child with a dirty upper. The daemon keeps warm states (the "+
		"node's stack mounted ahead of time, per sandbox, bounded by its DELTABOX_WARM_MAX); its answers say which restores "+
		"installed one (`warm` in the details). `restore-cold` rows restore into sandboxes that have never mounted the node (%d new "+
		"sandboxes, each restoring every depth point once, in shuffled order): the daemon mounts the whole stack.\n",
		maxInts(o.Depths), o.Samples, o.ColdSamples)
	fmt.Fprintf(&b, "- **ws**: per size, a new sandbox writes the workspace (about %d small text files, at most half the bytes, and %d "+
		"large files of random bytes, seed %d, as `bench fs` does), checkpoints it (the node `base`, depth 1) and syncs the store; then "+
		"%d times: restore to `base`, checkpoint. `restore-cold`: %d new sandboxes restore `base` once each.\n",
		o.SmallFiles, o.LargeFiles, o.Seed, o.Samples, o.ColdSamples)
	fmt.Fprintf(&b, "- **rss**: per size, a new sandbox starts a python session that allocates a bytearray of that size and writes "+
		"every page (`bytearray(b'Z') * n`; the measured VmRSS is in the details), checkpoints it (`base`); then %d times: restore to "+
		"`base`, checkpoint, with the session alive: every checkpoint forks a template of the session's process and every restore "+
		"kills the live one and forks it back from the node's template, so both copy page tables that grow with the heap. Before each "+
		"checkpoint and restore a session call sets (and checks) a variable `mark`; the first session call after a restore is timed "+
		"in the details (`session_call_after_restore`). No cold rows: warm states are about the filesystem, and a restore into "+
		"another sandbox carries no process state.\n\n", o.Samples)
	b.WriteString("Rows are the wall time of the Go client call (`client.Checkpoint`, `client.Restore`) on the daemon's unix socket; " +
		"the sandbox can run its next command when the call returns, and the `+exec` rows add that command (`client.Exec` of `true`), " +
		"timed in the same samples. A second `true` follows, untimed in the rows: the details of the `+exec` rows give both commands " +
		"alone (`exec_p50_ms`, `second_exec_p50_ms`), to tell what the first command after an operation pays (lookups in a new overlay, " +
		"the daemon's background mounts) from a settled sandbox. `layers` is the depth of the node restored to or made (layers in its " +
		"stack, image excluded), from the daemon's answer. In the details, `daemon_p50_ms` is the time inside the daemon and " +
		"`phases_p50_us` the median of each phase over the samples that had it (a warm restore has no overlay mount). Percentiles are " +
		"nearest-rank: with n = 100 the p99 is the second largest sample.")
	return b.String()
}

func intsString(v []int) string {
	var s []string
	for _, x := range v {
		s = append(s, strconv.Itoa(x))
	}
	if len(s) == 0 {
		return "none"
	}
	return strings.Join(s, ", ")
}

func maxInts(v []int) int {
	m := 0
	for _, x := range v {
		m = max(m, x)
	}
	return m
}

// ---- sandboxes and operations ----

func (r *scaleRun) create(ctx context.Context, prefix string, memoryMB int64) (*scaleSandbox, error) {
	name := prefix + "-" + randHex(3)
	// Named for the cleanup first: an interrupted call may still have created it.
	r.sandboxes = append(r.sandboxes, name)
	r.created[name] = true
	if _, err := r.c.Create(ctx, apitypes.CreateOptions{ID: name, Image: r.o.Image, Workdir: "/workspace", MemoryMB: memoryMB}); err != nil {
		return nil, fmt.Errorf("create sandbox: %w", err)
	}
	return &scaleSandbox{c: r.c, name: name}, nil
}

// remove removes a sandbox now (it is also forgotten by cleanup).
func (r *scaleRun) remove(ctx context.Context, s *scaleSandbox) error {
	err := r.c.Remove(ctx, s.name)
	for i, n := range r.sandboxes {
		if n == s.name {
			r.sandboxes = append(r.sandboxes[:i], r.sandboxes[i+1:]...)
			break
		}
	}
	if err != nil && !errors.Is(err, errdefs.ErrNotFound) {
		return fmt.Errorf("remove sandbox %s: %w", s.name, err)
	}
	return nil
}

// removeTree removes the subtree under root now.
func (r *scaleRun) removeTree(ctx context.Context, root string) error {
	_, err := r.c.RemoveNode(ctx, root)
	for i, n := range r.roots {
		if n == root {
			r.roots = append(r.roots[:i], r.roots[i+1:]...)
			break
		}
	}
	if err != nil {
		return fmt.Errorf("remove node %s and its subtree: %w", root, err)
	}
	return nil
}

// cleanup removes every sandbox, then every tree, the run still holds. A tree whose
// root's answer never arrived (an interrupted call) is found by the sandbox that
// took it.
func (r *scaleRun) cleanup() error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var errs []error
	for len(r.sandboxes) > 0 {
		s := r.sandboxes[len(r.sandboxes)-1]
		if err := r.remove(ctx, &scaleSandbox{name: s}); err != nil {
			errs = append(errs, fmt.Errorf("cleanup: %w", err))
		}
	}
	if tr, err := r.c.Tree(ctx); err == nil {
		ours := map[string]bool{}
		for _, n := range tr.Nodes {
			if r.created[n.Sandbox] {
				ours[n.ID] = true
			}
		}
		for _, n := range tr.Nodes {
			if ours[n.ID] && !ours[n.Parent] && !slices.Contains(r.roots, n.ID) {
				r.roots = append(r.roots, n.ID)
			}
		}
	} else {
		errs = append(errs, fmt.Errorf("cleanup: list the tree: %w", err))
	}
	for len(r.roots) > 0 {
		if err := r.removeTree(ctx, r.roots[len(r.roots)-1]); err != nil {
			errs = append(errs, fmt.Errorf("cleanup: %w", err))
		}
	}
	return errors.Join(errs...)
}

// change writes the files of one step and the marker label, after checking that the
// marker (and the python session's mark) hold what they must.
func (s *scaleSandbox) change(ctx context.Context, files int) error {
	s.round++
	label := fmt.Sprintf("s%05d", s.round)
	res, err := s.c.Exec(ctx, s.name, apitypes.ExecRequest{Argv: []string{"bash", "-c", scaleChanges, "bash", s.marker, label, strconv.Itoa(files)},
		TimeoutMS: time.Minute.Milliseconds()})
	if err != nil {
		return fmt.Errorf("change step %s: %w", label, err)
	}
	if res.ExitCode != 0 {
		return fmt.Errorf("change step %s exited %d: %s", label, res.ExitCode, strings.TrimSpace(res.Stderr))
	}
	got := strings.TrimSpace(res.Stdout)
	if s.py {
		out, err := s.call(ctx, fmt.Sprintf("print(mark == %q or 'mark:' + mark); mark = %q", s.marker, label))
		if err != nil {
			return fmt.Errorf("change step %s: %w", label, err)
		}
		if out = strings.TrimSpace(out); out != "True" {
			got += " " + out
		}
	}
	if got != "ok" {
		s.markerFailures++
		if len(s.failures) < 3 {
			s.failures = append(s.failures, fmt.Sprintf("want %q, found %s", s.marker, got))
		}
	}
	s.marker = label
	return nil
}

// call runs code in the python session.
func (s *scaleSandbox) call(ctx context.Context, code string) (string, error) {
	res, err := s.c.Run(ctx, s.name, "py", code, 10*time.Minute)
	if err != nil {
		return "", fmt.Errorf("python session: %w", err)
	}
	if res.ExitCode != 0 || res.SessionRestarted {
		return "", fmt.Errorf("python session: exit %d (restarted %v): %s", res.ExitCode, res.SessionRestarted, strings.TrimSpace(res.Stdout))
	}
	return res.Stdout, nil
}

func (s *scaleSandbox) trueExec(ctx context.Context) error {
	res, err := s.c.Exec(ctx, s.name, apitypes.ExecRequest{Argv: []string{"true"}})
	if err != nil {
		return err
	}
	if res.ExitCode != 0 {
		return fmt.Errorf("exec true exited %d: %s", res.ExitCode, res.Stderr)
	}
	return nil
}

func (s *scaleSandbox) checkpoint(ctx context.Context) (scaleNode, opSample, error) {
	t0 := time.Now()
	res, err := s.c.Checkpoint(ctx, s.name, s.marker)
	t1 := time.Now()
	if err != nil {
		return scaleNode{}, opSample{}, fmt.Errorf("checkpoint %s: %w", s.marker, err)
	}
	if err := s.trueExec(ctx); err != nil {
		return scaleNode{}, opSample{}, fmt.Errorf("exec after checkpoint %s: %w", s.marker, err)
	}
	t2 := time.Now()
	// Untimed in the rows: a second command, on a settled sandbox.
	if err := s.trueExec(ctx); err != nil {
		return scaleNode{}, opSample{}, fmt.Errorf("second exec after checkpoint %s: %w", s.marker, err)
	}
	n := scaleNode{id: res.Node.ID, label: s.marker, depth: res.Node.Depth}
	return n, opSample{wall: ms(t1.Sub(t0)), withExec: ms(t2.Sub(t0)), exec: ms(t2.Sub(t1)), exec2: ms(time.Since(t2)), daemon: res.DurationMS,
		phases: res.PhasesUS, depth: res.Node.Depth, fast: res.Prepared, mounted: res.Mounted, processes: res.Processes}, nil
}

func (s *scaleSandbox) restore(ctx context.Context, n scaleNode) (opSample, error) {
	t0 := time.Now()
	res, err := s.c.Restore(ctx, s.name, n.id)
	t1 := time.Now()
	if err != nil {
		return opSample{}, fmt.Errorf("restore to %s (depth %d): %w", n.id, n.depth, err)
	}
	if err := s.trueExec(ctx); err != nil {
		return opSample{}, fmt.Errorf("exec after restore to %s: %w", n.id, err)
	}
	t2 := time.Now()
	if err := s.trueExec(ctx); err != nil {
		return opSample{}, fmt.Errorf("second exec after restore to %s: %w", n.id, err)
	}
	exec2 := ms(time.Since(t2))
	s.marker = n.label
	if len(res.ProcessErrors) > 0 {
		return opSample{}, fmt.Errorf("restore to %s: process state not restored: %s", n.id, strings.Join(res.ProcessErrors, "; "))
	}
	if s.py {
		t := time.Now()
		if _, err := s.call(ctx, "pass"); err != nil {
			return opSample{}, fmt.Errorf("after restore to %s: %w", n.id, err)
		}
		s.firstCallMS = append(s.firstCallMS, ms(time.Since(t)))
	}
	depth := n.depth
	if res.Node != nil {
		depth = res.Node.Depth
	}
	return opSample{wall: ms(t1.Sub(t0)), withExec: ms(t2.Sub(t0)), exec: ms(t2.Sub(t1)), exec2: exec2, daemon: res.DurationMS,
		phases: res.PhasesUS, depth: depth, fast: res.Warm, mounted: res.Mounted, processes: res.Processes}, nil
}

// pointSamples restores to target and checkpoints there, n times: each restore comes
// from the previous iteration's new child, with a dirty upper.
func (r *scaleRun) pointSamples(ctx context.Context, s *scaleSandbox, target scaleNode, n int) (ck, rs []opSample, err error) {
	for j := 0; j < n; j++ {
		if err := s.change(ctx, r.o.Files); err != nil {
			return ck, rs, err
		}
		x, err := s.restore(ctx, target)
		if err != nil {
			return ck, rs, err
		}
		rs = append(rs, x)
		if err := s.change(ctx, r.o.Files); err != nil {
			return ck, rs, err
		}
		_, y, err := s.checkpoint(ctx)
		if err != nil {
			return ck, rs, err
		}
		ck = append(ck, y)
	}
	return ck, rs, nil
}

// coldRestores restores every target once in each of n new sandboxes (shuffled order)
// and returns the samples per target.
func (r *scaleRun) coldRestores(ctx context.Context, targets []scaleNode, n int) ([][]opSample, error) {
	out := make([][]opSample, len(targets))
	for i := 0; i < n; i++ {
		s, err := r.create(ctx, "bench-scale-cold", 0)
		if err != nil {
			return out, err
		}
		if err := s.trueExec(ctx); err != nil {
			return out, err
		}
		for _, k := range r.rng.Perm(len(targets)) {
			if err := s.change(ctx, r.o.Files); err != nil {
				return out, err
			}
			x, err := s.restore(ctx, targets[k])
			if err != nil {
				return out, err
			}
			out[k] = append(out[k], x)
		}
		// The last restore's marker, checked by one more step.
		if err := s.change(ctx, 1); err != nil {
			return out, err
		}
		if s.markerFailures > 0 {
			return out, fmt.Errorf("a cold restore showed the wrong files (marker check: %s): a daemon bug", strings.Join(s.failures, "; "))
		}
		if err := r.remove(ctx, s); err != nil {
			return out, err
		}
	}
	return out, nil
}

// markerNote records wrong markers (or session variables) found after operations.
func (r *scaleRun) markerNote(where string, s *scaleSandbox) {
	if s.markerFailures > 0 {
		r.f.Notes = append(r.f.Notes, fmt.Sprintf("%s: %d of %d steps found the wrong marker or session variable after an operation (%s): a daemon bug",
			where, s.markerFailures, s.round, strings.Join(s.failures, "; ")))
	}
}

// ---- the three dimensions ----

func (r *scaleRun) depths(ctx context.Context) error {
	maxD := maxInts(r.o.Depths)
	s, err := r.create(ctx, "bench-scale-depth", 0)
	if err != nil {
		return err
	}
	r.logf("depth: chain of %d checkpoints in %s", maxD, s.name)
	byDepth := map[int]scaleNode{}
	var chain []opSample
	for len(byDepth) < maxD {
		if err := s.change(ctx, r.o.Files); err != nil {
			return err
		}
		n, x, err := s.checkpoint(ctx)
		if err != nil {
			return err
		}
		chain = append(chain, x)
		// The node's depth is its place in the chain; the API's depth (the layers a
		// restore mounts) falls back each time the daemon squashes the stack.
		n.depth = len(chain)
		if n.depth == 1 {
			r.roots = append(r.roots, n.id)
		}
		byDepth[n.depth] = n
		if n.depth%100 == 0 {
			r.logf("depth: chain at depth %d, last checkpoint %.3f ms", n.depth, x.wall)
		}
	}
	var targets []scaleNode
	for _, d := range r.o.Depths {
		targets = append(targets, byDepth[d])
	}
	rows := map[int][]Row{}
	for _, t := range targets {
		ck, rs, err := r.pointSamples(ctx, s, t, r.o.Samples)
		if err != nil {
			return err
		}
		p := ScalePoint{Dim: "depth", X: t.depth}
		rows[t.depth] = append(scaleRows(p, "checkpoint", ck, scaleCkCall), scaleRows(p, "restore", rs, scaleRsCall)...)
		r.logf("depth %d: restore p50 %.3f ms (%d/%d warm), checkpoint p50 %.3f ms", t.depth, Summarize(pick(rs, wallOf)).P50,
			countFast(rs), len(rs), Summarize(pick(ck, wallOf)).P50)
	}
	r.markerNote("depth", s)
	if err := r.remove(ctx, s); err != nil {
		return err
	}
	if r.o.ColdSamples > 0 {
		r.logf("depth: %d new sandboxes restore the %d depth points once each (cold)", r.o.ColdSamples, len(targets))
		cold, err := r.coldRestores(ctx, targets, r.o.ColdSamples)
		if err != nil {
			return err
		}
		for i, t := range targets {
			rows[t.depth] = append(rows[t.depth], scaleRows(ScalePoint{Dim: "depth", X: t.depth}, "restore-cold", cold[i], scaleRsCall)...)
		}
	}
	for _, t := range targets {
		r.f.Results = append(r.f.Results, rows[t.depth]...)
	}
	cs := Summarize(pick(chain, wallOf))
	r.f.Notes = append(r.f.Notes, fmt.Sprintf("depth: the chain's %d checkpoints (depth 1 to %d) took %s ms p50, %s ms p99; %d used a prepared next state",
		len(chain), maxD, fmtMS(cs.P50), fmtMS(cs.P99), countFast(chain)))
	return r.removeTree(ctx, byDepth[1].id)
}

func (r *scaleRun) workspace(ctx context.Context, mb int) error {
	s, err := r.create(ctx, "bench-scale-ws", 0)
	if err != nil {
		return err
	}
	// The store must hold the workspace, its copy-ups and the page cache's writeback.
	if res, err := r.c.Exec(ctx, s.name, apitypes.ExecRequest{Argv: []string{"df", "-Pk", "/workspace"}}); err == nil && res.ExitCode == 0 {
		if l := strings.Split(strings.TrimSpace(res.Stdout), "\n"); len(l) == 2 {
			if f := strings.Fields(l[1]); len(f) >= 4 {
				if kb, err := strconv.ParseInt(f[3], 10, 64); err == nil && kb/1024 < int64(mb)*2+1024 {
					return fmt.Errorf("the store has %d MiB free, want at least %d MiB", kb/1024, int64(mb)*2+1024)
				}
			}
		}
	}
	r.logf("ws %s: generate the workspace in %s", SizeName(mb), s.name)
	t := time.Now()
	res, err := r.c.Exec(ctx, s.name, apitypes.ExecRequest{Argv: []string{"python3", "-c", genPy, "/workspace", strconv.FormatInt(r.o.Seed, 10),
		strconv.Itoa(mb), strconv.Itoa(r.o.SmallFiles), strconv.Itoa(r.o.LargeFiles)}, TimeoutMS: (30 * time.Minute).Milliseconds()})
	if err != nil {
		return fmt.Errorf("generate workspace: %w", err)
	}
	if res.ExitCode != 0 {
		return fmt.Errorf("generate workspace: exit %d: %s", res.ExitCode, strings.TrimSpace(res.Stderr))
	}
	genS := time.Since(t).Seconds()
	var meta struct {
		Small int
		Large [][2]any
		Bytes int64
	}
	if err := json.Unmarshal([]byte(res.Stdout), &meta); err != nil {
		return fmt.Errorf("generate workspace: %v: %q", err, res.Stdout)
	}
	if err := s.change(ctx, r.o.Files); err != nil {
		return err
	}
	base, x, err := s.checkpoint(ctx)
	if err != nil {
		return err
	}
	r.roots = append(r.roots, base.id)
	// The generated data is still dirty in the page cache: flush it before timing.
	t = time.Now()
	if err := r.c.Sync(ctx); err != nil {
		return err
	}
	r.logf("ws %s: %d files, %d bytes written in %.1f s, checkpoint %.3f ms, sync %.1f s", SizeName(mb), meta.Small+len(meta.Large), meta.Bytes,
		genS, x.wall, time.Since(t).Seconds())
	ck, rs, err := r.pointSamples(ctx, s, base, r.o.Samples)
	if err != nil {
		return err
	}
	r.markerNote("ws "+SizeName(mb), s)
	if err := r.remove(ctx, s); err != nil {
		return err
	}
	var cold [][]opSample
	if r.o.ColdSamples > 0 {
		if cold, err = r.coldRestores(ctx, []scaleNode{base}, r.o.ColdSamples); err != nil {
			return err
		}
	}
	p := ScalePoint{Dim: "ws", X: mb}
	rows := append(scaleRows(p, "checkpoint", ck, scaleCkCall), scaleRows(p, "restore", rs, scaleRsCall)...)
	if cold != nil {
		rows = append(rows, scaleRows(p, "restore-cold", cold[0], scaleRsCall)...)
	}
	for i := 0; i < len(rows); i += 2 { // the op rows, not their +exec twins
		rows[i].Info["workspace_bytes"] = meta.Bytes
		rows[i].Info["workspace_files"] = meta.Small + len(meta.Large)
	}
	rows[0].Info["initial_checkpoint_ms"] = us(x.wall)
	rows[0].Info["generate_s"] = float64(int(genS*10)) / 10
	r.f.Results = append(r.f.Results, rows...)
	r.logf("ws %s: restore p50 %.3f ms (%d/%d warm), checkpoint p50 %.3f ms", SizeName(mb), Summarize(pick(rs, wallOf)).P50, countFast(rs), len(rs),
		Summarize(pick(ck, wallOf)).P50)
	if err := r.removeTree(ctx, base.id); err != nil {
		return err
	}
	// The layers are deleted after the index forgets them: wait, so that the deletion
	// of gigabytes does not run under the next point.
	return r.c.Sync(ctx)
}

// rssPy N allocates N MiB in one bytearray, writing every page, and prints VmRSS in KiB.
const rssPy = `buf = bytearray(b'Z') * (%d << 20)
mark = %q
print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmRSS:')][0])`

func (r *scaleRun) rss(ctx context.Context, mb int) error {
	limit := int64(4096)
	if need := int64(2*mb + 1024); need > limit {
		limit = need
	}
	s, err := r.create(ctx, "bench-scale-rss", limit)
	if err != nil {
		return err
	}
	if _, err := r.c.StartSession(ctx, s.name, apitypes.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		return fmt.Errorf("start a python session: %w", err)
	}
	if err := s.change(ctx, r.o.Files); err != nil {
		return err
	}
	t := time.Now()
	out, err := s.call(ctx, fmt.Sprintf(rssPy, mb, s.marker))
	if err != nil {
		return fmt.Errorf("allocate %d MiB: %w", mb, err)
	}
	allocS := time.Since(t).Seconds()
	rssKB, err := strconv.ParseInt(strings.TrimSpace(out), 10, 64)
	if err != nil {
		return fmt.Errorf("allocate %d MiB: VmRSS %q", mb, out)
	}
	s.py = true
	base, x, err := s.checkpoint(ctx)
	if err != nil {
		return err
	}
	r.roots = append(r.roots, base.id)
	if x.processes != 1 {
		return fmt.Errorf("the checkpoint carried %d session processes, want 1 (is the process fast path off?)", x.processes)
	}
	r.logf("rss %s: session VmRSS %d MiB (allocated in %.1f s), checkpoint %.3f ms", SizeName(mb), rssKB>>10, allocS, x.wall)
	ck, rs, err := r.pointSamples(ctx, s, base, r.o.Samples)
	if err != nil {
		return err
	}
	// The session must still hold the heap.
	out, err = s.call(ctx, "print(int([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmRSS:')][0]) >> 10, len(buf) >> 20)")
	if err != nil {
		return err
	}
	if end := strings.Fields(out); len(end) != 2 || end[1] != strconv.Itoa(mb) {
		return fmt.Errorf("after the samples the session shows VmRSS (MiB) and len(buf) (MiB) %q, want a buffer of %d MiB", out, mb)
	}
	endRSS, _ := strconv.Atoi(strings.Fields(out)[0])
	r.markerNote("rss "+SizeName(mb), s)
	for _, y := range append(append([]opSample(nil), ck...), rs...) {
		if y.processes != 1 {
			return fmt.Errorf("an operation carried %d session processes, want 1", y.processes)
		}
	}
	p := ScalePoint{Dim: "rss", X: mb}
	rows := append(scaleRows(p, "checkpoint", ck, scaleCkCall), scaleRows(p, "restore", rs, scaleRsCall)...)
	call := Summarize(s.firstCallMS)
	for i := 0; i < len(rows); i += 2 {
		rows[i].Info["session_vmrss_mb"] = rssKB >> 10
		rows[i].Info["session_vmrss_mb_at_end"] = endRSS
		if rows[i].Op == "restore" {
			rows[i].Info["session_call_after_restore_p50_ms"] = us(call.P50)
			rows[i].Info["session_call_after_restore_p99_ms"] = us(call.P99)
		}
	}
	rows[0].Info["initial_checkpoint_ms"] = us(x.wall)
	r.f.Results = append(r.f.Results, rows...)
	r.logf("rss %s: restore p50 %.3f ms, checkpoint p50 %.3f ms", SizeName(mb), Summarize(pick(rs, wallOf)).P50, Summarize(pick(ck, wallOf)).P50)
	if err := r.remove(ctx, s); err != nil {
		return err
	}
	return r.removeTree(ctx, base.id)
}

// ---- rows ----

func wallOf(s opSample) float64     { return s.wall }
func withExecOf(s opSample) float64 { return s.withExec }

func countFast(ss []opSample) (n int) {
	for _, s := range ss {
		if s.fast {
			n++
		}
	}
	return n
}

// scaleRows makes the op and op+exec rows of one point's samples.
func scaleRows(p ScalePoint, op string, ss []opSample, call string) []Row {
	if len(ss) == 0 {
		return nil
	}
	var depths []int
	mounted := 0
	for _, s := range ss {
		depths = append(depths, s.depth)
		if s.mounted {
			mounted++
		}
	}
	ph := phaseMedians(ss, func(s opSample) map[string]int64 { return s.phases })
	d := Summarize(pick(ss, func(s opSample) float64 { return s.daemon }))
	row := Summarize(pick(ss, wallOf)).Row(p.system(), op, 0, call)
	row.Layers = LayerDist(depths)
	row.Info = map[string]any{"daemon_p50_ms": us(d.P50), "daemon_p99_ms": us(d.P99), "phases_p50_us": ph, "mounted": mounted}
	if strings.HasPrefix(op, "restore") {
		row.Info["warm"] = countFast(ss)
	} else {
		row.Info["prepared"] = countFast(ss)
	}
	if p.Dim == "rss" {
		row.Info["session_processes"] = ss[0].processes
	}
	ex := Summarize(pick(ss, withExecOf)).Row(p.system(), op+"+exec", 0, call, scaleExCall)
	ex.Layers = row.Layers
	e, e2 := Summarize(pick(ss, func(s opSample) float64 { return s.exec })), Summarize(pick(ss, func(s opSample) float64 { return s.exec2 }))
	ex.Info = map[string]any{"exec_p50_ms": us(e.P50), "exec_p99_ms": us(e.P99), "second_exec_p50_ms": us(e2.P50), "second_exec_p99_ms": us(e2.P99)}
	return []Row{row, ex}
}

// FormatScaleTable prints scale rows as a plain-text table.
func FormatScaleTable(rows []Row) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%-18s %-18s %9s %9s %9s %5s  %-22s %s\n", "SYSTEM", "OP", "P50_MS", "P95_MS", "P99_MS", "N", "LAYERS", "AHEAD")
	for _, r := range rows {
		ahead := ""
		if v, ok := r.Info["warm"]; ok {
			ahead = fmt.Sprintf("warm %v", v)
		} else if v, ok := r.Info["prepared"]; ok {
			ahead = fmt.Sprintf("prepared %v", v)
		}
		fmt.Fprintf(&b, "%-18s %-18s %9s %9s %9s %5d  %-22s %s\n", r.System, r.Op, fmtMS(r.P50), fmtMS(r.P95), fmtMS(r.P99), r.N,
			layersString(r.Layers), ahead)
	}
	return b.String()
}

func init() { sectionWriters["scale"] = writeScaleSummary }

// writeScaleSummary adds one compact table per dimension to the scale section:
// p50 / p99 of each op at each point, and how many restores found a warm state.
func writeScaleSummary(b *strings.Builder, f *File) {
	type key struct{ system, op string }
	rows := map[key]Row{}
	var points []ScalePoint
	seen := map[ScalePoint]bool{}
	for _, r := range f.Results {
		p, ok := ParseScaleSystem(r.System)
		if !ok {
			continue
		}
		rows[key{r.System, r.Op}] = r
		if !seen[p] {
			seen[p] = true
			points = append(points, p)
		}
	}
	cellOf := func(system, op string) string {
		r, ok := rows[key{system, op}]
		if !ok {
			return "-"
		}
		return fmtMS(r.P50) + " / " + fmtMS(r.P99)
	}
	for _, d := range []struct{ dim, title, col string }{
		{"depth", "By tree depth", "Depth"},
		{"ws", "By workspace size", "Workspace"},
		{"rss", "By python session heap", "Heap"},
	} {
		var ps []ScalePoint
		for _, p := range points {
			if p.Dim == d.dim {
				ps = append(ps, p)
			}
		}
		if len(ps) == 0 {
			continue
		}
		fmt.Fprintf(b, "\n### %s\n\np50 / p99 in ms (n per row in the results above); `layers` of the restored node; `warm`: restores "+
			"that installed a state mounted ahead of time; `exec after restore`: p50 of the first and of the second command after a restore.\n\n", d.title)
		fmt.Fprintf(b, "| %s | Layers | restore | warm | restore+exec | exec after restore | restore-cold | restore-cold+exec | checkpoint | checkpoint+exec |\n", d.col)
		b.WriteString("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n")
		for _, p := range ps {
			s := p.system()
			x := strconv.Itoa(p.X)
			if p.Dim != "depth" {
				x = mbCell(p.X)
			}
			rs := rows[key{s, "restore"}]
			warm := "-"
			if v, ok := rs.Info["warm"]; ok {
				warm = fmt.Sprintf("%v/%d", compact(v), rs.N)
			}
			if v, ok := rs.Info["session_vmrss_mb"]; ok {
				x += fmt.Sprintf(" (VmRSS %s MiB)", compact(v))
			}
			execs := "-"
			if re, ok := rows[key{s, "restore+exec"}]; ok && re.Info["exec_p50_ms"] != nil {
				e, _ := re.Info["exec_p50_ms"].(float64)
				e2, _ := re.Info["second_exec_p50_ms"].(float64)
				execs = fmtMS(e) + ", then " + fmtMS(e2)
			}
			fmt.Fprintf(b, "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", x, layersString(rs.Layers), cellOf(s, "restore"), warm,
				cellOf(s, "restore+exec"), execs, cellOf(s, "restore-cold"), cellOf(s, "restore-cold+exec"), cellOf(s, "checkpoint"), cellOf(s, "checkpoint+exec"))
		}
	}
}
