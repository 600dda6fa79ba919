package bench

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/apitypes"
	"deltabox/internal/client"
	"deltabox/internal/criu"
)

// Systems of `bench durable`.
const (
	SysDurableImage    = "deltabox-image"       // restore whose templates come back from the node's image
	SysDurableLazy     = "deltabox-image-lazy"  // the same, lazily (userfaultfd: pages copied on demand)
	SysDurableTemplate = "deltabox-template"    // the same restore from the node's templates
	SysDurableIncr     = "deltabox-incremental" // bytes an image adds to the page store
	SysCRIUFull        = "criu-full"            // bytes of the same full CRIU image
	SysCRIUPlain       = "criu"                 // plain CRIU restore of a host python with the same heap
)

// DurableOptions configure `bench durable`.
type DurableOptions struct {
	HeapMB      []int     `json:"heap_mb"`     // the python session's heap, one run per size
	Checkpoints int       `json:"checkpoints"` // checkpoints per run, each after StepMB of the heap changed
	StepMB      int       `json:"step_mb"`     // MiB of the heap rewritten before each checkpoint
	Restores    int       `json:"restores"`    // restores from the image (and from templates, and plain CRIU)
	Image       string    `json:"image"`       // image of the sandbox
	Python      string    `json:"python"`      // host python3 for the plain CRIU baseline
	TmpfsDir    string    `json:"tmpfs_dir"`   // plain CRIU's images
	CRIU        string    `json:"criu,omitempty"`
	Command     string    `json:"-"`
	Notes       []string  `json:"-"`
	Log         io.Writer `json:"-"`
}

// DefaultDurableOptions are the issue's: 50 and 500 MB python sessions.
func DefaultDurableOptions() DurableOptions {
	return DurableOptions{HeapMB: []int{50, 500}, Checkpoints: 6, StepMB: 2, Restores: 10, Image: "default", Python: "python3", TmpfsDir: "/dev/shm"}
}

// Validate checks the options.
func (o DurableOptions) Validate() error {
	if len(o.HeapMB) == 0 || o.Checkpoints < 2 || o.Restores < 1 || o.StepMB < 1 {
		return fmt.Errorf("bench durable: want --heap-mb, --checkpoints >= 2, --restores >= 1, --step-mb >= 1")
	}
	for _, mb := range o.HeapMB {
		if mb < o.StepMB || mb > 4096 {
			return fmt.Errorf("bench durable: --heap-mb %d: want %d to 4096", mb, o.StepMB)
		}
	}
	return nil
}

const durSession = "py"

// durHeapCode builds a heap of mb one-MiB random objects.
func durHeapCode(mb int) string {
	return fmt.Sprintf("import os, random\nrandom.seed(1)\nheap = [random.randbytes(1<<20) for _ in range(%d)]\nstep = 0\nos.getpid()", mb)
}

// durStepCode rewrites mb MiB of the heap and advances the step.
func durStepCode(mb int) string {
	return fmt.Sprintf("step += 1\nfor i in range(%d): heap[(step*%d + i) %% len(heap)] = random.randbytes(1<<20)\nstep", mb, mb)
}

// RunDurable measures durable images: on a sandbox with a python session of each heap
// size, a chain of checkpoints each after StepMB changed; the bytes each image added to
// the page store against its full CRIU images; restores whose templates come back from
// the image (the node evicted first), timed until the first command after them has
// returned, beside the same restores from templates and plain CRIU restores of a host
// python with the same heap in the same run.
func RunDurable(ctx context.Context, c *client.Client, o DurableOptions) (f *File, err error) {
	start := time.Now()
	f = &File{Bench: "durable", Command: o.Command, Machine: CurrentMachine(), Started: start.UTC(), Notes: o.Notes}
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
	f.Settings = map[string]any{"heap_mb": o.HeapMB, "checkpoints": o.Checkpoints, "step_mb": o.StepMB, "restores": o.Restores}
	f.Description = fmt.Sprintf("A sandbox with a python session holding a heap of 1 MiB random objects; %d checkpoints, "+
		"each after %d MiB of the heap was rewritten. `%s` and `%s`: the bytes each node's durable image added to the daemon's "+
		"page store, and the size of its full CRIU images (`process_image` of the node; the first image of a run is left out). "+
		"`%s`: the node's templates evicted (`POST /v1/nodes/ID/evict`), then the restore, which brings them back from the image, "+
		"until the first call to the session after it has returned; `%s`: the same, lazily (userfaultfd); both also until a call "+
		"that reads every page of the heap has returned (`read_all_ms`); `%s`: the same restore from the templates. `%s`: a host "+
		"python3 with the same heap, killed and restored by plain CRIU from tmpfs, until its first answer.",
		o.Checkpoints, o.StepMB, SysDurableIncr, SysCRIUFull, SysDurableImage, SysDurableLazy, SysDurableTemplate, SysCRIUPlain)
	logf := func(format string, a ...any) {
		if o.Log != nil {
			fmt.Fprintf(o.Log, "[%7.1fs] %s\n", time.Since(start).Seconds(), fmt.Sprintf(format, a...))
		}
	}
	r := criu.Probe(ctx, o.CRIU)
	f.Notes = append(f.Notes, "criu: "+criuNote(r))
	for _, mb := range o.HeapMB {
		rows, err := durableRun(ctx, c, o, mb, logf)
		f.Results = append(f.Results, rows...)
		if err != nil {
			return f, fmt.Errorf("heap %d MiB: %w", mb, err)
		}
		rows, err = durablePlainCRIU(ctx, r, o, mb, logf)
		f.Results = append(f.Results, rows...)
		if err != nil {
			return f, fmt.Errorf("plain CRIU, heap %d MiB: %w", mb, err)
		}
	}
	return f, nil
}

// durableRun is one heap size on the daemon.
func durableRun(ctx context.Context, c *client.Client, o DurableOptions, mb int, logf func(string, ...any)) (rows []Row, err error) {
	sb, err := c.Create(ctx, apitypes.CreateOptions{Image: o.Image, MemoryMB: int64(mb)*4 + 512})
	if err != nil {
		return nil, err
	}
	defer func() {
		c.Remove(context.WithoutCancel(ctx), sb.ID)
	}()
	var nodes []string
	defer func() {
		for _, n := range nodes {
			c.RemoveNode(context.WithoutCancel(ctx), n)
		}
	}()
	if _, err := c.StartSession(ctx, sb.ID, apitypes.SessionOptions{Name: durSession, Kind: "python"}); err != nil {
		return nil, err
	}
	run := func(code string) (string, error) {
		res, err := c.Run(ctx, sb.ID, durSession, code, 5*time.Minute)
		if err != nil {
			return "", err
		}
		if res.ExitCode != 0 || res.SessionRestarted {
			return "", fmt.Errorf("session call failed (exit %d, restarted %v): %s", res.ExitCode, res.SessionRestarted, res.Stdout)
		}
		return strings.TrimSpace(res.Stdout), nil
	}
	if _, err := run(durHeapCode(mb)); err != nil {
		return nil, err
	}
	logf("durable %d MiB: %d checkpoints", mb, o.Checkpoints)
	for i := 0; i < o.Checkpoints; i++ {
		if _, err := run(durStepCode(o.StepMB)); err != nil {
			return nil, err
		}
		op, err := c.Checkpoint(ctx, sb.ID, fmt.Sprintf("durable-%d", i))
		if err != nil {
			return nil, err
		}
		if op.Processes != 1 {
			return nil, fmt.Errorf("checkpoint %d took %d processes: %v", i, op.Processes, op.ProcessErrors)
		}
		nodes = append(nodes, op.Node.ID)
	}
	var stored, full []float64
	for i, n := range nodes {
		im, err := durWaitImage(ctx, c, n)
		if err != nil {
			if strings.Contains(err.Error(), "CRIU is unusable") {
				return UnavailableRows(SysDurableImage, mb, err.Error(), "restore"), nil
			}
			return nil, err
		}
		if i == 0 {
			continue // the first image holds every page
		}
		stored = append(stored, float64(im.StoredBytes))
		full = append(full, float64(im.FullBytes))
	}
	bytesRow := func(system string, xs []float64) Row {
		d := Summarize(xs)
		row := d.Row(system, "dump", mb, "GET /v1/nodes/ID: process_image")
		row.Info = map[string]any{"bytes": d.P50, "bytes_p95": d.P95, "unit": "bytes (p50_ms etc. hold bytes too)"}
		return row
	}
	rows = append(rows, bytesRow(SysDurableIncr, stored), bytesRow(SysCRIUFull, full))
	logf("durable %d MiB: %d restores from the image (eager and lazy), %d from templates", mb, o.Restores, o.Restores)
	var tmpl []float64
	img := map[string]*durImageTimes{"never": {}, "always": {}}
	for i := 0; i < o.Restores; i++ {
		n := nodes[len(nodes)-1-i%(len(nodes)-1)] // not the first: its image is the base
		for _, lazy := range []string{"never", "always"} {
			if _, err := c.EvictNode(ctx, n); err != nil {
				return nil, err
			}
			t0 := time.Now()
			res, err := c.RestoreWith(ctx, sb.ID, apitypes.RestoreRequest{Node: n, LazyImage: lazy})
			if err != nil {
				return nil, err
			}
			if !res.FromImage || res.Processes != 1 || res.LazyImage != (lazy == "always") {
				return nil, fmt.Errorf("restore of evicted %s (lazy_image %s): from_image %v, lazy %v, %d processes %v", n, lazy, res.FromImage, res.LazyImage, res.Processes, res.ProcessErrors)
			}
			if _, err := run("step"); err != nil {
				return nil, err
			}
			first := ms(time.Since(t0))
			// Every page of the heap read (a lazy restore's pages all in by then).
			if _, err := run(durReadAllCode); err != nil {
				return nil, err
			}
			it := img[lazy]
			it.first = append(it.first, first)
			it.all = append(it.all, ms(time.Since(t0)))
			it.server = append(it.server, res.DurationMS)
		}
		// The same node again: from its templates now.
		if _, err := run(durStepCode(o.StepMB)); err != nil {
			return nil, err
		}
		t0 := time.Now()
		res, err := c.Restore(ctx, sb.ID, n)
		if err != nil {
			return nil, err
		}
		if res.FromImage || res.Processes != 1 {
			return nil, fmt.Errorf("second restore of %s: from_image %v, %d processes", n, res.FromImage, res.Processes)
		}
		if _, err := run("step"); err != nil {
			return nil, err
		}
		tmpl = append(tmpl, ms(time.Since(t0)))
		if _, err := run(durStepCode(o.StepMB)); err != nil {
			return nil, err
		}
	}
	for _, x := range []struct{ sys, lazy string }{{SysDurableImage, "never"}, {SysDurableLazy, "always"}} {
		it := img[x.lazy]
		row := Summarize(it.first).Row(x.sys, "restore", mb, "POST /v1/nodes/ID/evict (untimed)",
			`POST /v1/sandboxes/ID/restore {"lazy_image": "`+x.lazy+`"}`, "session call `step`")
		all := Summarize(it.all)
		row.Info = map[string]any{"daemon_ms_p50": Summarize(it.server).P50,
			"read_all_ms_p50": all.P50, "read_all_ms_p95": all.P95,
			"read_all": "until a session call that reads every page of the heap (" + durReadAllCode + ") has returned too"}
		rows = append(rows, row)
	}
	rt := Summarize(tmpl).Row(SysDurableTemplate, "restore", mb, "POST /v1/sandboxes/ID/restore", "session call `step`")
	return append(rows, rt), nil
}

// durImageTimes are one kind of restore from an image's times (ms): until the first
// call returned, until a call that reads the whole heap returned, and in the daemon.
type durImageTimes struct{ first, all, server []float64 }

// durReadAllCode reads one byte of every page of the heap.
const durReadAllCode = "sum(h[i] for h in heap for i in range(0, len(h), 4096))"

// durWaitImage waits for node's image (at most 5 minutes).
func durWaitImage(ctx context.Context, c *client.Client, node string) (*apitypes.ImageInfo, error) {
	deadline := time.Now().Add(5 * time.Minute)
	for {
		n, err := c.Node(ctx, node)
		if err != nil {
			return nil, err
		}
		if im := n.ProcessImage; im != nil && im.State == "complete" {
			return im, nil
		} else if im != nil && im.State == "failed" {
			return nil, fmt.Errorf("node %s's image failed: %s", node, im.Error)
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("node %s's image is not complete after 5 minutes", node)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// durablePlainCRIU: a host python3 with the same heap, dumped once by plain CRIU to
// tmpfs, then killed and restored Restores times, each until its first answer.
func durablePlainCRIU(ctx context.Context, r *criu.Runner, o DurableOptions, mb int, logf func(string, ...any)) ([]Row, error) {
	if !r.Usable() {
		return UnavailableRows(SysCRIUPlain, mb, "CRIU is unusable here: "+r.Reason, "restore"), nil
	}
	dir, err := os.MkdirTemp(o.TmpfsDir, "deltabox-bench-durable-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	cwd := filepath.Join(dir, "cwd")
	img := filepath.Join(dir, "img")
	for _, d := range []string{cwd, img} {
		if err := os.Mkdir(d, 0o700); err != nil {
			return nil, err
		}
	}
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		return nil, err
	}
	defer unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
	h := &latHost{python: o.Python, sock: "deltabox-bench-durable-" + randHex(4), dir: cwd}
	if err := h.start(ctx); err != nil {
		return nil, err
	}
	defer func() { h.kill(); latReapOrphans() }()
	if _, err := h.call(ctx, strings.ReplaceAll(durHeapCode(mb), "\nos.getpid()", "")+"\nlabel_ = 'x'"); err != nil {
		return nil, err
	}
	dump := r.Dump(h.pid, img, true)
	if err := dump.Run(ctx); err != nil {
		return nil, err
	}
	logf("criu %d MiB: %d restores", mb, o.Restores)
	var rs []float64
	restoreCmd := ShellJoin(r.Restore(img).Line())
	for i := 0; i < o.Restores; i++ {
		pid := h.pid
		h.kill()
		t0 := time.Now()
		if err := r.Restore(img).Run(ctx); err != nil {
			return nil, err
		}
		h.pid = pid
		if err := h.pingLabel(ctx, "x"); err != nil {
			return nil, fmt.Errorf("after restore %d: %w", i, err)
		}
		rs = append(rs, ms(time.Since(t0)))
		latReapOrphans()
	}
	row := Summarize(rs).Row(SysCRIUPlain, "restore", mb, "kill(PID, SIGKILL) and wait4 (untimed)", restoreCmd, `host call "label_"`)
	row.Info = map[string]any{"criu_mode": string(r.Mode), "image_mb": us(float64(latDirBytes(img)) / (1 << 20))}
	return []Row{row}, nil
}
