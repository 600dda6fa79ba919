package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/apitypes"
	"deltabox/internal/client"
	"deltabox/internal/criu"
	"deltabox/internal/deadline"
)

// `bench rl`: the RL trainer's loop the seed claims DeltaBox keeps busy. Per step the
// trainer spends PolicyMS on the "GPU" (a sleep standing for generation), then runs one
// action in each of B branches and resets each branch to the step's start state, all B
// at once. The GPU is idle during the environment's part, so its busy fraction is
// policy / (policy + environment); the rows say where each system stops keeping it
// busy. Systems:
//
//   - deltabox-fork: each step forks B sandboxes from the step's node (processes
//     included: a CRIU restore of the node's durable image per branch), acts in each
//     and removes them: the RL step that starts every rollout from one state.
//   - deltabox: B sandboxes, each with a python session holding the heap, on its own
//     node; the action is a session call and a file write, the reset a restore of the
//     branch's node (the fast path: templates forked back).
//   - deltabox-spares: one sandbox with the heap, forked into B branches (a fast fork's
//     family); the reset is a restore of the fork's node in each branch, which swaps
//     in a spare made ahead (docs/design/spares.md) when one is ready, else forks the
//     family's templates (and makes the branch's next spare, in the background).
//   - criu: B python3 processes on the host with the same heap, each dumped once by
//     CRIU (images on tmpfs); the reset kills the process and restores its image.
//     Process state only: CRIU does not reset files (favours it).
//   - copytree+replay: B workspaces and python3 processes on the host; the reset copies
//     the workspace back (cp -a --reflink=auto) and starts a fresh python3 that rebuilds
//     the heap (the replay).
//   - podman: B containers of the image with the same python, each exported once by
//     podman container checkpoint; the reset removes the container and restores the
//     archive (rl_podman.go). Process and files, as deltabox.
const (
	SysRLDeltaBox = "deltabox"
	SysRLCRIU     = "criu"
	SysRLCopytree = "copytree+replay"
	// SysRLFork: each step forks B new sandboxes from the step's node (POST
	// /v1/nodes/ID/fork, processes included), acts in each, and removes them.
	SysRLFork = "deltabox-fork"
	// SysRLPodman: a container per branch, reset by podman container restore --import.
	SysRLPodman = "podman"
	// SysRLSpares: B branches of one fast fork, reset by restoring the fork's node: from
	// a spare when one is ready.
	SysRLSpares = "deltabox-spares"
)

// RLOptions are `bench rl`'s settings.
type RLOptions struct {
	Branches    []int    `json:"branches"`  // B points
	PolicyMS    int      `json:"policy_ms"` // simulated generation per step
	Steps       int      `json:"steps"`     // timed steps per point
	HeapMB      int      `json:"heap_mb"`   // each branch's python heap
	WorkspaceMB int      `json:"workspace_mb"`
	Systems     []string `json:"systems"`
	Seed        int64    `json:"seed"`
	Image       string   `json:"image"`
	Python      string   `json:"python"`    // host python3 (baselines)
	CRIU        string   `json:"criu"`      // criu binary ("": the runner's default)
	TmpfsDir    string   `json:"tmpfs_dir"` // CRIU images
	HostDir     string   `json:"host_dir"`  // copytree's workspaces and podman's archives
	Root        string   `json:"-"`         // the store, whose images/<image>/rootfs podman imports
	// Modes are the trainer's loops measured (rlSerial, rlOverlap), each at every point.
	Modes []string `json:"modes"`
	// Socket is the daemon's socket: its peer's PID is the daemon whose CPU the rows
	// report ("": not reported).
	Socket string `json:"-"`

	Notes   []string  `json:"-"`
	Command string    `json:"-"`
	Log     io.Writer `json:"-"`
}

// DefaultRLOptions are the points (B = 8, 32, 64 at 500 ms of policy).
func DefaultRLOptions() RLOptions {
	return RLOptions{Branches: []int{8, 32, 64}, PolicyMS: 500, Steps: 5, HeapMB: 50, WorkspaceMB: 10,
		Systems: []string{SysRLDeltaBox, SysRLSpares, SysRLFork, SysRLCRIU, SysRLCopytree, SysRLPodman}, Seed: 1, Image: "default", Python: "python3",
		TmpfsDir: "/dev/shm", HostDir: "/var/tmp", Modes: []string{rlSerial}}
}

// Validate checks the options.
func (o RLOptions) Validate() error {
	if len(o.Branches) == 0 || o.Steps < 1 || o.PolicyMS < 0 || o.HeapMB < 1 || o.WorkspaceMB < 1 {
		return fmt.Errorf("want branches, steps >= 1, policy-ms >= 0, heap-mb and workspace-mb >= 1")
	}
	for _, b := range o.Branches {
		if b < 1 || b > 256 {
			return fmt.Errorf("branches %d: want 1-256", b)
		}
	}
	if len(o.Modes) == 0 {
		return fmt.Errorf("want a mode: %s or %s", rlSerial, rlOverlap)
	}
	for _, m := range o.Modes {
		if m != rlSerial && m != rlOverlap {
			return fmt.Errorf("mode %q: want %s or %s", m, rlSerial, rlOverlap)
		}
	}
	for _, s := range o.Systems {
		if s != SysRLDeltaBox && s != SysRLSpares && s != SysRLCRIU && s != SysRLCopytree && s != SysRLFork && s != SysRLPodman {
			return fmt.Errorf("system %q: want %s, %s, %s, %s, %s or %s", s, SysRLDeltaBox, SysRLSpares, SysRLFork, SysRLCRIU, SysRLCopytree, SysRLPodman)
		}
	}
	return nil
}

// rlBusyTarget is the bar: the GPU busy at least 95% of the time.
const rlBusyTarget = 0.95

// rlBranch is one branch of one system: its action and its reset, and the check that
// the reset brought back the step's start state.
type rlBranch interface {
	act(ctx context.Context, step int) (rlActStat, error)
	reset(ctx context.Context) error
	digest(ctx context.Context) (string, error)
	close()
}

type rlRun struct {
	o     RLOptions
	c     *client.Client
	f     *File
	start time.Time
	criu  *criu.Runner
	// podman's CLI and the image's tag in it, or why it cannot run here.
	podman               podmanCLI
	podmanTag, podmanWhy string
	// podmanPrefix starts the name of every container of this run (the podman rows'
	// "containers"): what the run must leave none of.
	podmanPrefix string
	// resets and fromSpare count the deltabox systems' resets of the point running, and
	// those served by a spare (restore answers' from_spare).
	resets, fromSpare atomic.Int64
	// daemonPid is the daemon's (the socket's peer), whose CPU the rows report; 0: unknown.
	daemonPid int
}

func (r *rlRun) logf(format string, a ...any) { progress(r.o.Log, r.start, format, a...) }

func (o RLOptions) initCode() string {
	return latHeapPy + fmt.Sprintf("bench_init(%d, %d, %d)", o.Seed, o.HeapMB, 1<<20)
}

// rlActCode is the action: 1 MiB of the heap rewritten (and, where files are reset, a
// file of the workspace written). No digest: the check after a reset computes it. Its
// last expression is what the python measured of the action's code itself, its CPU
// (thread_time) and wall time in ns (rlActStat): the rest of the call's time is the
// way in and out (for deltabox, the session call through the daemon).
func rlActCode(step int, files bool) string {
	code := fmt.Sprintf("H[%d %% len(H)] = random.Random(%d).randbytes(1 << 20); label_ = 'act-%d'", step, step, step)
	if files {
		code = fmt.Sprintf("open('action.txt', 'w').write('step %d'); ", step) + code
	}
	return "import time as rlt_; rlc_, rlw_ = rlt_.thread_time_ns(), rlt_.perf_counter_ns(); " + code +
		"; (rlt_.thread_time_ns() - rlc_, rlt_.perf_counter_ns() - rlw_)"
}

// rlActStat is what an action's python measured of its code (rlActCode): CPU and wall.
type rlActStat struct{ cpu, wall time.Duration }

// parseActStat reads rlActCode's last expression, "(CPU_NS, WALL_NS)", from a call's output.
func parseActStat(out string) (rlActStat, error) {
	lines := strings.Split(strings.TrimSpace(out), "\n")
	var c, w int64
	if _, err := fmt.Sscanf(strings.TrimSpace(lines[len(lines)-1]), "(%d, %d)", &c, &w); err != nil {
		return rlActStat{}, fmt.Errorf("the action's answer %q has no (cpu_ns, wall_ns): %w", out, err)
	}
	return rlActStat{cpu: time.Duration(c), wall: time.Duration(w)}, nil
}

// RunRL runs the bench.
func RunRL(ctx context.Context, c *client.Client, o RLOptions) (f *File, err error) {
	start := time.Now()
	f = &File{Bench: "rl", Command: o.Command, Machine: CurrentMachine(), Started: start.UTC()}
	if err := o.Validate(); err != nil {
		return f, err
	}
	f.Notes = append(f.Notes, o.Notes...)
	settings, _ := json.Marshal(o)
	json.Unmarshal(settings, &f.Settings)
	defer func() {
		f.Finished = time.Now().UTC()
		f.DurationS = float64(int(time.Since(start).Seconds()*10)) / 10
		f.Machine.LoadAvgEnd = LoadAvg()
	}()
	r := &rlRun{o: o, c: c, f: f, start: start}
	f.Description = fmt.Sprintf("The RL trainer's loop (issue 26): per step, %d ms of simulated policy (a sleep standing for the GPU's "+
		"generation), then one action in each of B branches (1 MiB of a %d MiB python heap rewritten, a file written) and a reset of each branch "+
		"to the step's start state, the B branches at once. `gpu_busy_frac` = policy time / wall time over %d timed steps (after one untimed); "+
		"rows are the step's wall time (policy and environment). `deltabox`: a sandbox per branch, a python session, reset by restoring the branch's node. "+
		"`deltabox-spares`: one sandbox with the heap forked into B branches, reset by restoring the fork's node, from a spare made ahead "+
		"when one is ready (`spare_share`: the resets served by one, the untimed first step's included; each branch holds one before it). `criu`: a "+
		"python3 per branch on the host, dumped once, reset by kill and `criu restore` (process only: files are not reset). "+
		"`deltabox-fork`: each step forks B sandboxes from one node (processes included) and acts in each. `copytree+replay`: a %d MiB workspace and a python3 per branch on the host, reset by copying the workspace back and rebuilding the "+
		"heap in a fresh python3. `podman`: a container per branch with the same python, exported once by `podman container checkpoint`, "+
		"reset by `podman rm -f` and `podman container restore --import` (process and files). Modes (`mode`, op rl-B or rl-B-overlap): "+
		"`serial`, the step as above, its resets in its time; `overlap`, a pipelined trainer: each branch's reset starts after its action and runs "+
		"during the next step's policy (the reset's target is known before the policy runs), the next action of a branch waits for its own reset if "+
		"not done by then (`reset_wait_ms`, `resets_late`); deltabox-fork forks the step's branches during its policy. Every system in both modes. "+
		"The action's own cost: `action_py_cpu_ms` and `action_py_ms` are the CPU and wall time the python measured of the action's code "+
		"(thread_time, perf_counter), `action_call_ms` the rest of the caller's `action_ms` (the call's way in and out: for deltabox the session call "+
		"through the daemon, for the host baselines a unix socket); per timed step `actions_py_cpu_ms_per_step` sums the B actions' python CPU, "+
		"`daemon_cpu_ms_per_step` is the daemon process's CPU (every thread, background work included) and `machine_cpu_ms_per_step` every CPU's "+
		"non-idle time (other work on the machine included), over `cpus` CPUs; `env_floor_ms` is the B actions' python CPU over `cpus`, the least "+
		"the environment's part can take, and `gpu_busy_bound_frac` the GPU's busy fraction with it: what no system can pass here. "+
		"Target: deltabox keeps the GPU >= %.0f%% busy at B = 64 with 500 ms of policy.",
		o.PolicyMS, o.HeapMB, o.Steps, o.WorkspaceMB, rlBusyTarget*100)
	if has(o.Systems, SysRLCRIU) {
		r.criu = criu.Probe(ctx, o.CRIU)
		f.Machine.CRIU = r.criu
		f.Notes = append(f.Notes, "criu: "+criuNote(r.criu))
	}
	r.podmanPrefix = "deltabox-bench-rl-" + randHex(3) + "-"
	if has(o.Systems, SysRLPodman) {
		if r.podman, r.podmanWhy = newPodmanCLI(); r.podmanWhy == "" {
			r.podmanTag, r.podmanWhy = r.podman.image(ctx, o.Root, o.Image, r.logf)
		}
	}
	if o.Socket != "" {
		if r.daemonPid, err = peerPid(o.Socket); err != nil {
			f.Notes = append(f.Notes, "the daemon's CPU is not reported: "+err.Error())
		}
	}
	for _, sys := range o.Systems {
		for _, b := range o.Branches {
			for _, mode := range o.Modes {
				row, err := r.point(ctx, sys, b, mode)
				if err != nil {
					return f, fmt.Errorf("%s, B=%d, %s: %w", sys, b, mode, err)
				}
				f.Results = append(f.Results, row)
			}
		}
	}
	f.Notes = append(f.Notes, r.where()...)
	return f, nil
}

func has(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// point sets up b branches of sys (untimed), runs one untimed and o.Steps timed steps
// in mode (rlSerial or rlOverlap), and returns the row.
func (r *rlRun) point(ctx context.Context, sys string, b int, mode string) (Row, error) {
	op := rlOp(b, mode)
	if sys == SysRLFork {
		return r.forkPoint(ctx, b, mode)
	}
	if sys == SysRLCRIU && !r.criu.Usable() {
		return UnavailableRows(sys, 0, "CRIU is unusable here: "+r.criu.Reason, op)[0], nil
	}
	if sys == SysRLPodman && r.podmanWhy != "" {
		return UnavailableRows(sys, 0, r.podmanWhy, op)[0], nil
	}
	r.logf("%s (%s): setting up %d branches", sys, mode, b)
	r.resets.Store(0)
	r.fromSpare.Store(0)
	t0 := time.Now()
	branches, cmds, cleanup, err := r.setup(ctx, sys, b)
	defer func() {
		for _, br := range branches {
			br.close()
		}
		if cleanup != nil {
			cleanup()
		}
		if sys == SysRLCRIU {
			latReapOrphans()
		}
	}()
	if err != nil {
		return Row{}, err
	}
	want, err := branches[0].digest(ctx)
	if err != nil {
		return Row{}, err
	}
	r.logf("%s (%s): %d branches ready in %.1f s", sys, mode, b, time.Since(t0).Seconds())
	st := &rlStats{}
	if mode == rlOverlap {
		err = r.overlapSteps(ctx, sys, branches, want, st)
	} else {
		err = r.serialSteps(ctx, sys, branches, want, st)
	}
	if err != nil {
		return Row{}, err
	}
	row := Summarize(st.steps).Row(sys, op, r.o.WorkspaceMB, cmds...)
	row.Info = st.info(r, b, mode)
	row.Info["reset_ms_p50"], row.Info["reset_ms_p95"] = us(Summarize(st.resets).P50), us(Summarize(st.resets).P95)
	if mode == rlOverlap {
		row.Info["reset_wait_ms_p50"], row.Info["reset_wait_ms_p95"] = us(Summarize(st.waits).P50), us(Summarize(st.waits).P95)
		late := 0
		for _, w := range st.waits {
			if w > 0 {
				late++
			}
		}
		row.Info["resets_late"] = late
	}
	if sys == SysRLCRIU {
		row.Info["files"] = "not reset (process only)"
	}
	if sys == SysRLDeltaBox || sys == SysRLSpares {
		// Every reset, the untimed first step's included.
		n := r.resets.Load()
		row.Info["resets"], row.Info["resets_from_spare"] = n, r.fromSpare.Load()
		if n > 0 {
			row.Info["spare_share"] = round3(float64(r.fromSpare.Load()) / float64(n))
		}
	}
	if sys == SysRLPodman {
		row.Info["containers"] = r.podmanPrefix + "*"
	}
	r.logf("%s (%s): B=%d: step p50 %.1f ms, environment p50 %.1f ms, GPU busy %.1f%%", sys, mode, b, us(Summarize(st.steps).P50),
		us(Summarize(st.envs).P50), row.Info["gpu_busy_frac"].(float64)*100)
	return row, nil
}

// The trainer's modes. rlSerial: the policy, then every branch's action and reset, in
// series (the step waits for its resets). rlOverlap: a branch's reset starts as soon as
// its action is done and runs during the next step's policy (the reset's target, the
// step's start state, is known before the policy runs: a pipelined trainer's
// generation and environment overlap so); the next action of a branch waits only for
// its own reset, if not done by the policy's end.
const (
	rlSerial  = "serial"
	rlOverlap = "overlap"
)

// rlOp is a row's op: rl-B (the serial mode, the rows) or rl-B-overlap.
func rlOp(b int, mode string) string {
	if mode == rlOverlap {
		return fmt.Sprintf("rl-%d-overlap", b)
	}
	return fmt.Sprintf("rl-%d", b)
}

// rlStats are a point's timed steps' samples (ms).
type rlStats struct {
	steps, envs []float64
	// acts are the actions' wall times at the caller; pyCPU and pyWall what the python
	// measured of the action's code (rlActStat); calls the difference acts - pyWall,
	// the call's way in and out.
	acts, pyCPU, pyWall, calls []float64
	// resets are the resets' own times; waits (overlap) how long an action waited for
	// its branch's reset after the policy (0: it was done).
	resets, waits []float64
	policy, wall  time.Duration
	checks, fails int
	cpu           rlCPU // over the timed steps
	mu            sync.Mutex
}

// action records one action of a timed step.
func (st *rlStats) action(took time.Duration, a rlActStat) {
	st.mu.Lock()
	defer st.mu.Unlock()
	st.acts = append(st.acts, ms(took))
	st.pyCPU = append(st.pyCPU, ms(a.cpu))
	st.pyWall = append(st.pyWall, ms(a.wall))
	st.calls = append(st.calls, ms(took-a.wall))
}

func (st *rlStats) add(xs *[]float64, d time.Duration) {
	st.mu.Lock()
	*xs = append(*xs, ms(d))
	st.mu.Unlock()
}

// step records a timed step: started at s0, policy until e0, done at end; c0 the CPU
// counters at s0.
func (st *rlStats) step(r *rlRun, s0, e0, end time.Time, c0 rlCPU) {
	st.steps = append(st.steps, ms(end.Sub(s0)))
	st.envs = append(st.envs, ms(end.Sub(e0)))
	st.policy += e0.Sub(s0)
	st.wall += end.Sub(s0)
	st.cpu = st.cpu.plus(r.cpuNow().minus(c0))
}

// info is the row's common Info: the GPU's busy fraction, the step's parts, and where
// the CPU went per step (the actions' python, the daemon, the machine).
func (st *rlStats) info(r *rlRun, b int, mode string) map[string]any {
	n := float64(len(st.steps))
	sum := 0.0
	for _, x := range st.pyCPU {
		sum += x
	}
	info := map[string]any{"mode": mode, "gpu_busy_frac": round3(float64(st.policy) / float64(st.wall)), "step_ms": us(Summarize(st.steps).P50),
		"env_ms_p50": us(Summarize(st.envs).P50), "env_ms_p95": us(Summarize(st.envs).P95), "policy_ms": r.o.PolicyMS, "branches": b,
		"state_checks": st.checks, "state_checks_failed": st.fails, "cpus": runtime.NumCPU()}
	if len(st.acts) > 0 {
		info["action_ms_p50"], info["action_ms_p95"] = us(Summarize(st.acts).P50), us(Summarize(st.acts).P95)
		info["action_py_cpu_ms_p50"], info["action_py_ms_p50"] = us(Summarize(st.pyCPU).P50), us(Summarize(st.pyWall).P50)
		info["action_call_ms_p50"] = us(Summarize(st.calls).P50)
		info["actions_py_cpu_ms_per_step"] = us(sum / n)
		// The bound any system has here: the step's actions' own python CPU spread over
		// every CPU is the least an environment part can take (nothing else costing).
		floor := sum / n / float64(runtime.NumCPU())
		info["env_floor_ms"] = us(floor)
		info["gpu_busy_bound_frac"] = round3(float64(r.o.PolicyMS) / (float64(r.o.PolicyMS) + floor))
	}
	info["machine_cpu_ms_per_step"] = us(ms(st.cpu.machine) / n)
	if r.daemonPid > 0 {
		info["daemon_cpu_ms_per_step"] = us(ms(st.cpu.daemon) / n)
	}
	return info
}

// serialSteps runs the serial mode's steps: the policy, then the B branches' action and
// reset at once; the step ends when every reset is done.
func (r *rlRun) serialSteps(ctx context.Context, sys string, branches []rlBranch, want string, st *rlStats) error {
	for i := 0; i <= r.o.Steps; i++ {
		s0, c0 := time.Now(), r.cpuNow()
		time.Sleep(time.Duration(r.o.PolicyMS) * time.Millisecond) // the GPU's generation
		e0 := time.Now()
		errs := make([]error, len(branches))
		var wg sync.WaitGroup
		for j, br := range branches {
			wg.Add(1)
			go func() {
				defer wg.Done()
				a0 := time.Now()
				a, err := br.act(ctx, i)
				if err != nil {
					errs[j] = fmt.Errorf("branch %d: action: %w", j, err)
					return
				}
				a1 := time.Now()
				if err := br.reset(ctx); err != nil {
					errs[j] = fmt.Errorf("branch %d: reset: %w", j, err)
				}
				if i > 0 {
					st.action(a1.Sub(a0), a)
					st.add(&st.resets, time.Since(a1))
				}
			}()
		}
		wg.Wait()
		end := time.Now()
		if err := errors.Join(errs...); err != nil {
			return err
		}
		if sys == SysRLCRIU {
			latReapOrphans()
		}
		// Untimed: the reset brought back the step's start state (one branch per step).
		st.check(ctx, branches[i%len(branches)], want)
		if i > 0 {
			st.step(r, s0, e0, end, c0)
		}
	}
	return nil
}

// check compares br's state with want (untimed).
func (st *rlStats) check(ctx context.Context, br rlBranch, want string) {
	st.checks++
	if got, err := br.digest(ctx); err != nil || got != want {
		st.fails++
	}
}

// overlapSteps runs the overlapped mode's steps (rlOverlap): each branch's reset starts
// after its action and runs during the next step's policy; a branch's next action
// waits for it. After the last step every branch's state is checked (untimed): a check
// per step would wait for a reset in the step's time.
func (r *rlRun) overlapSteps(ctx context.Context, sys string, branches []rlBranch, want string, st *rlStats) error {
	pending := make([]chan error, len(branches)) // branch j's reset in flight, written by j's goroutine only
	wait := func() error {
		var errs []error
		for j, ch := range pending {
			if ch != nil {
				if err := <-ch; err != nil {
					errs = append(errs, fmt.Errorf("branch %d: reset: %w", j, err))
				}
				pending[j] = nil
			}
		}
		return errors.Join(errs...)
	}
	defer wait() // the branches are closed only once no reset runs in them
	for i := 0; i <= r.o.Steps; i++ {
		s0, c0 := time.Now(), r.cpuNow()
		time.Sleep(time.Duration(r.o.PolicyMS) * time.Millisecond) // the GPU's generation, the resets beside it
		e0 := time.Now()
		errs := make([]error, len(branches))
		var wg sync.WaitGroup
		for j, br := range branches {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if ch := pending[j]; ch != nil {
					pending[j] = nil
					select {
					case err := <-ch:
						if err != nil {
							errs[j] = fmt.Errorf("branch %d: reset: %w", j, err)
							return
						}
						if i > 0 {
							st.add(&st.waits, 0)
						}
					default:
						err := <-ch
						if i > 0 {
							st.add(&st.waits, time.Since(e0))
						}
						if err != nil {
							errs[j] = fmt.Errorf("branch %d: reset: %w", j, err)
							return
						}
					}
				}
				a0 := time.Now()
				a, err := br.act(ctx, i)
				if err != nil {
					errs[j] = fmt.Errorf("branch %d: action: %w", j, err)
					return
				}
				took := time.Since(a0)
				if i > 0 {
					st.action(took, a)
				}
				ch := make(chan error, 1)
				pending[j] = ch
				go func() {
					r0 := time.Now()
					err := br.reset(ctx)
					if i > 0 {
						st.add(&st.resets, time.Since(r0))
					}
					ch <- err
				}()
			}()
		}
		wg.Wait()
		end := time.Now()
		if err := errors.Join(errs...); err != nil {
			return err
		}
		if i > 0 {
			st.step(r, s0, e0, end, c0)
		}
	}
	if err := wait(); err != nil {
		return err
	}
	if sys == SysRLCRIU {
		latReapOrphans()
	}
	for _, br := range branches {
		st.check(ctx, br, want)
	}
	return nil
}

func round3(x float64) float64 { return float64(int(x*1000+0.5)) / 1000 }

// where says, per system and mode, the largest B that kept the GPU at the target.
func (r *rlRun) where() []string {
	best := map[string]int{}
	seen := map[string]bool{}
	for _, row := range r.f.Results {
		b, _ := row.Info["branches"].(int)
		busy, ok := row.Info["gpu_busy_frac"].(float64)
		if !ok {
			continue
		}
		mode, _ := row.Info["mode"].(string)
		k := row.System + " (" + mode + ")"
		seen[k] = true
		if busy >= rlBusyTarget && b > best[k] {
			best[k] = b
		}
	}
	var out []string
	for _, sys := range r.o.Systems {
		for _, mode := range r.o.Modes {
			k := sys + " (" + mode + ")"
			switch {
			case !seen[k]:
			case best[k] == 0:
				out = append(out, fmt.Sprintf("%s: below %.0f%% GPU busy at every B measured", k, rlBusyTarget*100))
			default:
				out = append(out, fmt.Sprintf("%s: keeps the GPU >= %.0f%% busy up to B = %d of those measured", k, rlBusyTarget*100, best[k]))
			}
		}
	}
	return out
}

// rlCPU is CPU time: the daemon's (its process's, every thread) and the machine's (every
// CPU's non-idle time: other work on the machine included).
type rlCPU struct{ daemon, machine time.Duration }

func (a rlCPU) plus(b rlCPU) rlCPU  { return rlCPU{a.daemon + b.daemon, a.machine + b.machine} }
func (a rlCPU) minus(b rlCPU) rlCPU { return rlCPU{a.daemon - b.daemon, a.machine - b.machine} }

// clockTick is USER_HZ, the unit of /proc's CPU times: 100 on every Linux architecture
// this runs on (sysconf(_SC_CLK_TCK), which Go does not expose).
const clockTick = 10 * time.Millisecond

// cpuNow reads the CPU counters (a counter it cannot read is 0 in both readings).
func (r *rlRun) cpuNow() rlCPU {
	var c rlCPU
	if b, err := os.ReadFile("/proc/stat"); err == nil {
		line, _, _ := strings.Cut(string(b), "\n")
		f := strings.Fields(line) // cpu user nice system idle iowait irq softirq steal ...
		for i := 1; i < len(f) && i <= 8; i++ {
			if i == 4 || i == 5 {
				continue // idle, iowait
			}
			n, _ := strconv.ParseInt(f[i], 10, 64)
			c.machine += time.Duration(n) * clockTick
		}
	}
	if r.daemonPid > 0 {
		if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", r.daemonPid)); err == nil {
			// After the comm's ")": state is field 3, utime 14 and stime 15.
			if i := strings.LastIndexByte(string(b), ')'); i > 0 {
				f := strings.Fields(string(b[i+1:]))
				if len(f) > 12 {
					u, _ := strconv.ParseInt(f[11], 10, 64)
					s, _ := strconv.ParseInt(f[12], 10, 64)
					c.daemon = time.Duration(u+s) * clockTick
				}
			}
		}
	}
	return c
}

// peerPid is the PID of the process serving the unix socket at path (SO_PEERCRED).
func peerPid(path string) (int, error) {
	conn, err := net.DialTimeout("unix", path, 10*time.Second)
	if err != nil {
		return 0, fmt.Errorf("connect to %s: %w", path, err)
	}
	defer conn.Close()
	raw, err := conn.(*net.UnixConn).SyscallConn()
	if err != nil {
		return 0, err
	}
	var cred *unix.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) { cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED) }); err != nil {
		return 0, err
	}
	if cerr != nil {
		return 0, fmt.Errorf("SO_PEERCRED on %s: %w", path, cerr)
	}
	return int(cred.Pid), nil
}

// setup makes b branches of sys, each at the step's start state; cleanup (if not nil)
// removes what the branches' close leaves, once they are closed.
func (r *rlRun) setup(ctx context.Context, sys string, b int) (brs []rlBranch, cmds []string, cleanup func(), err error) {
	switch sys {
	case SysRLDeltaBox:
		return r.setupDeltaBox(ctx, b)
	case SysRLSpares:
		return r.setupSpares(ctx, b)
	case SysRLPodman:
		return r.setupPodman(ctx, b)
	case SysRLCRIU:
		brs, cmds, err = r.setupCRIU(ctx, b)
	default:
		brs, cmds, err = r.setupCopytree(ctx, b)
	}
	return brs, cmds, nil, err
}

// ---- deltabox ----

type rlSandbox struct {
	c        *client.Client
	id, node string
	r        *rlRun // counts the resets and those from spares
}

func (s *rlSandbox) act(ctx context.Context, step int) (rlActStat, error) {
	res, err := s.c.Run(ctx, s.id, "py", rlActCode(step, true), time.Minute)
	if err != nil {
		return rlActStat{}, err
	}
	if res.ExitCode != 0 {
		return rlActStat{}, fmt.Errorf("the action failed: %s", strings.TrimSpace(res.Stdout+res.Stderr))
	}
	return parseActStat(res.Stdout)
}

func (s *rlSandbox) reset(ctx context.Context) error {
	res, err := s.c.Restore(ctx, s.id, s.node)
	if err == nil {
		s.r.resets.Add(1)
		if res.FromSpare {
			s.r.fromSpare.Add(1)
		}
	}
	return err
}

func (s *rlSandbox) digest(ctx context.Context) (string, error) {
	res, err := s.c.Run(ctx, s.id, "py", "print(bench_digest(), open('action.txt').read() if __import__('os').path.exists('action.txt') else '-')", time.Minute)
	if err != nil {
		return "", err
	}
	return strings.TrimSpace(res.Stdout), nil
}

func (s *rlSandbox) close() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s.c.Remove(ctx, s.id)
}

// setupDeltaBox: a base sandbox with the workspace (removed with its node once the
// branches stand on their own), then per branch a sandbox on the base's files, a python
// session building the heap, and the branch's node.
func (r *rlRun) setupDeltaBox(ctx context.Context, b int) ([]rlBranch, []string, func(), error) {
	base := "bench-rl-base-" + randHex(4)
	if _, err := r.c.Create(ctx, apitypes.CreateOptions{ID: base, Image: r.o.Image, Workdir: "/workspace"}); err != nil {
		return nil, nil, nil, err
	}
	var baseNode string
	// The base's node (and under it every branch's) goes once the branches are removed.
	cleanup := func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		r.c.Remove(ctx, base)
		if baseNode != "" {
			r.c.RemoveNode(ctx, baseNode)
		}
	}
	if err := r.genWorkspace(ctx, base); err != nil {
		return nil, nil, cleanup, err
	}
	ck, err := r.c.Checkpoint(ctx, base, "rl-base")
	if err != nil {
		return nil, nil, cleanup, err
	}
	baseNode = ck.Node.ID
	out, cmds, err := r.branchesDeltaBox(ctx, b, baseNode)
	return out, cmds, cleanup, err
}

func (r *rlRun) branchesDeltaBox(ctx context.Context, b int, baseNode string) ([]rlBranch, []string, error) {
	var out []rlBranch
	for i := 0; i < b; i++ {
		s := &rlSandbox{c: r.c, id: fmt.Sprintf("bench-rl-%s-%d", randHex(3), i), r: r}
		if _, err := r.c.Create(ctx, apitypes.CreateOptions{ID: s.id, Image: r.o.Image, Workdir: "/workspace", MemoryMB: int64(r.o.HeapMB)*3 + 256}); err != nil {
			return out, nil, err
		}
		out = append(out, s)
		if _, err := r.c.Restore(ctx, s.id, baseNode); err != nil {
			return out, nil, err
		}
		if err := r.startHeap(ctx, s.id); err != nil {
			return out, nil, err
		}
		n, err := r.c.Checkpoint(ctx, s.id, "rl-start")
		if err != nil {
			return out, nil, err
		}
		s.node = n.Node.ID
	}
	return out, []string{"POST /v1/sandboxes/ID/sessions/py/run (the action)", "POST /v1/sandboxes/ID/restore {node: the branch's start} (the reset)"}, nil
}

// setupSpares: a sandbox with the workspace and the heap, forked into b branches (one
// request: POST /v1/sandboxes/{id}/fork); each branch's start state is the fork's
// node, made before the fork, whose templates are the family's holder's, and each
// holds a spare of it before the first step (POST /v1/nodes/{id}/prepare, untimed);
// after each reset the branch makes its next spare in the background.
func (r *rlRun) setupSpares(ctx context.Context, b int) ([]rlBranch, []string, func(), error) {
	src := "bench-rl-src-" + randHex(4)
	mem := int64(r.o.HeapMB)*3 + 256
	if _, err := r.c.Create(ctx, apitypes.CreateOptions{ID: src, Image: r.o.Image, Workdir: "/workspace", MemoryMB: mem}); err != nil {
		return nil, nil, nil, err
	}
	var node string
	cleanup := func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		r.c.Remove(ctx, src)
		if node != "" {
			r.c.RemoveNode(ctx, node)
		}
	}
	if err := r.genWorkspace(ctx, src); err != nil {
		return nil, nil, cleanup, err
	}
	if err := r.startHeap(ctx, src); err != nil {
		return nil, nil, cleanup, err
	}
	res, err := r.c.ForkSandbox(ctx, src, apitypes.SandboxForkRequest{ForkRequest: apitypes.ForkRequest{Count: b,
		CreateOptions: apitypes.CreateOptions{ID: "bench-rl-" + randHex(3), MemoryMB: mem}}})
	if err != nil {
		return nil, nil, cleanup, fmt.Errorf("fork %s into %d branches: %w", src, b, err)
	}
	node = res.Node
	var out []rlBranch
	for _, br := range res.Branches {
		out = append(out, &rlSandbox{c: r.c, id: br.Sandbox.ID, node: node, r: r})
		if br.Path != "fast" {
			return out, nil, cleanup, fmt.Errorf("branch %s took the %s path (%s): no spares without the fast path", br.Sandbox.ID, br.Path, br.Reason)
		}
	}
	for _, br := range res.Branches {
		if _, err := r.c.PrepareNode(ctx, node, br.Sandbox.ID); err != nil {
			return out, nil, cleanup, fmt.Errorf("prepare %s for %s: %w", node, br.Sandbox.ID, err)
		}
	}
	return out, []string{"POST /v1/sandboxes/ID/sessions/py/run (the action)", "POST /v1/sandboxes/ID/restore {node: the fork's node} (the reset: a spare swapped in when ready)"}, cleanup, nil
}

// ---- criu ----

type rlCRIU struct {
	h   *latHost
	img string
	run *criu.Runner
}

func (b *rlCRIU) act(ctx context.Context, step int) (rlActStat, error) {
	return b.h.act(ctx, rlActCode(step, false))
}

func (b *rlCRIU) reset(ctx context.Context) error {
	pid := b.h.pid
	b.h.kill() // the live process holds the PID its image restores
	if err := b.run.Restore(b.img).Run(ctx); err != nil {
		return err
	}
	b.h.pid = pid
	return nil
}

func (b *rlCRIU) digest(ctx context.Context) (string, error) {
	out, err := b.h.call(ctx, "bench_digest()")
	return latPyStr(out), err
}

func (b *rlCRIU) close() {
	b.h.kill()
	os.RemoveAll(filepath.Dir(b.img))
}

func (r *rlRun) setupCRIU(ctx context.Context, b int) ([]rlBranch, []string, error) {
	// Restored processes are reparented to the bench, which reaps them.
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		return nil, nil, fmt.Errorf("become a child subreaper: %w", err)
	}
	var out []rlBranch
	var line string
	for i := 0; i < b; i++ {
		dir, err := os.MkdirTemp(r.o.TmpfsDir, "deltabox-bench-rl-")
		if err != nil {
			return out, nil, err
		}
		cwd, img := filepath.Join(dir, "cwd"), filepath.Join(dir, "img")
		os.Mkdir(cwd, 0o700)
		os.Mkdir(img, 0o700)
		br := &rlCRIU{h: &latHost{python: r.o.Python, sock: "deltabox-bench-rl-" + randHex(4), dir: cwd}, img: img, run: r.criu}
		if err := br.h.start(ctx); err != nil {
			os.RemoveAll(dir)
			return out, nil, err
		}
		out = append(out, br)
		if _, err := br.h.call(ctx, r.o.initCode()); err != nil {
			return out, nil, fmt.Errorf("build the heap: %w", err)
		}
		if err := r.criu.Dump(br.h.pid, img, true).Run(ctx); err != nil {
			return out, nil, err
		}
		line = ShellJoin(r.criu.Restore(img).Line())
	}
	return out, []string{"host call (the action)", "kill(PID, SIGKILL) and wait4", line}, nil
}

// ---- copytree+replay ----

type rlCopytree struct {
	r        *rlRun
	h        *latHost
	snap, ws string
}

func (b *rlCopytree) act(ctx context.Context, step int) (rlActStat, error) {
	return b.h.act(ctx, rlActCode(step, true))
}

// act runs an action (rlActCode) in the host python.
func (h *latHost) act(ctx context.Context, code string) (rlActStat, error) {
	out, err := h.call(ctx, code)
	if err != nil {
		return rlActStat{}, err
	}
	return parseActStat(out)
}

func (b *rlCopytree) reset(ctx context.Context) error {
	b.h.kill()
	if err := os.RemoveAll(b.ws); err != nil {
		return err
	}
	cmd := deadline.Command(ctx, 5*time.Minute, "cp", "-a", "--reflink=auto", b.snap, b.ws)
	cmd.What = "cp -a of a branch's workspace"
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("%v: %s", err, out)
	}
	if err := b.h.start(ctx); err != nil {
		return err
	}
	_, err := b.h.call(ctx, b.r.o.initCode()) // the replay
	return err
}

func (b *rlCopytree) digest(ctx context.Context) (string, error) {
	out, err := b.h.call(ctx, "bench_digest() + ' ' + (open('action.txt').read() if __import__('os').path.exists('action.txt') else '-')")
	return latPyStr(out), err
}

func (b *rlCopytree) close() {
	b.h.kill()
	os.RemoveAll(filepath.Dir(b.ws))
}

func (r *rlRun) setupCopytree(ctx context.Context, b int) ([]rlBranch, []string, error) {
	var out []rlBranch
	for i := 0; i < b; i++ {
		dir, err := os.MkdirTemp(r.o.HostDir, "deltabox-bench-rl-")
		if err != nil {
			return out, nil, err
		}
		snap, ws := filepath.Join(dir, "snap"), filepath.Join(dir, "ws")
		if _, err := hostPy(ctx, genPy, snap, strconv.FormatInt(r.o.Seed, 10), strconv.Itoa(r.o.WorkspaceMB), "200", "2"); err != nil {
			os.RemoveAll(dir)
			return out, nil, err
		}
		br := &rlCopytree{r: r, snap: snap, ws: ws, h: &latHost{python: r.o.Python, sock: "deltabox-bench-rl-ct-" + randHex(4), dir: ws}}
		out = append(out, br)
		if err := br.reset(ctx); err != nil { // the start state: a copy and the heap built
			return out, nil, err
		}
	}
	return out, []string{"host call (the action)", "kill and wait4, rm -rf WS, cp -a --reflink=auto SNAPSHOT WS, python3 (new) + the heap's build (the replay)"}, nil
}

// forkPoint: the step's start state is one node; each step forks b sandboxes from it
// (the node's processes included), runs the action in each, and removes them. In the
// overlapped mode the step's fork (after the last step's branches' removal) runs during
// its policy, as the other systems' resets do.
func (r *rlRun) forkPoint(ctx context.Context, b int, mode string) (Row, error) {
	op := rlOp(b, mode)
	base := "bench-rl-fork-" + randHex(4)
	if _, err := r.c.Create(ctx, apitypes.CreateOptions{ID: base, Image: r.o.Image, Workdir: "/workspace", MemoryMB: int64(r.o.HeapMB)*3 + 256}); err != nil {
		return Row{}, err
	}
	var node string
	var live []apitypes.ForkBranch // the last fork's branches, not removed yet
	remove := func() {
		for _, br := range live {
			rctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			r.c.Remove(rctx, br.Sandbox.ID)
			cancel()
		}
		live = nil
	}
	defer func() {
		remove()
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		r.c.Remove(ctx, base)
		if node != "" {
			r.c.RemoveNode(ctx, node)
		}
	}()
	if err := r.genWorkspace(ctx, base); err != nil {
		return Row{}, err
	}
	if err := r.startHeap(ctx, base); err != nil {
		return Row{}, err
	}
	ck, err := r.c.Checkpoint(ctx, base, "rl-start")
	if err != nil {
		return Row{}, err
	}
	node = ck.Node.ID
	want, err := (&rlSandbox{c: r.c, id: base}).digest(ctx)
	if err != nil {
		return Row{}, err
	}
	r.logf("%s (%s): forking %d branches a step from %s", SysRLFork, mode, b, node)
	st := &rlStats{}
	var forks []float64
	files := 0
	// fork removes the last step's branches and forks this step's.
	fork := func() (*apitypes.ForkResult, time.Duration, error) {
		remove()
		f0 := time.Now()
		fr, err := r.c.Fork(ctx, node, apitypes.ForkRequest{Count: b})
		if fr != nil {
			live = fr.Branches
		}
		return fr, time.Since(f0), err
	}
	for i := 0; i <= r.o.Steps; i++ {
		s0, c0 := time.Now(), r.cpuNow()
		var fr *apitypes.ForkResult
		var took time.Duration
		var ferr error
		done := make(chan struct{})
		if mode == rlOverlap {
			go func() { fr, took, ferr = fork(); close(done) }()
		}
		time.Sleep(time.Duration(r.o.PolicyMS) * time.Millisecond)
		e0 := time.Now()
		if mode == rlOverlap {
			<-done
			if i > 0 {
				st.add(&st.waits, time.Since(e0))
			}
		} else {
			fr, took, ferr = fork()
		}
		if ferr != nil {
			return Row{}, fmt.Errorf("step %d: fork: %w", i, ferr)
		}
		if i == 0 {
			// Untimed (the warm-up step): every branch holds the node's process state.
			for _, br := range fr.Branches {
				st.check(ctx, &rlSandbox{c: r.c, id: br.Sandbox.ID}, want)
			}
		}
		errs := make([]error, len(fr.Branches))
		var wg sync.WaitGroup
		for j, br := range fr.Branches {
			if br.Path != "durable" {
				files++
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				a0 := time.Now()
				a, err := (&rlSandbox{c: r.c, id: br.Sandbox.ID}).act(ctx, i)
				if err != nil {
					errs[j] = err
				} else if i > 0 {
					st.action(time.Since(a0), a)
				}
			}()
		}
		wg.Wait()
		end := time.Now()
		if mode == rlSerial {
			remove() // untimed
		}
		if err := errors.Join(errs...); err != nil {
			return Row{}, fmt.Errorf("step %d: action: %w", i, err)
		}
		if i == 0 {
			continue
		}
		forks = append(forks, ms(took))
		st.step(r, s0, e0, end, c0)
	}
	row := Summarize(st.steps).Row(SysRLFork, op, r.o.WorkspaceMB, "POST /v1/nodes/ID/fork {count: B} (the step's branches)",
		"POST /v1/sandboxes/ID/sessions/py/run (the action, in each)", "DELETE /v1/sandboxes/ID (each, untimed in the serial mode)")
	row.Info = st.info(r, b, mode)
	row.Info["fork_ms_p50"], row.Info["branches_files_only"] = us(Summarize(forks).P50), files
	if mode == rlOverlap {
		row.Info["fork_wait_ms_p50"] = us(Summarize(st.waits).P50)
	}
	r.logf("%s (%s): B=%d: step p50 %.1f ms, fork p50 %.1f ms, GPU busy %.1f%%", SysRLFork, mode, b, us(Summarize(st.steps).P50),
		us(Summarize(forks).P50), row.Info["gpu_busy_frac"].(float64)*100)
	return row, nil
}

// genWorkspace writes the bench's workspace into sandbox id's /workspace.
func (r *rlRun) genWorkspace(ctx context.Context, id string) error {
	res, err := r.c.Exec(ctx, id, apitypes.ExecRequest{Argv: []string{"python3", "-c", genPy, "/workspace",
		strconv.FormatInt(r.o.Seed, 10), strconv.Itoa(r.o.WorkspaceMB), "200", "2"}, TimeoutMS: 300_000})
	if err != nil {
		return fmt.Errorf("generate the workspace in %s: %w", id, err)
	}
	if res.ExitCode != 0 {
		return fmt.Errorf("generate the workspace in %s: exit %d: %s", id, res.ExitCode, res.Stderr)
	}
	return nil
}

// startHeap starts sandbox id's python session "py" and builds the heap in it.
func (r *rlRun) startHeap(ctx context.Context, id string) error {
	if _, err := r.c.StartSession(ctx, id, apitypes.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		return err
	}
	res, err := r.c.Run(ctx, id, "py", r.o.initCode(), 2*time.Minute)
	if err != nil {
		return fmt.Errorf("build the heap in %s: %w", id, err)
	}
	if res.ExitCode != 0 {
		return fmt.Errorf("build the heap in %s: exit %d: %s", id, res.ExitCode, res.Stdout)
	}
	return nil
}
