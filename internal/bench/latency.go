package bench

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	mrand "math/rand"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/apitypes"
	"deltabox/internal/client"
	"deltabox/internal/criu"
	"deltabox/internal/deadline"
	"deltabox/internal/netns"
	"deltabox/internal/pydriver"
)

// `deltabox bench latency`: checkpoint and restore of files and a live python process
// together (DeltaBox's fast path) beside CRIU and two replay baselines.

// Systems of the latency bench, in the order they run.
const (
	SysDeltaBox = "deltabox"
	SysCRIU     = "criu"
	// SysForkFloor is a reference, not a baseline: os.fork() of the bench's own python
	// session process, timed inside it, at the same moments (same RSS, same mappings,
	// same fork lineage). A template fork is that kernel work plus the injection around
	// it: no fork-based restore or checkpoint of this process can take less.
	SysForkFloor = "kernel-fork"
	SysCopytree  = "copytree+replay"
	SysFSOnly    = "fs-only+replay"
)

// LatencyBaselines are the baselines `bench latency` runs by default.
var LatencyBaselines = []string{SysCRIU, SysCopytree, SysFSOnly}

// LatencyOptions configures `deltabox bench latency`.
type LatencyOptions struct {
	WorkspaceMB int `json:"workspace_mb"`
	SmallFiles  int `json:"small_files"`
	LargeFiles  int `json:"large_files"`
	// HeapMB is the python session's heap: HeapMB bytes objects of 1 MiB; each step
	// rewrites StepMB of them (random ones, seeded).
	HeapMB     int `json:"heap_mb"`
	StepMB     int `json:"step_mb"`
	Changes    int `json:"changes"`     // files changed by each step
	LargeEvery int `json:"large_every"` // every k-th step also writes into a large file
	Chain      int `json:"chain"`       // deltabox: checkpoints of the initial chain
	Restores   int `json:"restores"`    // deltabox: restores, each followed by a branch checkpoint
	// SpareRestores: deltabox, after the rest: the sandbox forked once, then this many
	// restores of the fork's node in its branch, each from a spare (restore-spare).
	SpareRestores int   `json:"spare_restores"`
	MaxNodes      int   `json:"max_nodes"` // deltabox: tree bound; random leaves are removed (untimed)
	Seed          int64 `json:"seed"`
	// Baselines: each builds a chain of BaselineCheckpoints nodes, then restores
	// BaselineRestores times to random ones.
	BaselineCheckpoints int      `json:"baseline_checkpoints"`
	BaselineRestores    int      `json:"baseline_restores"`
	CRIUKeep            int      `json:"criu_keep"` // CRIU image sets kept on tmpfs (restore targets)
	Baselines           []string `json:"baselines"`
	Image               string   `json:"image"`
	HostDir             string   `json:"host_dir"`  // copytree's workspace and snapshots (store's reflink filesystem)
	TmpfsDir            string   `json:"tmpfs_dir"` // CRIU images
	CRIU                string   `json:"criu"`
	Python              string   `json:"python"` // host interpreter of the baselines' python process
	Socket              string   `json:"socket"`

	Notes   []string  `json:"-"`
	Command string    `json:"-"`
	Log     io.Writer `json:"-"`
}

// DefaultLatencyOptions are the parameters.
func DefaultLatencyOptions() LatencyOptions {
	return LatencyOptions{
		WorkspaceMB: 1024, SmallFiles: 20000, LargeFiles: 4, HeapMB: 50, StepMB: 10, Changes: 100, LargeEvery: 10,
		Chain: 50, Restores: 500, SpareRestores: 30, MaxNodes: 100, Seed: 1, BaselineCheckpoints: 40, BaselineRestores: 30, CRIUKeep: 10,
		Baselines: append([]string(nil), LatencyBaselines...), Image: "default", TmpfsDir: "/dev/shm",
	}
}

// Validate checks the options' ranges.
func (o LatencyOptions) Validate() error {
	switch {
	case o.WorkspaceMB < 1 || o.HeapMB < 1 || o.StepMB < 1 || o.StepMB > o.HeapMB:
		return fmt.Errorf("want workspace-mb >= 1 and 1 <= step-mb <= heap-mb")
	case o.Changes < 1 || o.Chain < 1 || o.Restores < 0 || o.SpareRestores < 0:
		return fmt.Errorf("want changes >= 1, chain >= 1, restores >= 0, spare-restores >= 0")
	case o.MaxNodes < o.Chain+1:
		return fmt.Errorf("max-nodes (%d) must hold the chain and its root (%d)", o.MaxNodes, o.Chain+1)
	case o.BaselineCheckpoints < 1 || o.BaselineRestores < 1 || o.CRIUKeep < 1:
		return fmt.Errorf("want baseline-checkpoints, baseline-restores and criu-keep >= 1")
	}
	for _, b := range o.Baselines {
		if b != SysCRIU && b != SysCopytree && b != SysFSOnly {
			return fmt.Errorf("unknown baseline %q (want %s)", b, strings.Join(LatencyBaselines, ", "))
		}
	}
	return nil
}

func (o LatencyOptions) has(system string) bool {
	for _, b := range o.Baselines {
		if b == system {
			return true
		}
	}
	return false
}

// ---- the python workload ----

// latHeapPy is the first command of the python process (session or host driver): it
// builds the heap (H: a list of 1 MiB bytes objects, seeded) and defines bench_step,
// the state-changing command of every step, and bench_digest. The same code runs in
// the sandbox's python session, in CRIU's host process and in the replays.
const latHeapPy = `
import random, zlib
def bench_digest():
    c = 0
    for x in H:
        c = zlib.crc32(x, c)
    return "%s %08x" % (label_, c)
def bench_init(seed, chunks, chunk):
    global H, BENCH_SEED, BENCH_CHUNK, label_
    BENCH_SEED, BENCH_CHUNK = seed, chunk
    H = [random.Random(seed * 7919 + i).randbytes(chunk) for i in range(chunks)]
    label_ = "init"
    return bench_digest()
def bench_fork():
    # the kernel's fork of this process (the floor of a template fork), and the
    # child's exit and reap
    import os, time
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    t1 = time.perf_counter()
    os.waitpid(pid, 0)
    return "%.4f %.4f" % ((t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3)
def bench_step(rnd, label, n):
    # rewrites n random chunks (n MiB of the heap), deterministically for rnd
    global label_
    r = random.Random(BENCH_SEED * 1000003 + rnd)
    for i in r.sample(range(len(H)), n):
        H[i] = r.randbytes(BENCH_CHUNK)
    label_ = label
    return bench_digest()
`

// latDriverPy is the baselines' python process on the host: the python session's
// exec/eval of each call (pydriver.Exec, as internal/session), over an abstract unix socket instead of
// a terminal, so that CRIU can dump it alone (no terminal, own session, stdio on
// /dev/null). One connection per call: u32 length + code in, u32 status + u32 length +
// repr of the last expression out.
const latDriverPy = `
import ast, socket, struct, sys, traceback
` + pydriver.Exec + `
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind("\0" + sys.argv[1])
s.listen(8)
while True:
    c, _ = s.accept()
    f = c.makefile("rb")
    hdr = f.read(4)
    if len(hdr) < 4:  # a probe: connected and closed
        f.close()
        c.close()
        continue
    src = f.read(struct.unpack("!I", hdr)[0]).decode()
    try:
        out, rc = run(src) or "", 0
    except BaseException:
        out, rc = traceback.format_exc(), 1
    b = out.encode()
    c.sendall(struct.pack("!II", rc, len(b)) + b)
    f.close()
    c.close()
`

// latStep is one heap step: its round (the seed of what it writes) and its label.
type latStep struct {
	round int
	label string
}

func (o LatencyOptions) initCode() string {
	return latHeapPy + fmt.Sprintf("bench_init(%d, %d, %d)", o.Seed, o.HeapMB, 1<<20)
}

func (o LatencyOptions) stepCode(s latStep) string {
	return fmt.Sprintf("bench_step(%d, %q, %d)", s.round, s.label, o.StepMB)
}

// replayCode is what a replay runs to rebuild a node's process state: the first
// command, then the node's steps from the root, in order.
func (o LatencyOptions) replayCode(path []latStep) []string {
	out := []string{o.initCode()}
	for _, s := range path {
		out = append(out, o.stepCode(s))
	}
	return out
}

// latPyStr turns the repr of a python str (what a call answers) into the string.
func latPyStr(out string) string {
	s := strings.TrimSpace(out)
	if len(s) >= 2 && (s[0] == '\'' || s[0] == '"') && s[len(s)-1] == s[0] {
		return s[1 : len(s)-1]
	}
	return s
}

// ---- the bench ----

// latNode is a node of one system's tree.
type latNode struct {
	id     string // deltabox node id, or the baseline's snapshot directory
	label  string
	depth  int // deltabox: stack depth; baselines: steps from the root
	path   []latStep
	digest string // bench_digest() when it was checkpointed
	parent *latNode
	kids   int
}

type latSample struct {
	op, withCall, call float64
	daemon             float64
	phases             map[string]int64
	depth              int
	fast               bool // restore: warm state; checkpoint: prepared next state
	processes          int
	processErrors      int
	parts              map[string]float64 // baselines: parts of the interval (copy, replay, ...)
	replayed           int
	complete           float64 // checkpoint: the node's complete_ms (the daemon's time until the node was complete)
}

type latRun struct {
	c     *client.Client
	o     LatencyOptions
	f     *File
	ws    *Workspace
	start time.Time
	rng   *mrand.Rand
	round int // heap steps (unique per run)

	criu                  *criu.Runner // how CRIU runs here (the criu baseline)
	files                 *fsRun       // file change steps in the deltabox sandbox (reused from bench fs)
	base                  *latNode
	ckpts, rests          []latSample
	ckptsEarly            []latSample // checkpoints that answered early (checkpoint-answer)
	earlyDeclined         int         // asked to answer early, answered at the end (counted in ckpts)
	forks                 []latSample // bench_fork in the session (SysForkFloor)
	spareRests            []latSample // restores of the fork's node in its branch (restore-spare)
	fromSpare             int         // of spareRests, those the daemon served from a spare
	spareBytes, sparePriv []float64   // the branch's spare_bytes and spare_private_bytes after each spare was made (MB)
	branch                string      // the fork's branch (restore-spare), removed at the end
	heapMS                []float64
	stateFails            int
	pythonRSSKB           int
	hits, fallbacks       int
	statsBefore, statsEnd apitypes.Stats
}

func (r *latRun) logf(format string, a ...any) {
	progress(r.o.Log, r.start, format, a...)
}

func (r *latRun) nextStep(label string) latStep {
	r.round++
	return latStep{round: r.round, label: label}
}

// RunLatency runs the latency bench and returns its File. On error the File holds what
// was measured so far; sandboxes, nodes, host copies, CRIU images and host processes
// are removed in every case.
func RunLatency(ctx context.Context, c *client.Client, o LatencyOptions) (f *File, err error) {
	start := time.Now()
	f = &File{Bench: "latency", Command: o.Command, Machine: CurrentMachine(), Started: start.UTC()}
	if err := o.Validate(); err != nil {
		return f, err
	}
	f.Targets = []Target{
		{System: SysDeltaBox, Op: "checkpoint", Stat: "p50_ms", MaxMS: 2},
		{System: SysDeltaBox, Op: "checkpoint", Stat: "p99_ms", MaxMS: 5},
		{System: SysDeltaBox, Op: "restore", Stat: "p50_ms", MaxMS: 1.5},
		{System: SysDeltaBox, Op: "restore", Stat: "p99_ms", MaxMS: 4},
		{System: SysDeltaBox, Op: "checkpoint-answer", Stat: "p50_ms", MaxMS: 1.5},
		{System: SysDeltaBox, Op: "restore-spare", Stat: "p50_ms", MaxMS: 1.5},
	}
	f.Notes = append(f.Notes, o.Notes...)
	if err := c.Health(ctx); err != nil {
		return f, err
	}
	if o.Python == "" {
		out, err := deadline.Command(ctx, shortTimeout, "python3", "-c", "import sys; print(sys.executable)").Output()
		if err != nil {
			return f, fmt.Errorf("the baselines need python3 on the host: %v", err)
		}
		o.Python = strings.TrimSpace(string(out))
	}
	if out, err := deadline.Command(ctx, shortTimeout, o.Python, "--version").CombinedOutput(); err == nil {
		f.Machine.Python = strings.TrimSpace(string(out))
	}
	var cr *criu.Runner
	if o.has(SysCRIU) {
		// The self-test first: on a machine without hardware breakpoints a plain dump
		// never returns, and a baseline that cannot run is reported, not waited for.
		cr = criu.Probe(ctx, o.CRIU)
		o.CRIU, f.Machine.CRIU = cr.Bin, cr
		if o.Log != nil {
			fmt.Fprintf(o.Log, "criu: %s\n", cr)
		}
		f.Notes = append(f.Notes, "criu: "+criuNote(cr))
	}
	if o.has(SysCopytree) {
		if err := os.MkdirAll(o.HostDir, 0o700); err != nil {
			return f, fmt.Errorf("host directory: %w", err)
		}
		defer os.RemoveAll(o.HostDir)
		f.Machine.StoreFS = fsType(o.HostDir)
	}
	settings, _ := json.Marshal(o)
	json.Unmarshal(settings, &f.Settings)
	f.Description = latencyDescription(o)

	r := &latRun{c: c, o: o, f: f, start: start, rng: mrand.New(mrand.NewSource(o.Seed)),
		ws: &Workspace{MB: o.WorkspaceMB}, criu: cr}
	defer func() {
		f.Workspaces = []Workspace{*r.ws}
		f.Finished = time.Now().UTC()
		f.DurationS = float64(int(time.Since(start).Seconds()*10)) / 10
		f.Machine.LoadAvgEnd = LoadAvg()
		if f.Machine.LoadAvgStart > 1 || f.Machine.LoadAvgEnd > 1 {
			f.Notes = append(f.Notes, fmt.Sprintf("1-minute load average %.2f at the start and %.2f at the end on %d CPUs: other work ran on the machine, so tails (p95/p99) are noisier than on an idle machine",
				f.Machine.LoadAvgStart, f.Machine.LoadAvgEnd, f.Machine.CPUs))
		}
	}()

	// The deltabox sandbox and the tree stay until the fs-only baseline, which starts
	// from the same generated workspace (the root node, restored into its sandbox).
	sb := "bench-lat-" + randHex(4)
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		if r.branch != "" {
			if e := c.Remove(cctx, r.branch); e != nil {
				err = errors.Join(err, fmt.Errorf("cleanup: remove sandbox %s: %w", r.branch, e))
			}
		}
		if r.ws.Sandbox != "" {
			if e := c.Remove(cctx, sb); e != nil {
				err = errors.Join(err, fmt.Errorf("cleanup: remove sandbox %s: %w", sb, e))
			}
		}
		if r.base != nil {
			if _, e := c.RemoveNode(cctx, r.base.id); e != nil {
				err = errors.Join(err, fmt.Errorf("cleanup: remove node %s and its subtree: %w", r.base.id, e))
			}
		}
		r.logf("removed sandbox %s and the tree", sb)
	}()
	rows, err := r.deltabox(ctx, sb)
	if err == nil && o.SpareRestores > 0 {
		err = r.spares(ctx, sb)
	}
	rows = append(rows, r.spareRows()...)
	f.Results = append(f.Results, rows...)
	if err != nil {
		return f, err
	}
	for _, b := range []struct {
		name string
		run  func(context.Context) ([]Row, error)
	}{{SysCRIU, r.criuBaseline}, {SysCopytree, r.copytreeBaseline}, {SysFSOnly, r.fsOnlyBaseline}} {
		if !o.has(b.name) {
			continue
		}
		rows, err := b.run(ctx)
		f.Results = append(f.Results, rows...)
		if err != nil {
			return f, fmt.Errorf("%s: %w", b.name, err)
		}
	}
	r.ratioNotes()
	return f, nil
}

func latencyDescription(o LatencyOptions) string {
	var b strings.Builder
	fmt.Fprintf(&b, "Checkpoint and restore of a sandbox's files and live processes together. The sandbox holds a %s workspace "+
		"(`/workspace`, written by the `bench fs` generator: about %d small files and %d large ones, seed %d) and a python session "+
		"(`client.StartSession`, kind python) whose first command builds a heap of %d bytes objects of 1 MiB (%d MiB, seeded) and "+
		"defines `bench_step` (`latHeapPy` in internal/bench/latency.go). Every operation follows one step: a session call "+
		"`bench_step(round, label, %d)` that rewrites %d random chunks (%d MiB of the heap) and returns a CRC of the whole heap, "+
		"then an exec that changes %d files (the `bench fs` change script). ",
		mbCell(o.WorkspaceMB), o.SmallFiles, o.LargeFiles, o.Seed, o.HeapMB, o.HeapMB, o.StepMB, o.StepMB, o.StepMB, o.Changes)
	fmt.Fprintf(&b, "`deltabox`: the generated state is checkpointed (the root, not in the rows), then a chain of %d checkpoints, then "+
		"%d rounds of: a step (which the restore discards), a restore to a node drawn at random from the whole tree, a step, a "+
		"checkpoint (a child of the restored node). The tree is kept at %d nodes or fewer by removing random leaves between "+
		"operations (untimed), so that the process templates it holds stay bounded. After every operation the session's next call "+
		"(`label_`) is timed (the `+exec` rows: the restored or checkpointed python answers), then checked untimed: the heap's CRC, "+
		"the step label and a marker file must be the node's.\n\n",
		o.Chain, o.Restores, o.MaxNodes)
	b.WriteString("`deltabox` rows are the wall time of the Go client call on the daemon's unix socket; the call returns when the " +
		"sandbox can run its next exec. The `+exec` rows add that next exec, a call into the restored or checkpointed python session " +
		"(`client.Run`: `POST /v1/sandboxes/{id}/exec` with `session: py`), timed in the same samples. Restores served by a process " +
		"template are counted from each restore's answer (`processes`, `process_errors`) and from the daemon's per-sandbox counters " +
		"(`stats.restore_paths`: process, files_only, failed).\n\n")
	fmt.Fprintf(&b, "Baselines, in the same run, each build a chain of %d checkpoints and restore %d times to random nodes of it "+
		"(fewer samples: each takes up to seconds), with the same steps between operations (for `criu`, the heap step only). `criu`: a python3 on the host (own "+
		"session, stdio on /dev/null, an abstract unix socket for calls; the same exec/eval loop as the session and the same heap "+
		"code), `criu dump --leave-running` and `criu restore -d` with images on tmpfs (the last %d image sets kept; a restore first kills "+
		"the live process, which holds the PID); process only, no files. `copytree+replay`: the same workspace generated on the host (checksum compared) on the store's reflink "+
		"filesystem; a checkpoint is `cp -a --reflink=auto` of the workspace; a restore copies the node's snapshot back, starts a "+
		"fresh python3 and replays the node's commands from the root (the heap's first command and every step on the path). "+
		"`fs-only+replay`: a second DeltaBox sandbox that starts from the root node (its files only) and ends its python session "+
		"before each checkpoint, so that its nodes hold no process template; a restore brings the files back, starts the session "+
		"again and replays the path's commands; its checkpoint must also start the session again and replay, to go on. Every "+
		"baseline interval ends when the python process answers a call (the last replayed step, or `label_`); restored state is "+
		"checked untimed (CRC, label, marker file).", o.BaselineCheckpoints, o.BaselineRestores, o.CRIUKeep)
	b.WriteString("\n\n`kernel-fork` is a reference, not a baseline: after each branch checkpoint the session itself times an " +
		"`os.fork()` (the child exits at once; `bench_fork`), so the same process, with the same memory, mappings and fork " +
		"lineage, at the same moments. A template fork is that kernel work (page tables copied, anon_vma chains cloned) plus " +
		"the injection around it: it is the floor under every deltabox row but `checkpoint-answer`.")
	b.WriteString("\n\nThe chain's checkpoints and every other branch checkpoint answer once their node is complete (`answer: " +
		"\"complete\"`: the `checkpoint` rows); the other branch checkpoints answer early (`answer: \"early\"`: the " +
		"`checkpoint-answer` rows), once the session's process is seized, and make its template after the answer " +
		"(internal/state/checkpoint.go, \"The early answer\"); one the daemon answered at its end anyway (its node not pending: " +
		"when an early answer would not be exact) counts in the `checkpoint` rows (`early_declined`). Its `+exec` row's call " +
		"waits for the node to be complete. `complete_ms` is the node's time until complete (GET /v1/nodes/{id}, read untimed " +
		"after that call), beside the complete checkpoints' own (`checkpoint_complete_ms_p50`).")
	return b.String()
}

// ---- deltabox ----

const latSession = "py"

func (r *latRun) run(ctx context.Context, sb, code string) (string, error) {
	res, err := r.c.Run(ctx, sb, latSession, code, 5*time.Minute)
	if err != nil {
		return "", err
	}
	if res.ExitCode != 0 {
		return "", fmt.Errorf("python session call exited %d: %s", res.ExitCode, strings.TrimSpace(res.Stdout))
	}
	if res.SessionRestarted {
		return res.Stdout, fmt.Errorf("the python session was restarted (its state was lost)")
	}
	return res.Stdout, nil
}

// heapStep runs one heap step in the session and returns the heap's digest.
func (r *latRun) heapStep(ctx context.Context, sb string, s latStep) (string, error) {
	t := time.Now()
	out, err := r.run(ctx, sb, r.o.stepCode(s))
	if err != nil {
		return "", fmt.Errorf("heap step %d: %w", s.round, err)
	}
	r.heapMS = append(r.heapMS, ms(time.Since(t)))
	return latPyStr(out), nil
}

// stepBoth runs a heap step and a file change step with the same label.
func (r *latRun) stepBoth(ctx context.Context, files *fsRun, sb string, s latStep) (string, error) {
	d, err := r.heapStep(ctx, sb, s)
	if err != nil {
		return "", err
	}
	return d, files.change(ctx, "", s.label)
}

// checkState checks, untimed, that the session and the files are the node's.
func (r *latRun) checkState(ctx context.Context, sb string, n *latNode) error {
	out, err := r.run(ctx, sb, "bench_digest() + ' ' + open('/workspace/.bench/marker').read()")
	r.ws.MarkerChecks++
	want := n.digest + " " + n.label
	if err != nil || latPyStr(out) != want {
		r.ws.MarkerFailures++
		r.stateFails++
		if r.ws.MarkerFailures <= 3 {
			r.f.Notes = append(r.f.Notes, fmt.Sprintf("after a restore to node %s the sandbox showed %q (err %v), want %q: a daemon bug", n.id, latPyStr(out), err, want))
		}
	}
	return nil
}

func (r *latRun) ping(ctx context.Context, sb, label string) error {
	out, err := r.run(ctx, sb, "label_")
	if err != nil {
		return err
	}
	if got := latPyStr(out); got != label {
		return fmt.Errorf("the python session answered label %q, want %q", got, label)
	}
	return nil
}

// checkpoint checkpoints sb, with the answer asked for (apitypes.CheckpointRequest.Answer):
// "complete" (the checkpoint row) or "early" (checkpoint-answer, which must answer with
// its node pending).
func (r *latRun) checkpoint(ctx context.Context, sb string, parent *latNode, s latStep, digest, answer string) (*latNode, error) {
	t0 := time.Now()
	res, err := r.c.CheckpointWith(ctx, sb, apitypes.CheckpointRequest{Label: s.label, Answer: answer})
	t1 := time.Now()
	if err != nil {
		return nil, fmt.Errorf("checkpoint %s: %w", s.label, err)
	}
	early := res.Node.Pending
	if early && answer != "early" {
		return nil, fmt.Errorf("checkpoint %s, answer %q: node %s pending", s.label, answer, res.Node.ID)
	}
	if answer == "early" && !early {
		r.earlyDeclined++ // the daemon answered at the end (checkpoint.go: when an early answer is taken)
	}
	if err := r.ping(ctx, sb, s.label); err != nil {
		return nil, fmt.Errorf("after checkpoint %s: %w", s.label, err)
	}
	t2 := time.Now()
	sample := latSample{op: ms(t1.Sub(t0)), withCall: ms(t2.Sub(t0)), call: ms(t2.Sub(t1)), daemon: res.DurationMS,
		phases: res.PhasesUS, depth: res.Node.Depth, fast: res.Prepared, processes: res.Processes, processErrors: len(res.ProcessErrors),
		complete: res.CompleteMS}
	if early {
		// Untimed: the node is complete once the call above has run (it waited for it).
		in, err := r.c.Node(ctx, res.Node.ID)
		if err != nil || in.Pending || in.CompleteMS <= 0 {
			return nil, fmt.Errorf("node %s after its early checkpoint and a call: %+v, %v; want it complete, with complete_ms", res.Node.ID, in, err)
		}
		sample.complete = in.CompleteMS
		r.ckptsEarly = append(r.ckptsEarly, sample)
	} else {
		r.ckpts = append(r.ckpts, sample)
	}
	if res.Processes != 1 || len(res.ProcessErrors) > 0 {
		return nil, fmt.Errorf("checkpoint %s took %d processes (%v), want the python session", s.label, res.Processes, res.ProcessErrors)
	}
	n := &latNode{id: res.Node.ID, label: s.label, depth: res.Node.Depth, digest: digest, parent: parent}
	if parent != nil {
		n.path = append(append([]latStep(nil), parent.path...), s)
		parent.kids++
	}
	return n, nil
}

func (r *latRun) restore(ctx context.Context, sb string, n *latNode) error {
	t0 := time.Now()
	res, err := r.c.Restore(ctx, sb, n.id)
	t1 := time.Now()
	if err != nil {
		return fmt.Errorf("restore to %s: %w", n.id, err)
	}
	if err := r.ping(ctx, sb, n.label); err != nil {
		return fmt.Errorf("after restore to %s: %w", n.id, err)
	}
	t2 := time.Now()
	depth := n.depth
	if res.Node != nil {
		depth = res.Node.Depth
	}
	r.rests = append(r.rests, latSample{op: ms(t1.Sub(t0)), withCall: ms(t2.Sub(t0)), call: ms(t2.Sub(t1)), daemon: res.DurationMS,
		phases: res.PhasesUS, depth: depth, fast: res.Warm, processes: res.Processes, processErrors: len(res.ProcessErrors)})
	if res.Processes == 1 && len(res.ProcessErrors) == 0 {
		r.hits++
	} else {
		r.fallbacks++
	}
	return r.checkState(ctx, sb, n)
}

func (r *latRun) deltabox(ctx context.Context, sb string) ([]Row, error) {
	c, o := r.c, r.o
	r.ws.LoadAvg[0] = LoadAvg()
	defer func() { r.ws.LoadAvg[1] = LoadAvg() }()
	r.logf("deltabox: create sandbox %s", sb)
	if _, err := c.Create(ctx, apitypes.CreateOptions{ID: sb, Image: o.Image, Workdir: "/workspace"}); err != nil {
		return nil, fmt.Errorf("create sandbox: %w", err)
	}
	r.ws.Sandbox = sb
	r.files = &fsRun{c: c, o: FSOptions{Seed: o.Seed, Changes: o.Changes, LargeEvery: o.LargeEvery}, sb: sb, mb: o.WorkspaceMB, f: r.f, ws: r.ws}

	r.logf("deltabox: generate the %s workspace in the sandbox", mbCell(o.WorkspaceMB))
	t := time.Now()
	out, err := r.files.py(ctx, genPy, "/workspace", strconv.FormatInt(o.Seed, 10), strconv.Itoa(o.WorkspaceMB), strconv.Itoa(o.SmallFiles), strconv.Itoa(o.LargeFiles))
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
	if out, err = r.files.py(ctx, checksumPy, "/workspace"); err != nil {
		return nil, fmt.Errorf("checksum workspace: %w", err)
	}
	var cs checksum
	if err := json.Unmarshal([]byte(out), &cs); err != nil {
		return nil, fmt.Errorf("checksum: %v: %q", err, out)
	}
	r.ws.SHA256, r.ws.Files = cs.SHA256, cs.Files

	r.logf("deltabox: python session with a %d MiB heap", o.HeapMB)
	if _, err := c.StartSession(ctx, sb, apitypes.SessionOptions{Name: latSession, Kind: apitypes.SessionPython}); err != nil {
		return nil, fmt.Errorf("start the python session: %w", err)
	}
	out, err = r.run(ctx, sb, o.initCode())
	if err != nil {
		return nil, fmt.Errorf("build the heap: %w", err)
	}
	digest := latPyStr(out)
	if out, err := r.run(ctx, sb, "[l for l in open('/proc/self/status') if l.startswith('VmRSS')][0].split()[1]"); err == nil {
		r.pythonRSSKB, _ = strconv.Atoi(latPyStr(out))
	}
	// The root: the generated workspace and the fresh heap (untimed in the rows).
	if _, err := r.run(ctx, sb, "label_ = 'base'"); err != nil {
		return nil, err
	}
	digest = "base" + strings.TrimPrefix(digest, "init")
	if err := c.Sync(ctx); err != nil {
		return nil, err
	}
	t = time.Now()
	res, err := c.Checkpoint(ctx, sb, "base")
	if err != nil {
		return nil, fmt.Errorf("root checkpoint: %w", err)
	}
	r.ws.InitialCheckpointMS = us(ms(time.Since(t)))
	r.base = &latNode{id: res.Node.ID, label: "base", depth: res.Node.Depth, digest: digest}
	// Markers name the root too (the generator wrote "base").
	if err := c.Sync(ctx); err != nil {
		return nil, err
	}
	if info, err := c.Get(ctx, sb); err == nil {
		r.statsBefore = info.Stats
	}

	pool := []*latNode{r.base}
	head := r.base
	r.logf("deltabox: chain of %d checkpoints", o.Chain)
	for i := 1; i <= o.Chain; i++ {
		s := r.nextStep(fmt.Sprintf("c%03d", i))
		d, err := r.stepBoth(ctx, r.files, sb, s)
		if err != nil {
			return nil, err
		}
		n, err := r.checkpoint(ctx, sb, head, s, d, "complete")
		if err != nil {
			return nil, err
		}
		pool = append(pool, n)
		head = n
	}
	r.logf("deltabox: %d restores to random nodes, each followed by a branch checkpoint (tree bound %d)", o.Restores, o.MaxNodes)
	targets := map[string]bool{}
	minPool, maxPool := len(pool), len(pool)
	removed := 0
	for j := 1; j <= o.Restores; j++ {
		if _, err := r.stepBoth(ctx, r.files, sb, r.nextStep(fmt.Sprintf("d%04d", j))); err != nil {
			return nil, err
		}
		if len(pool) < minPool {
			minPool = len(pool)
		}
		n := pool[r.rng.Intn(len(pool))]
		targets[n.id] = true
		if err := r.restore(ctx, sb, n); err != nil {
			return nil, err
		}
		s := r.nextStep(fmt.Sprintf("b%04d", j))
		d, err := r.stepBoth(ctx, r.files, sb, s)
		if err != nil {
			return nil, err
		}
		// Every other branch checkpoint answers early (checkpoint-answer).
		answer := "complete"
		if j%2 == 1 {
			answer = "early"
		}
		m, err := r.checkpoint(ctx, sb, n, s, d, answer)
		if err != nil {
			return nil, err
		}
		pool = append(pool, m)
		head = m
		// The kernel's fork of the same process now (untimed in the rows above).
		out, err := r.run(ctx, sb, "bench_fork()")
		if err != nil {
			return nil, fmt.Errorf("time the session's fork: %w", err)
		}
		var f, w float64
		if _, err := fmt.Sscan(latPyStr(out), &f, &w); err != nil {
			return nil, fmt.Errorf("time the session's fork: %q: %w", out, err)
		}
		r.forks = append(r.forks, latSample{op: f, parts: map[string]float64{"exit_and_reap": w}})
		if len(pool) > maxPool {
			maxPool = len(pool)
		}
		for len(pool) > o.MaxNodes {
			k := latPickLeaf(pool, head, r.base, r.rng)
			if k < 0 {
				break
			}
			if _, err := c.RemoveNode(ctx, pool[k].id); err != nil {
				return nil, fmt.Errorf("remove leaf %s: %w", pool[k].id, err)
			}
			if p := pool[k].parent; p != nil {
				p.kids--
			}
			pool = append(pool[:k], pool[k+1:]...)
			removed++
		}
		if j%50 == 0 {
			r.logf("deltabox: %d restores (last %.3f ms), %d checkpoints (last %.3f ms), %d nodes", j, r.rests[len(r.rests)-1].op,
				len(r.ckpts), r.ckpts[len(r.ckpts)-1].op, len(pool))
		}
	}
	if info, err := c.Get(ctx, sb); err == nil {
		r.statsEnd = info.Stats
	}
	r.ws.TreeNodes = len(pool)
	r.ws.FilesChanged = LayerDist(r.files.changed)
	r.ws.ChangeExecP50MS = us(Summarize(r.files.changeMS).P50)
	if r.stateFails > 0 {
		r.f.Notes = append(r.f.Notes, fmt.Sprintf("%d of %d restores showed the wrong process or file state (untimed check): a daemon bug", r.stateFails, r.ws.MarkerChecks))
	}
	return r.deltaboxRows(len(targets), minPool, maxPool, removed), nil
}

// spares forks sb once (POST /v1/sandboxes/{id}/fork, count 1: sb and its branch are
// then members of a family, the fork's node F's templates in its holder), then, in the
// branch, SpareRestores rounds of: a step (heap and files), a wait until the branch
// holds a spare of F (POST /v1/nodes/F/prepare, untimed: an agent thinks for seconds),
// a restore of F (timed, restore-spare), the check of its state.
func (r *latRun) spares(ctx context.Context, sb string) error {
	c, o := r.c, r.o
	label, err := r.run(ctx, sb, "label_")
	if err != nil {
		return err
	}
	digest, err := r.run(ctx, sb, "bench_digest()")
	if err != nil {
		return err
	}
	r.logf("deltabox: fork the sandbox once, then %d restores of the fork's node in its branch, each from a spare", o.SpareRestores)
	res, err := c.ForkSandbox(ctx, sb, apitypes.SandboxForkRequest{ForkRequest: apitypes.ForkRequest{Count: 1, CreateOptions: apitypes.CreateOptions{ID: sb + "-b"}}})
	if err != nil {
		return fmt.Errorf("fork: %w", err)
	}
	br := res.Branches[0]
	r.branch = br.Sandbox.ID
	if br.Path != "fast" {
		r.f.Notes = append(r.f.Notes, fmt.Sprintf("restore-spare: the fork took the %s path (%s): no spare can be made, no row", br.Path, br.Reason))
		return nil
	}
	fn := &latNode{id: res.Node, label: latPyStr(label), digest: latPyStr(digest)}
	files := *r.files
	files.sb = r.branch
	for i := 1; i <= o.SpareRestores; i++ {
		if _, err := r.stepBoth(ctx, &files, r.branch, r.nextStep(fmt.Sprintf("s%04d", i))); err != nil {
			return err
		}
		if _, err := c.PrepareNode(ctx, fn.id, r.branch); err != nil {
			return fmt.Errorf("prepare %s for %s: %w", fn.id, r.branch, err)
		}
		if info, err := c.Get(ctx, r.branch); err == nil && info.Stats.SpareBytes > 0 {
			r.spareBytes = append(r.spareBytes, float64(info.Stats.SpareBytes)/(1<<20))
			r.sparePriv = append(r.sparePriv, float64(info.Stats.SparePrivateBytes)/(1<<20))
		}
		t0 := time.Now()
		rs, err := c.Restore(ctx, r.branch, fn.id)
		t1 := time.Now()
		if err != nil {
			return fmt.Errorf("restore of %s in %s: %w", fn.id, r.branch, err)
		}
		if err := r.ping(ctx, r.branch, fn.label); err != nil {
			return fmt.Errorf("after the restore of %s in %s: %w", fn.id, r.branch, err)
		}
		t2 := time.Now()
		r.spareRests = append(r.spareRests, latSample{op: ms(t1.Sub(t0)), withCall: ms(t2.Sub(t0)), call: ms(t2.Sub(t1)), daemon: rs.DurationMS,
			phases: rs.PhasesUS, depth: rs.Node.Depth, fast: rs.FromSpare, processes: rs.Processes, processErrors: len(rs.ProcessErrors)})
		if rs.FromSpare {
			r.fromSpare++
		}
		if err := r.checkState(ctx, r.branch, fn); err != nil {
			return err
		}
	}
	return nil
}

// spareRows are the restore-spare rows (none without samples).
func (r *latRun) spareRows() []Row {
	ss := r.spareRests
	if len(ss) == 0 {
		return nil
	}
	d := Summarize(pick(ss, func(s latSample) float64 { return s.daemon }))
	row := Summarize(pick(ss, func(s latSample) float64 { return s.op })).Row(SysDeltaBox, "restore-spare", r.o.WorkspaceMB, latRsCall)
	sb, sp := Summarize(r.spareBytes), Summarize(r.sparePriv)
	row.Info = map[string]any{
		"daemon_p50_ms": us(d.P50), "daemon_p95_ms": us(d.P95), "daemon_p99_ms": us(d.P99), "phases_p50_us": latPhases(ss),
		"from_spare": r.fromSpare, "restores": len(ss), "spare_pss_mb_p50": us(sb.P50), "spare_pss_mb_max": us(sb.Max),
		"spare_private_mb_p50": us(sp.P50), "python_rss_mb": r.pythonRSSKB / 1024,
	}
	rows := []Row{row}
	row = Summarize(pick(ss, func(s latSample) float64 { return s.withCall })).Row(SysDeltaBox, "restore-spare+exec", r.o.WorkspaceMB, latRsCall, latPingCall)
	e := Summarize(pick(ss, func(s latSample) float64 { return s.call }))
	row.Info = map[string]any{"exec_p50_ms": us(e.P50), "exec_p95_ms": us(e.P95), "exec_p99_ms": us(e.P99)}
	rows = append(rows, row)
	r.f.Notes = append(r.f.Notes, fmt.Sprintf("restore-spare: the sandbox was forked once (count 1), then %d restores of the fork's node in its branch, "+
		"each after a step and a wait until the branch held a spare of the node (POST /v1/nodes/{id}/prepare, untimed); %d were served by a spare "+
		"(from_spare), the others forked; a spare's copies held %s MB pss_anon p50 (stats.spare_bytes, what the template budget counts), "+
		"of it %s MB alone (private dirty pages and page tables: stats.spare_private_bytes), beside the %d MB python.",
		len(ss), r.fromSpare, fmtMS(sb.P50), fmtMS(sp.P50), r.pythonRSSKB/1024))
	return rows
}

// latPickLeaf returns the index in pool of a random leaf other than head and root, or -1.
func latPickLeaf(pool []*latNode, head, root *latNode, rng *mrand.Rand) int {
	var leaves []int
	for i, n := range pool {
		if n.kids == 0 && n != head && n != root {
			leaves = append(leaves, i)
		}
	}
	if len(leaves) == 0 {
		return -1
	}
	return leaves[rng.Intn(len(leaves))]
}

const (
	latCkCall      = `client.CheckpointWith(ctx, sandbox, {label, answer: "complete"}): POST /v1/sandboxes/{id}/checkpoint`
	latCkEarlyCall = `client.CheckpointWith(ctx, sandbox, {label, answer: "early"}): POST /v1/sandboxes/{id}/checkpoint`
	latRsCall      = "client.Restore(ctx, sandbox, node): POST /v1/sandboxes/{id}/restore"
	latPingCall    = `client.Run(ctx, sandbox, "py", "label_"): POST /v1/sandboxes/{id}/exec {session: "py"}`
)

// latTailPhases is latPhases over the samples whose daemon time is at or above its p95.
func latTailPhases(ss []latSample) map[string]float64 {
	return tailPhases(ss, func(s latSample) float64 { return s.daemon }, func(s latSample) map[string]int64 { return s.phases })
}

func latPhases(ss []latSample) map[string]float64 {
	return phaseMedians(ss, func(s latSample) map[string]int64 { return s.phases })
}

func (r *latRun) deltaboxRows(distinct, minPool, maxPool, removed int) []Row {
	depths := func(ss []latSample) *Layers {
		d := make([]int, len(ss))
		for i, s := range ss {
			d[i] = s.depth
		}
		return LayerDist(d)
	}
	count := func(ss []latSample, f func(latSample) bool) (n int) {
		for _, s := range ss {
			if f(s) {
				n++
			}
		}
		return n
	}
	op := func(s latSample) float64 { return s.op }
	withCall := func(s latSample) float64 { return s.withCall }
	call := func(s latSample) float64 { return s.call }
	daemon := func(s latSample) float64 { return s.daemon }
	overhead := func(s latSample) float64 { return s.op - s.daemon }
	var rows []Row
	heap := us(Summarize(r.heapMS).P50)
	if len(r.ckpts) > 0 {
		d := Summarize(pick(r.ckpts, daemon))
		row := Summarize(pick(r.ckpts, op)).Row(SysDeltaBox, "checkpoint", r.o.WorkspaceMB, latCkCall)
		row.Layers = depths(r.ckpts)
		row.Info = map[string]any{
			"daemon_p50_ms": us(d.P50), "daemon_p95_ms": us(d.P95), "daemon_p99_ms": us(d.P99), "phases_p50_us": latPhases(r.ckpts),
			"phases_tail_us":             latTailPhases(r.ckpts),
			"client_minus_daemon_p50_ms": us(Summarize(pick(r.ckpts, overhead)).P50),
			"prepared":                   count(r.ckpts, func(s latSample) bool { return s.fast }),
			"chain":                      r.o.Chain, "branch": len(r.ckpts) - r.o.Chain,
			"daemon_checkpoint_paths": latPathDelta(r.statsBefore.CheckpointPaths, r.statsEnd.CheckpointPaths),
			"python_rss_mb":           r.pythonRSSKB / 1024, "heap_step_p50_ms": heap,
		}
		rows = append(rows, row)
		row = Summarize(pick(r.ckpts, withCall)).Row(SysDeltaBox, "checkpoint+exec", r.o.WorkspaceMB, latCkCall, latPingCall)
		row.Layers = depths(r.ckpts)
		e := Summarize(pick(r.ckpts, call))
		row.Info = map[string]any{"exec_p50_ms": us(e.P50), "exec_p95_ms": us(e.P95), "exec_p99_ms": us(e.P99)}
		rows = append(rows, row)
	}
	if len(r.ckptsEarly) > 0 {
		d := Summarize(pick(r.ckptsEarly, daemon))
		cm := Summarize(pick(r.ckptsEarly, func(s latSample) float64 { return s.complete }))
		cmComplete := Summarize(pick(r.ckpts, func(s latSample) float64 { return s.complete }))
		row := Summarize(pick(r.ckptsEarly, op)).Row(SysDeltaBox, "checkpoint-answer", r.o.WorkspaceMB, latCkEarlyCall)
		row.Layers = depths(r.ckptsEarly)
		row.Info = map[string]any{
			"daemon_p50_ms": us(d.P50), "daemon_p95_ms": us(d.P95), "daemon_p99_ms": us(d.P99), "phases_p50_us": latPhases(r.ckptsEarly),
			"client_minus_daemon_p50_ms": us(Summarize(pick(r.ckptsEarly, overhead)).P50),
			"complete_ms_p50":            us(cm.P50), "complete_ms_p95": us(cm.P95), "complete_ms_p99": us(cm.P99),
			"checkpoint_complete_ms_p50": us(cmComplete.P50),
			"early_declined":             r.earlyDeclined,
		}
		rows = append(rows, row)
		row = Summarize(pick(r.ckptsEarly, withCall)).Row(SysDeltaBox, "checkpoint-answer+exec", r.o.WorkspaceMB, latCkEarlyCall, latPingCall)
		row.Layers = depths(r.ckptsEarly)
		e := Summarize(pick(r.ckptsEarly, call))
		row.Info = map[string]any{"exec_p50_ms": us(e.P50), "exec_p95_ms": us(e.P95), "exec_p99_ms": us(e.P99)}
		rows = append(rows, row)
	}
	if len(r.rests) > 0 {
		d := Summarize(pick(r.rests, daemon))
		row := Summarize(pick(r.rests, op)).Row(SysDeltaBox, "restore", r.o.WorkspaceMB, latRsCall)
		row.Layers = depths(r.rests)
		row.Info = map[string]any{
			"daemon_p50_ms": us(d.P50), "daemon_p95_ms": us(d.P95), "daemon_p99_ms": us(d.P99), "phases_p50_us": latPhases(r.rests),
			"phases_tail_us":             latTailPhases(r.rests),
			"client_minus_daemon_p50_ms": us(Summarize(pick(r.rests, overhead)).P50),
			"warm":                       count(r.rests, func(s latSample) bool { return s.fast }),
			"template_restores":          r.hits, "files_only_restores": r.fallbacks,
			"template_hit_rate":    us(float64(r.hits) / float64(len(r.rests))),
			"daemon_restore_paths": latPathDelta(r.statsBefore.RestorePaths, r.statsEnd.RestorePaths),
			"distinct_nodes":       distinct, "tree_nodes": fmt.Sprintf("%d-%d", minPool, maxPool), "leaves_removed": removed,
			"state_checks_failed": r.stateFails,
		}
		rows = append(rows, row)
		row = Summarize(pick(r.rests, withCall)).Row(SysDeltaBox, "restore+exec", r.o.WorkspaceMB, latRsCall, latPingCall)
		row.Layers = depths(r.rests)
		e := Summarize(pick(r.rests, call))
		row.Info = map[string]any{"exec_p50_ms": us(e.P50), "exec_p95_ms": us(e.P95), "exec_p99_ms": us(e.P99)}
		rows = append(rows, row)
		rp := latPathDelta(r.statsBefore.RestorePaths, r.statsEnd.RestorePaths)
		agree := "agree"
		if rp["process"] != r.hits || rp["files_only"] != r.fallbacks {
			agree = "do not agree"
		}
		r.f.Notes = append(r.f.Notes, fmt.Sprintf("template hits: %d of %d deltabox restores were served by a process template (the answer's "+
			"`processes` = 1, no `process_errors`), %d fell back to files only; the daemon's per-path counters %s: stats.restore_paths "+
			"process %d, files_only %d, failed %d over the same restores. %d restores installed a warm state, %d of %d checkpoints used a prepared next state.",
			r.hits, len(r.rests), r.fallbacks, agree, rp["process"], rp["files_only"], rp["failed"],
			count(r.rests, func(s latSample) bool { return s.fast }), count(r.ckpts, func(s latSample) bool { return s.fast }), len(r.ckpts)))
	}
	if len(r.forks) > 0 {
		row := latBaselineRow(SysForkFloor, "fork", r.o.WorkspaceMB, r.forks, "python: os.fork() in the bench's session, timed in the process (bench_fork)")
		row.Info["python_rss_mb"] = r.pythonRSSKB / 1024
		rows = append(rows, row)
	}
	return rows
}

// latPathDelta is what the daemon's per-path counters of a sandbox counted between two
// readings.
func latPathDelta(a, b apitypes.PathCounts) map[string]int {
	return map[string]int{"process": b.Process - a.Process, "files_only": b.FilesOnly - a.FilesOnly, "failed": b.Failed - a.Failed}
}

// ---- host python processes (criu, copytree+replay) ----

// latHost is the baselines' python3 on the host, serving calls on an abstract unix
// socket. It is a child of the bench (or, once CRIU restored it, reparented to the
// bench, a child subreaper), so that killing it and reaping it frees its PID at once.
type latHost struct {
	python, sock, dir string
	pid               int
	// netns, when not nil, is the network namespace whose abstract socket sock is (a
	// container's: bench rl's podman baseline); else the bench's own.
	netns *os.File
}

// dial connects to the python's socket.
func (h *latHost) dial(ctx context.Context) (conn net.Conn, err error) {
	var d net.Dialer
	if h.netns == nil {
		return d.DialContext(ctx, "unix", "@"+h.sock)
	}
	err = netns.In(int(h.netns.Fd()), func() (err error) {
		conn, err = d.DialContext(ctx, "unix", "@"+h.sock)
		return err
	})
	return conn, err
}

// latCallTimeout bounds a call into the host python, which answers within a second here
// (building a 50 MiB heap is the longest); its process is not waited for otherwise.
const latCallTimeout = 2 * time.Minute

func (h *latHost) start(ctx context.Context) error {
	// Not waited for: it serves until kill. Its calls have deadlines (call).
	cmd := exec.Command(h.python, "-c", latDriverPy, h.sock)
	cmd.Dir = h.dir
	// Own session, no terminal, stdio on /dev/null (os/exec's default): what CRIU
	// dumps without --shell-job.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return err
	}
	h.pid = cmd.Process.Pid
	cmd.Process.Release() // reaped with wait4 (kill)
	return h.waitListening(ctx, 30*time.Second)
}

// waitListening polls until the socket accepts a connection.
func (h *latHost) waitListening(ctx context.Context, max time.Duration) error {
	deadline := time.Now().Add(max)
	for {
		conn, err := h.dial(ctx)
		if err == nil {
			conn.Close() // the driver drops a connection that sends nothing
			return nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("the host python (pid %d) does not listen on @%s: %v", h.pid, h.sock, err)
		}
		time.Sleep(100 * time.Microsecond)
	}
}

// call runs code in the host python and returns the repr of its last expression.
func (h *latHost) call(ctx context.Context, code string) (string, error) {
	conn, err := h.dial(ctx)
	if err != nil {
		return "", err
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(latCallTimeout))
	msg := make([]byte, 4+len(code))
	binary.BigEndian.PutUint32(msg, uint32(len(code)))
	copy(msg[4:], code)
	if _, err := conn.Write(msg); err != nil {
		return "", err
	}
	var hdr [8]byte
	if _, err := io.ReadFull(conn, hdr[:]); err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return "", fmt.Errorf("the host python (pid %d) did not answer within %v: %w", h.pid, latCallTimeout, err)
		}
		return "", fmt.Errorf("host python: %w", err)
	}
	rc, n := binary.BigEndian.Uint32(hdr[:4]), binary.BigEndian.Uint32(hdr[4:])
	body := make([]byte, n)
	if _, err := io.ReadFull(conn, body); err != nil {
		return "", err
	}
	if rc != 0 {
		return "", fmt.Errorf("host python call failed: %s", body)
	}
	return string(body), nil
}

// kill ends the process and reaps it (its PID is free when kill returns).
func (h *latHost) kill() {
	if h.pid <= 0 {
		return
	}
	unix.Kill(h.pid, unix.SIGKILL)
	for {
		var ws unix.WaitStatus
		_, err := unix.Wait4(h.pid, &ws, 0, nil)
		if err != unix.EINTR {
			break
		}
	}
	h.pid = 0
}

// latReapOrphans reaps exited children the bench did not start itself (CRIU's restored
// tree is reparented to the bench, a child subreaper). Only called while no command of
// the bench is running.
func latReapOrphans() {
	for {
		var ws unix.WaitStatus
		pid, err := unix.Wait4(-1, &ws, unix.WNOHANG, nil)
		if pid <= 0 || err != nil {
			return
		}
	}
}

// latDirBytes is the size of the regular files under dir.
func latDirBytes(dir string) int64 {
	var n int64
	filepath.Walk(dir, func(_ string, fi os.FileInfo, err error) error {
		if err == nil && fi.Mode().IsRegular() {
			n += fi.Size()
		}
		return nil
	})
	return n
}

// latPartsP50 is the median of each named part of the samples, in milliseconds.
func latPartsP50(ss []latSample) map[string]float64 {
	by := map[string][]float64{}
	for _, s := range ss {
		for k, v := range s.parts {
			by[k] = append(by[k], v)
		}
	}
	out := map[string]float64{}
	for k, v := range by {
		out[k] = us(Summarize(v).P50)
	}
	return out
}

func latReplayed(ss []latSample) *Layers {
	var d []int
	for _, s := range ss {
		d = append(d, s.replayed)
	}
	return LayerDist(d)
}

func latBaselineRow(system, op string, mb int, ss []latSample, commands ...string) Row {
	row := Summarize(pick(ss, func(s latSample) float64 { return s.op })).Row(system, op, mb, commands...)
	row.Info = map[string]any{"parts_p50_ms": latPartsP50(ss)}
	return row
}

// criuBaseline: a python3 on the host with the same heap, dumped and restored by CRIU
// with images on tmpfs. Process state only: CRIU does not checkpoint the files.
func (r *latRun) criuBaseline(ctx context.Context) ([]Row, error) {
	o := r.o
	if !r.criu.Usable() {
		r.logf("criu: unavailable, not run: %s", r.criu.Reason)
		return UnavailableRows(SysCRIU, o.WorkspaceMB, "CRIU is unusable here: "+r.criu.Reason, "checkpoint", "restore"), nil
	}
	dir, err := os.MkdirTemp(o.TmpfsDir, "deltabox-bench-latency-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	if t := fsType(dir); t != "tmpfs" {
		r.f.Notes = append(r.f.Notes, fmt.Sprintf("criu: the images were on %s, not on tmpfs", t))
	}
	cwd := filepath.Join(dir, "cwd")
	if err := os.Mkdir(cwd, 0o700); err != nil {
		return nil, err
	}
	// The restored process is reparented to the bench, which reaps it, so that its PID
	// is free again for the next restore as soon as it is killed.
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		return nil, fmt.Errorf("become a child subreaper: %w", err)
	}
	defer unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
	h := &latHost{python: o.Python, sock: "deltabox-bench-latency-criu-" + randHex(4), dir: cwd}
	r.logf("criu: a python3 on the host with a %d MiB heap, %d dumps and %d restores (%s)", o.HeapMB, o.BaselineCheckpoints, o.BaselineRestores, o.CRIU)
	if err := h.start(ctx); err != nil {
		return nil, err
	}
	defer func() { h.kill(); latReapOrphans() }()
	if _, err := h.call(ctx, o.initCode()); err != nil {
		return nil, fmt.Errorf("build the heap: %w", err)
	}
	if out, err := h.call(ctx, fmt.Sprintf("[l for l in open('/proc/%d/status') if l.startswith('VmRSS')][0].split()[1]", h.pid)); err == nil {
		kb, _ := strconv.Atoi(latPyStr(out))
		r.logf("criu: host python rss %d MiB", kb/1024)
	}
	root := &latNode{label: "init"}
	head := root
	var kept []*latNode
	var ck, rs []latSample
	var dumpCmd, restoreCmd string
	var imageBytes int64
	for i := 1; i <= o.BaselineCheckpoints; i++ {
		s := r.nextStep(fmt.Sprintf("criu-c%03d", i))
		out, err := h.call(ctx, o.stepCode(s))
		if err != nil {
			return nil, err
		}
		img := filepath.Join(dir, fmt.Sprintf("img-%03d", i))
		if err := os.Mkdir(img, 0o700); err != nil {
			return nil, err
		}
		dump := r.criu.Dump(h.pid, img, true)
		if dumpCmd == "" {
			dumpCmd = ShellJoin(dump.Line())
		}
		t0 := time.Now()
		if err := dump.Run(ctx); err != nil {
			return nil, err
		}
		t1 := time.Now()
		if err := h.pingLabel(ctx, s.label); err != nil {
			return nil, fmt.Errorf("after dump %d: %w", i, err)
		}
		t2 := time.Now()
		ck = append(ck, latSample{op: ms(t2.Sub(t0)), parts: map[string]float64{"criu_dump": ms(t1.Sub(t0)), "exec": ms(t2.Sub(t1))}})
		n := &latNode{id: img, label: s.label, depth: i, digest: latPyStr(out), parent: head}
		n.path = append(append([]latStep(nil), head.path...), s)
		head = n
		if imageBytes == 0 {
			imageBytes = latDirBytes(img)
		}
		kept = append(kept, n)
		if len(kept) > o.CRIUKeep {
			os.RemoveAll(kept[0].id)
			kept = kept[1:]
		}
	}
	fails := 0
	for j := 1; j <= o.BaselineRestores; j++ {
		if _, err := h.call(ctx, o.stepCode(r.nextStep(fmt.Sprintf("criu-d%03d", j)))); err != nil {
			return nil, err
		}
		n := kept[r.rng.Intn(len(kept))]
		restore := r.criu.Restore(n.id)
		if restoreCmd == "" {
			restoreCmd = ShellJoin(restore.Line())
		}
		pid := h.pid
		t0 := time.Now()
		h.kill() // the live process holds the PID the images restore
		t1 := time.Now()
		if err := restore.Run(ctx); err != nil {
			return nil, err
		}
		h.pid = pid
		t2 := time.Now()
		if err := h.pingLabel(ctx, n.label); err != nil {
			return nil, fmt.Errorf("after restore %d: %w", j, err)
		}
		t3 := time.Now()
		rs = append(rs, latSample{op: ms(t3.Sub(t0)), parts: map[string]float64{"kill": ms(t1.Sub(t0)), "criu_restore": ms(t2.Sub(t1)), "exec": ms(t3.Sub(t2))}})
		if out, err := h.call(ctx, "bench_digest()"); err != nil || latPyStr(out) != n.digest {
			fails++
		}
		latReapOrphans()
	}
	if fails > 0 {
		r.f.Notes = append(r.f.Notes, fmt.Sprintf("criu: %d restores did not bring back the dumped heap", fails))
	}
	const ping = `host call "label_" on the process's unix socket (it answers)`
	// Same workload size as the other rows, but CRIU checkpoints the process only.
	rc := latBaselineRow(SysCRIU, "checkpoint", o.WorkspaceMB, ck, dumpCmd, ping)
	rc.Info["files"] = "not checkpointed (process only)"
	rc.Info["image_mb"] = us(float64(imageBytes) / (1 << 20))
	rc.Info["images_on"] = fsType(dir)
	rc.Info["criu_mode"] = string(r.criu.Mode)
	rr := latBaselineRow(SysCRIU, "restore", o.WorkspaceMB, rs, "kill(PID, SIGKILL) and wait4 (the live process holds the restored PID)", restoreCmd, ping)
	rr.Info["files"] = "not restored (process only)"
	rr.Info["images_kept"] = len(kept)
	rr.Info["criu_mode"] = string(r.criu.Mode)
	rr.Info["state_checks_failed"] = fails
	return []Row{rc, rr}, nil
}

func (h *latHost) pingLabel(ctx context.Context, label string) error {
	out, err := h.call(ctx, "label_")
	if err != nil {
		return err
	}
	if got := latPyStr(out); got != label {
		return fmt.Errorf("the host python answered label %q, want %q", got, label)
	}
	return nil
}

// copytreeBaseline: the workspace copied with cp -a --reflink=auto at each checkpoint;
// a restore copies it back and replays the node's commands in a fresh python3.
func (r *latRun) copytreeBaseline(ctx context.Context) ([]Row, error) {
	o := r.o
	host := filepath.Join(o.HostDir, "copytree")
	os.RemoveAll(host)
	if err := os.MkdirAll(host, 0o700); err != nil {
		return nil, err
	}
	defer os.RemoveAll(host)
	ws := filepath.Join(host, "WS")
	r.logf("copytree+replay: generate the same workspace on the host in %s", ws)
	if _, err := hostPy(ctx, genPy, ws, strconv.FormatInt(o.Seed, 10), strconv.Itoa(o.WorkspaceMB), strconv.Itoa(o.SmallFiles), strconv.Itoa(o.LargeFiles)); err != nil {
		return nil, err
	}
	out, err := hostPy(ctx, checksumPy, ws)
	if err != nil {
		return nil, err
	}
	var cs checksum
	if err := json.Unmarshal([]byte(out), &cs); err != nil {
		return nil, fmt.Errorf("host checksum: %v: %q", err, out)
	}
	r.ws.HostIdentical = cs.SHA256 == r.ws.SHA256
	if !r.ws.HostIdentical {
		r.f.Notes = append(r.f.Notes, fmt.Sprintf("copytree+replay: the host copy of the workspace differs from the sandbox's (%d files, %d bytes vs %d files, %d bytes)", cs.Files, cs.Bytes, r.ws.Files, r.ws.Bytes))
	}
	syncfs(host)
	files := &fsRun{o: FSOptions{Seed: o.Seed, Changes: o.Changes, LargeEvery: o.LargeEvery}, round: 1000000}
	h := &latHost{python: o.Python, sock: "deltabox-bench-latency-copytree-" + randHex(4), dir: ws}
	if err := h.start(ctx); err != nil {
		return nil, err
	}
	defer h.kill()
	if _, err := h.call(ctx, o.initCode()); err != nil {
		return nil, fmt.Errorf("build the heap: %w", err)
	}
	r.logf("copytree+replay: %d checkpoints, %d restores", o.BaselineCheckpoints, o.BaselineRestores)
	head := &latNode{label: "init"}
	var nodes []*latNode
	var ck, rs []latSample
	for i := 1; i <= o.BaselineCheckpoints; i++ {
		s := r.nextStep(fmt.Sprintf("ct-c%03d", i))
		out, err := h.call(ctx, o.stepCode(s))
		if err != nil {
			return nil, err
		}
		if err := files.change(ctx, ws, s.label); err != nil {
			return nil, err
		}
		snap := filepath.Join(host, fmt.Sprintf("SNAP_%03d", i))
		t0 := time.Now()
		if err := run(ctx, "cp", "-a", "--reflink=auto", ws, snap); err != nil {
			return nil, err
		}
		t1 := time.Now()
		if err := h.pingLabel(ctx, s.label); err != nil {
			return nil, err
		}
		t2 := time.Now()
		ck = append(ck, latSample{op: ms(t2.Sub(t0)), parts: map[string]float64{"cp": ms(t1.Sub(t0)), "exec": ms(t2.Sub(t1))}})
		n := &latNode{id: snap, label: s.label, depth: i, digest: latPyStr(out), parent: head}
		n.path = append(append([]latStep(nil), head.path...), s)
		head = n
		nodes = append(nodes, n)
	}
	fails := 0
	for j := 1; j <= o.BaselineRestores; j++ {
		s := r.nextStep(fmt.Sprintf("ct-d%03d", j))
		if _, err := h.call(ctx, o.stepCode(s)); err != nil {
			return nil, err
		}
		if err := files.change(ctx, ws, s.label); err != nil {
			return nil, err
		}
		n := nodes[r.rng.Intn(len(nodes))]
		codes := o.replayCode(n.path)
		t0 := time.Now()
		h.kill()
		if err := run(ctx, "rm", "-rf", ws); err != nil {
			return nil, err
		}
		if err := run(ctx, "cp", "-a", "--reflink=auto", n.id, ws); err != nil {
			return nil, err
		}
		t1 := time.Now()
		if err := h.start(ctx); err != nil {
			return nil, err
		}
		t2 := time.Now()
		var last string
		for _, code := range codes {
			if last, err = h.call(ctx, code); err != nil {
				return nil, fmt.Errorf("replay: %w", err)
			}
		}
		t3 := time.Now()
		rs = append(rs, latSample{op: ms(t3.Sub(t0)), replayed: len(n.path),
			parts: map[string]float64{"kill_rm_cp": ms(t1.Sub(t0)), "python_start": ms(t2.Sub(t1)), "replay": ms(t3.Sub(t2))}})
		b, _ := os.ReadFile(filepath.Join(ws, ".bench", "marker"))
		if latPyStr(last) != n.digest || string(b) != n.label {
			fails++
		}
	}
	if fails > 0 {
		r.f.Notes = append(r.f.Notes, fmt.Sprintf("copytree+replay: %d restores did not bring back the node's heap or marker", fails))
	}
	rc := latBaselineRow(SysCopytree, "checkpoint", o.WorkspaceMB, ck, "cp -a --reflink=auto WS SNAP_i", `host call "label_" on the python's unix socket (it answers)`)
	rr := latBaselineRow(SysCopytree, "restore", o.WorkspaceMB, rs, "kill(PID, SIGKILL) and wait4", "rm -rf WS", "cp -a --reflink=auto SNAP_k WS",
		"python3 -c HOST_DRIVER SOCK (cwd WS), until it listens", "host calls: the heap's first command, then bench_step(...) for each step on the node's path (the last answer ends the interval)")
	rr.Info["replayed_steps"] = latReplayed(rs)
	rr.Info["state_checks_failed"] = fails
	return []Row{rc, rr}, nil
}

// fsOnlyBaseline: a DeltaBox sandbox whose nodes hold files only (its python session
// is ended before each checkpoint); a restore starts the session again and replays.
func (r *latRun) fsOnlyBaseline(ctx context.Context) (rows []Row, err error) {
	o, c := r.o, r.c
	sb := "bench-lat-fs-" + randHex(4)
	r.logf("fs-only+replay: sandbox %s from the root node's files, %d checkpoints, %d restores", sb, o.BaselineCheckpoints, o.BaselineRestores)
	if _, err := c.Create(ctx, apitypes.CreateOptions{ID: sb, Image: o.Image, Workdir: "/workspace"}); err != nil {
		return nil, fmt.Errorf("create sandbox: %w", err)
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		if e := c.Remove(cctx, sb); e != nil {
			err = errors.Join(err, fmt.Errorf("cleanup: remove sandbox %s: %w", sb, e))
		}
	}()
	// Its nodes are children of the root node, removed with the tree.
	if res, err := c.Restore(ctx, sb, r.base.id); err != nil {
		return nil, fmt.Errorf("restore the root's files: %w", err)
	} else if res.Processes != 0 {
		return nil, fmt.Errorf("the root restored into another sandbox carried %d processes", res.Processes)
	}
	files := &fsRun{c: c, o: FSOptions{Seed: o.Seed, Changes: o.Changes, LargeEvery: o.LargeEvery}, sb: sb, round: 2000000}
	startReplay := func(path []latStep) (string, error) {
		if _, err := c.StartSession(ctx, sb, apitypes.SessionOptions{Name: latSession, Kind: apitypes.SessionPython}); err != nil {
			return "", fmt.Errorf("start the python session: %w", err)
		}
		var last string
		for _, code := range o.replayCode(path) {
			if last, err = r.run(ctx, sb, code); err != nil {
				return "", fmt.Errorf("replay: %w", err)
			}
		}
		return latPyStr(last), nil
	}
	if _, err := startReplay(nil); err != nil {
		return nil, err
	}
	var before, after apitypes.Stats
	if info, err := c.Get(ctx, sb); err == nil {
		before = info.Stats
	}
	head := &latNode{label: "init"}
	var nodes []*latNode
	var ck, rs []latSample
	fails := 0
	for i := 1; i <= o.BaselineCheckpoints; i++ {
		s := r.nextStep(fmt.Sprintf("fo-c%03d", i))
		out, err := r.run(ctx, sb, o.stepCode(s))
		if err != nil {
			return nil, err
		}
		if err := files.change(ctx, "", s.label); err != nil {
			return nil, err
		}
		path := append(append([]latStep(nil), head.path...), s)
		t0 := time.Now()
		if err := c.KillSession(ctx, sb, latSession); err != nil {
			return nil, err
		}
		res, err := c.Checkpoint(ctx, sb, s.label)
		if err != nil {
			return nil, err
		}
		t1 := time.Now()
		d, err := startReplay(path)
		if err != nil {
			return nil, err
		}
		t2 := time.Now()
		if res.Processes != 0 {
			return nil, fmt.Errorf("fs-only checkpoint %s took %d processes", s.label, res.Processes)
		}
		if d != latPyStr(out) {
			fails++
		}
		ck = append(ck, latSample{op: ms(t2.Sub(t0)), replayed: len(path), parts: map[string]float64{"kill_session_checkpoint": ms(t1.Sub(t0)), "session_replay": ms(t2.Sub(t1))}})
		n := &latNode{id: res.Node.ID, label: s.label, depth: i, digest: latPyStr(out), parent: head, path: path}
		head = n
		nodes = append(nodes, n)
	}
	for j := 1; j <= o.BaselineRestores; j++ {
		s := r.nextStep(fmt.Sprintf("fo-d%03d", j))
		if _, err := r.run(ctx, sb, o.stepCode(s)); err != nil {
			return nil, err
		}
		if err := files.change(ctx, "", s.label); err != nil {
			return nil, err
		}
		n := nodes[r.rng.Intn(len(nodes))]
		t0 := time.Now()
		res, err := c.Restore(ctx, sb, n.id)
		if err != nil {
			return nil, err
		}
		t1 := time.Now()
		d, err := startReplay(n.path)
		if err != nil {
			return nil, err
		}
		t2 := time.Now()
		if res.Processes != 0 {
			return nil, fmt.Errorf("fs-only restore to %s carried %d processes", n.id, res.Processes)
		}
		rs = append(rs, latSample{op: ms(t2.Sub(t0)), replayed: len(n.path), parts: map[string]float64{"restore": ms(t1.Sub(t0)), "session_replay": ms(t2.Sub(t1))}})
		out, err := r.run(ctx, sb, "open('/workspace/.bench/marker').read()")
		if err != nil || d != n.digest || latPyStr(out) != n.label {
			fails++
		}
	}
	if fails > 0 {
		r.f.Notes = append(r.f.Notes, fmt.Sprintf("fs-only+replay: %d replays did not rebuild the node's heap or files", fails))
	}
	if info, err := c.Get(ctx, sb); err == nil {
		after = info.Stats
	}
	const (
		start  = `client.StartSession(ctx, sandbox, {name: "py", kind: "python"}): POST /v1/sandboxes/{id}/sessions`
		replay = `client.Run(ctx, sandbox, "py", CODE) for the heap's first command, then bench_step(...) for each step on the node's path: POST /v1/sandboxes/{id}/exec {session: "py"} (the last answer ends the interval)`
	)
	rc := latBaselineRow(SysFSOnly, "checkpoint", o.WorkspaceMB, ck, `client.KillSession(ctx, sandbox, "py"): DELETE /v1/sandboxes/{id}/sessions/py`, latCkCall, start, replay)
	rc.Info["replayed_steps"] = latReplayed(ck)
	rc.Info["daemon_checkpoint_paths"] = latPathDelta(before.CheckpointPaths, after.CheckpointPaths)
	rr := latBaselineRow(SysFSOnly, "restore", o.WorkspaceMB, rs, latRsCall, start, replay)
	rr.Info["replayed_steps"] = latReplayed(rs)
	rr.Info["daemon_restore_paths"] = latPathDelta(before.RestorePaths, after.RestorePaths)
	rr.Info["state_checks_failed"] = fails
	return []Row{rc, rr}, nil
}

// ---- the CRIU comparison ----

// latRestoreRatios returns CRIU's restore p50 over DeltaBox's restore p50 (the call) and
// over its restore+exec p50 (until the restored python answers, as CRIU's row is timed).
func latRestoreRatios(rows []Row) (call, withExec float64, ok bool) {
	var crit, db, dbx float64
	for _, r := range rows {
		switch {
		case r.System == SysCRIU && r.Op == "restore":
			crit = r.P50
		case r.System == SysDeltaBox && r.Op == "restore":
			db = r.P50
		case r.System == SysDeltaBox && r.Op == "restore+exec":
			dbx = r.P50
		}
	}
	if crit == 0 || db == 0 || dbx == 0 {
		return 0, 0, false
	}
	return crit / db, crit / dbx, true
}

func (r *latRun) ratioNotes() {
	call, withExec, ok := latRestoreRatios(r.f.Results)
	if !ok {
		return
	}
	call, withExec = float64(int(call*10))/10, float64(int(withExec*10))/10
	for i := range r.f.Results {
		row := &r.f.Results[i]
		if (row.System == SysCRIU || row.System == SysDeltaBox) && row.Op == "restore" {
			row.Info["criu_restore_p50_over_deltabox_restore_p50"] = call
			row.Info["criu_restore_p50_over_deltabox_restore_exec_p50"] = withExec
		}
	}
	verdict := func(x float64) string {
		if x >= 30 {
			return "met"
		}
		return "missed"
	}
	r.f.Notes = append(r.f.Notes, fmt.Sprintf("restore at least 30x faster than CRIU's (p50): CRIU's restore (kill, criu restore -d, "+
		"the process answers) is %.1fx the deltabox restore call (%s) and %.1fx the deltabox restore+exec, timed the same way until "+
		"the restored python answers (%s). CRIU restores the process only; deltabox restores the files too.", call, verdict(call), withExec, verdict(withExec)))
}
