package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/cgroup"
	"deltabox/internal/client"
)

// Systems of `bench fanout`.
const (
	SysFanoutDeltabox = "deltabox"        // POST /v1/nodes/ID/fork: processes carried (its path per branch in info)
	SysFanoutFast     = "deltabox-fast"   // POST /v1/sandboxes/ID/fork of a fresh source: the fast path when the daemon takes it
	SysFanoutFamily   = "deltabox-family" // POST /v1/nodes/ID/fork of deltabox-fast's node, which its family's holder keeps: the fast path again
	SysFanoutReplay   = "files+replay"    // the same fork with files only, then the session's code replayed in each branch
	SysFanoutCRIU     = "criu-restore"    // CRIU restores into N fresh sandboxes
	SysFanoutPodman   = "podman"          // podman container checkpoint/restore
)

// FanoutOptions configure `bench fanout`.
type FanoutOptions struct {
	Counts      []int     `json:"counts"`       // branches per fork, one fork each
	HeapMB      int       `json:"heap_mb"`      // the python session's heap
	WorkspaceMB int       `json:"workspace_mb"` // files written into the workspace before the checkpoint
	Image       string    `json:"image"`
	Replay      bool      `json:"replay"` // run the files+replay baseline
	Podman      bool      `json:"podman"` // run the podman checkpoint/restore baseline
	Root        string    `json:"-"`      // the store, whose images/<image>/rootfs the podman baseline imports
	Command     string    `json:"-"`
	Notes       []string  `json:"-"`
	Log         io.Writer `json:"-"`
}

// DefaultFanoutOptions: the counts and its 50 MB python session; a workspace
// of 64 MiB (the 1 GiB with --workspace-mb 1024: the layers are shared, so its
// size shows only in the checkpoint).
func DefaultFanoutOptions() FanoutOptions {
	return FanoutOptions{Counts: []int{1, 8, 32, 64}, HeapMB: 50, WorkspaceMB: 64, Image: "default", Replay: true, Podman: true}
}

// Validate checks the options.
func (o FanoutOptions) Validate() error {
	if len(o.Counts) == 0 || o.HeapMB < 1 || o.HeapMB > 4096 || o.WorkspaceMB < 0 {
		return fmt.Errorf("bench fanout: want --counts, --heap-mb 1 to 4096, --workspace-mb >= 0")
	}
	for _, n := range o.Counts {
		if n < 1 || n > 256 {
			return fmt.Errorf("bench fanout: --counts %d: want 1 to 256", n)
		}
	}
	return nil
}

// RunFanout measures a fork of one node into N live sandboxes: a sandbox with a python
// session holding a HeapMB heap and a WorkspaceMB workspace is checkpointed (its durable
// image waited for); then for each N, POST /v1/nodes/ID/fork {"count": N}, timed until
// every branch's python has answered its first call, beside the same fork with files
// only and the session's code replayed in each branch. Each branch's own time in the
// daemon (create and restore) gives the per-branch distribution; the memory cgroup's
// charge of each branch the memory it adds. Branches and the source are removed.
func RunFanout(ctx context.Context, c *client.Client, o FanoutOptions) (f *File, err error) {
	start := time.Now()
	f = &File{Bench: "fanout", Command: o.Command, Machine: CurrentMachine(), Started: start.UTC(), Notes: o.Notes}
	defer func() {
		f.Finished = time.Now().UTC()
		f.DurationS = float64(int(time.Since(start).Seconds()*10)) / 10
		f.Machine.LoadAvgEnd = LoadAvg()
	}()
	if err := o.Validate(); err != nil {
		return f, err
	}
	if err := c.Health(ctx); err != nil {
		return f, err
	}
	f.Settings = map[string]any{"counts": o.Counts, "heap_mb": o.HeapMB, "workspace_mb": o.WorkspaceMB}
	f.Description = fmt.Sprintf("A sandbox with a python session holding a %d MiB heap of 1 MiB random objects and a %d MiB "+
		"workspace, checkpointed once (its durable image waited for). `%s`: `POST /v1/nodes/ID/fork {\"count\": N}`, until every "+
		"branch's python has answered `len(heap)` (total_ms in info); p50/p95 are each branch's own time in the daemon (its create "+
		"and its restore, `duration_ms` of the branch); `mem_added_mb` the mean memory cgroup charge of a branch after its answer, "+
		"`pss_added_mb` the mean PSS of its processes (pages shared copy-on-write count for their share; podman: the container's python). "+
		"`%s`: the same fork with `processes: never`, then the session's code run again in each branch. "+
		"`%s`: `POST /v1/sandboxes/ID/fork {\"count\": N}` of a fresh source made as the first (its checkpoint included), "+
		"the fast path unless the daemon runs with DELTABOX_FORK_FAST=0 (paths and reason in info). "+
		"`%s`: a container of the same image running the same heap, `podman container checkpoint --export` once (checkpoint_ms), "+
		"then N `podman container restore --import` one per CPU at once, each timed until its python is seen running with its heap.",
		o.HeapMB, o.WorkspaceMB, SysFanoutDeltabox, SysFanoutReplay, SysFanoutFast, SysFanoutPodman)
	logf := func(format string, a ...any) {
		if o.Log != nil {
			fmt.Fprintf(o.Log, "[%7.1fs] %s\n", time.Since(start).Seconds(), fmt.Sprintf(format, a...))
		}
	}
	src := "bench-fanout-" + randHex(3)
	var made, fastNodes []string
	var node string
	defer func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Minute)
		defer cancel()
		for _, id := range append(made, src) {
			if e := c.Remove(cctx, id); e != nil && !strings.Contains(e.Error(), "no sandbox") {
				err = errors.Join(err, fmt.Errorf("cleanup: remove sandbox %s: %w", id, e))
			}
		}
		for _, n := range append(fastNodes, node) {
			if n == "" {
				continue
			}
			if _, e := c.RemoveNode(cctx, n); e != nil {
				err = errors.Join(err, fmt.Errorf("cleanup: remove node %s: %w", n, e))
			}
		}
	}()
	logf("sandbox %s: %d MiB workspace, python with a %d MiB heap", src, o.WorkspaceMB, o.HeapMB)
	heap := durHeapCode(o.HeapMB)
	if err := fanoutSource(ctx, c, src, o, heap); err != nil {
		return f, err
	}
	ck, err := c.Checkpoint(ctx, src, "fanout")
	if err != nil {
		return f, err
	}
	if ck.Processes != 1 {
		return f, fmt.Errorf("the checkpoint took %d processes: %v", ck.Processes, ck.ProcessErrors)
	}
	node = ck.Node.ID
	if _, err := durWaitImage(ctx, c, node); err != nil {
		return f, err
	}
	want := fmt.Sprintf("%d\n", o.HeapMB)
	podman := "not asked for (--no-podman)"
	var pf *podmanFanout
	if o.Podman {
		logf("podman: a container of the same python, checkpointed with --export")
		if pf, podman, err = startPodmanFanout(ctx, o.Root, o.Image, o.HeapMB, o.WorkspaceMB, logf); err != nil {
			return f, err
		}
		if podman != "" {
			pf = nil // it cannot run here, and startPodmanFanout closed what it started
		}
		if pf != nil {
			defer func() { err = errors.Join(err, pf.close(context.WithoutCancel(ctx))) }()
		}
	}
	for _, n := range o.Counts {
		op := fmt.Sprintf("fork-%d", n)
		logf("%s: deltabox", op)
		t0 := time.Now()
		res, err := c.Fork(ctx, node, apitypes.ForkRequest{Count: n, CreateOptions: apitypes.CreateOptions{ID: "bfo-" + randHex(3)}})
		if err != nil {
			return f, err
		}
		row, err := fanoutForkRow(ctx, c, o, res, t0, want, &made, SysFanoutDeltabox, op, "POST /v1/nodes/ID/fork")
		if err != nil {
			return f, err
		}
		row.Info["image_wait_ms"] = res.ImageWaitMS
		f.Results = append(f.Results, row)
		logf("%s: deltabox %.0f ms until every branch answered (%v)", op, row.Info["total_ms"], row.Info["paths"])
		made, err = fanoutRemove(ctx, c, made)
		if err != nil {
			return f, err
		}
		if o.Replay {
			logf("%s: files+replay", op)
			t0 = time.Now()
			res, err = c.Fork(ctx, node, apitypes.ForkRequest{Count: n, Processes: "never", CreateOptions: apitypes.CreateOptions{ID: "bfr-" + randHex(3)}})
			if err != nil {
				return f, err
			}
			var per []float64
			for _, b := range res.Branches {
				made = append(made, b.Sandbox.ID)
				tb := time.Now()
				if _, err := c.StartSession(ctx, b.Sandbox.ID, apitypes.SessionOptions{Name: durSession, Kind: "python"}); err != nil {
					return f, err
				}
				if _, err := fanoutRun(ctx, c, b.Sandbox.ID, heap, ""); err != nil {
					return f, err
				}
				if _, err := fanoutRun(ctx, c, b.Sandbox.ID, "len(heap)", want); err != nil {
					return f, err
				}
				per = append(per, b.DurationMS+ms(time.Since(tb)))
			}
			total := ms(time.Since(t0))
			row := Summarize(per).Row(SysFanoutReplay, op, o.WorkspaceMB, "POST /v1/nodes/ID/fork {processes: never}", "session py started and its code run again per branch")
			row.Info = map[string]any{"total_ms": total, "daemon_ms": res.DurationMS}
			f.Results = append(f.Results, row)
			logf("%s: files+replay %.0f ms", op, total)
			if made, err = fanoutRemove(ctx, c, made); err != nil {
				return f, err
			}
		}
		// The fast path: a fork of a live sandbox moves it into a namespace of its own
		// (docs/design/fork.md), so each N forks a fresh source, made as the first.
		fsrc := "bench-fanout-fast-" + randHex(3)
		logf("%s: deltabox-fast (source %s)", op, fsrc)
		made = append(made, fsrc)
		if err := fanoutSource(ctx, c, fsrc, o, heap); err != nil {
			return f, err
		}
		t0 = time.Now()
		res, err = c.ForkSandbox(ctx, fsrc, apitypes.SandboxForkRequest{ForkRequest: apitypes.ForkRequest{Count: n, CreateOptions: apitypes.CreateOptions{ID: "bff-" + randHex(3)}}})
		if err != nil {
			return f, err
		}
		fastNodes = append(fastNodes, res.Node)
		if row, err = fanoutForkRow(ctx, c, o, res, t0, want, &made, SysFanoutFast, op, "POST /v1/sandboxes/ID/fork (its checkpoint included)"); err != nil {
			return f, err
		}
		f.Results = append(f.Results, row)
		logf("%s: deltabox-fast %.0f ms until every branch answered (%v)", op, row.Info["total_ms"], row.Info["paths"])
		// A fork of that node again: its family's holder keeps its templates
		// (docs/design/fork.md), the same request as the deltabox row's. The
		// deltabox-fast branches go first (the moved source keeps the family), so
		// that it runs beside as many sandboxes as that row did.
		if rest, err := fanoutRemove(ctx, c, made[1:]); err != nil {
			return f, err
		} else if len(rest) > 0 {
			return f, fmt.Errorf("deltabox-fast's branches %v not removed", rest)
		}
		made = made[:1]
		logf("%s: deltabox-family (node %s)", op, res.Node)
		t0 = time.Now()
		res, err = c.Fork(ctx, res.Node, apitypes.ForkRequest{Count: n, CreateOptions: apitypes.CreateOptions{ID: "bfm-" + randHex(3)}})
		if err != nil {
			return f, err
		}
		if row, err = fanoutForkRow(ctx, c, o, res, t0, want, &made, SysFanoutFamily, op, "POST /v1/nodes/ID/fork (of deltabox-fast's node, its family made)"); err != nil {
			return f, err
		}
		f.Results = append(f.Results, row)
		logf("%s: deltabox-family %.0f ms until every branch answered (%v)", op, row.Info["total_ms"], row.Info["paths"])
		if made, err = fanoutRemove(ctx, c, made); err != nil {
			return f, err
		}
		f.Results = append(f.Results,
			UnavailableRows(SysFanoutCRIU, o.WorkspaceMB, "the deltabox row is this: each branch is a CRIU restore of the node's durable image into a fresh sandbox; deltabox-fast is the fast path beside it", op)...)
		if pf == nil {
			f.Results = append(f.Results, UnavailableRows(SysFanoutPodman, o.WorkspaceMB, podman, op)...)
			continue
		}
		logf("%s: podman", op)
		per, total, pssMean, err := pf.fork(ctx, n)
		if err != nil {
			return f, err
		}
		row = Summarize(per).Row(SysFanoutPodman, op, o.WorkspaceMB, "podman container checkpoint --export FILE (once)",
			"podman container restore --import FILE --name NEW, one per CPU at once, until its python is seen running with its heap")
		row.Info = map[string]any{"total_ms": total, "checkpoint_ms": pf.CheckpointMS, "archive_mb": pf.ArchiveMB, "pss_added_mb": pssMean,
			"containers": pf.name + "-*"}
		f.Results = append(f.Results, row)
		logf("%s: podman %.0f ms until every container's python ran", op, total)
	}
	return f, nil
}

// fanoutAnswers is how many branches fanoutAnswer asks at once.
const fanoutAnswers = 8

// fanoutAnswer asks every branch's python for len(heap) (want), fanoutAnswers at once:
// the time until every branch has answered is the branches', not one client's round

// fanoutForkRow waits until every branch of fork res (asked at t0) has answered its first
// call (its python's len(heap) is want), adds the branches to made, and returns the
// row: each branch's own time in the daemon, the total until the last answer, the
// memory each added (its cgroup's charge, its processes' PSS) and its paths.
func fanoutForkRow(ctx context.Context, c *client.Client, o FanoutOptions, res *apitypes.ForkResult, t0 time.Time, want string, made *[]string, sys, op, asked string) (Row, error) {
	var per, mem, pss []float64
	paths := map[string]int{}
	for _, b := range res.Branches {
		*made = append(*made, b.Sandbox.ID)
		per = append(per, b.DurationMS)
		paths[b.Path]++
	}
	if err := fanoutAnswer(ctx, c, res.Branches, want); err != nil {
		return Row{}, err
	}
	total := ms(time.Since(t0))
	for _, b := range res.Branches {
		if in, err := c.Get(ctx, b.Sandbox.ID); err == nil && in.Usage != nil {
			mem = append(mem, float64(in.Usage.MemoryBytes)/(1<<20))
		}
		if pids := cgroupPids(filepath.Join(cgroup.RootFor(o.Root), b.Sandbox.ID)); len(pids) > 0 {
			pss = append(pss, pssMB(pids))
		}
	}
	row := Summarize(per).Row(sys, op, o.WorkspaceMB, asked, "POST /v1/sandboxes/ID/exec (session py) per branch")
	row.Info = map[string]any{"total_ms": total, "daemon_ms": res.DurationMS, "mem_added_mb": Summarize(mem).Mean, "pss_added_mb": Summarize(pss).Mean, "paths": paths, "reason": res.Branches[0].Reason}
	return row, nil
}

// trips one after the other (64 of them took 0.5-0.8 s here).
func fanoutAnswer(ctx context.Context, c *client.Client, bs []apitypes.ForkBranch, want string) error {
	errs := make([]error, len(bs))
	slots := make(chan struct{}, fanoutAnswers)
	var wg sync.WaitGroup
	for i, b := range bs {
		wg.Add(1)
		slots <- struct{}{}
		go func() {
			defer func() { <-slots; wg.Done() }()
			if _, err := fanoutRun(ctx, c, b.Sandbox.ID, "len(heap)", want); err != nil {
				errs[i] = fmt.Errorf("branch %d (%s, path %s: %s): %w", b.Branch, b.Sandbox.ID, b.Path, b.Reason, err)
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// fanoutRun runs code in sandbox id's python session; want, if not "", is its output.
func fanoutRun(ctx context.Context, c *client.Client, id, code, want string) (string, error) {
	r, err := c.Run(ctx, id, durSession, code, 10*time.Minute)
	if err != nil {
		return "", err
	}
	if r.ExitCode != 0 || (want != "" && r.Stdout != want) || r.SessionRestarted {
		return "", fmt.Errorf("%s: %q in the python session: exit %d, restarted %v, %q %q", id, code, r.ExitCode, r.SessionRestarted, r.Stdout, r.Stderr)
	}
	return r.Stdout, nil
}

// fanoutRemove removes the sandboxes ids and returns what is left to remove (nothing).
func fanoutRemove(ctx context.Context, c *client.Client, ids []string) ([]string, error) {
	for i, id := range ids {
		if err := c.Remove(ctx, id); err != nil {
			return ids[i:], err
		}
	}
	return nil, nil
}

// fanoutSource makes sandbox id as the bench's source: its workspace, and its python
// session holding heap.
func fanoutSource(ctx context.Context, c *client.Client, id string, o FanoutOptions, heap string) error {
	if _, err := c.Create(ctx, apitypes.CreateOptions{ID: id, Image: o.Image}); err != nil {
		return err
	}
	if o.WorkspaceMB > 0 {
		script := fmt.Sprintf("mkdir -p /workspace/ws && for i in $(seq %d); do head -c 4M /dev/urandom > /workspace/ws/f$i; done", (o.WorkspaceMB+3)/4)
		r, err := c.Exec(ctx, id, apitypes.ExecRequest{Argv: []string{"bash", "-c", script}, TimeoutMS: 600_000})
		if err != nil {
			return err
		}
		if r.ExitCode != 0 {
			return fmt.Errorf("write the workspace: exit %d: %s", r.ExitCode, r.Stderr)
		}
	}
	if _, err := c.StartSession(ctx, id, apitypes.SessionOptions{Name: durSession, Kind: "python"}); err != nil {
		return err
	}
	_, err := fanoutRun(ctx, c, id, heap, "")
	return err
}
