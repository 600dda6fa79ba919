package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/client"
)

// `deltabox bench warm`: the async warm-up of restored processes (state/procwarm.go) off
// and on, in the same run against the same daemon: the restore, the first command after
// it (at once and after a pause), and what the warm-up costs the next restore.

// Systems of the warm bench.
const (
	SysWarmOff = "deltabox"      // a sandbox created without warm_processes
	SysWarmOn  = "deltabox+warm" // a sandbox created with warm_processes
)

// Ops of the warm bench.
const (
	WarmOpRestore     = "restore"      // a restore right after a command that rewrote the heap
	WarmOpFirst       = "first-cmd"    // the rewriting command right after that restore
	WarmOpPaused      = "paused-cmd"   // the same command after a restore and a pause
	WarmOpSecond      = "second-cmd"   // the same command again: its pages are already private
	WarmOpNextRestore = "next-restore" // a restore after a restore, a pause and a one-page command
)

// WarmOptions configures `deltabox bench warm`.
type WarmOptions struct {
	HeapMB  int    `json:"heap_mb"`  // the python session's heap: a bytearray, all of it written before the checkpoint
	Samples int    `json:"samples"`  // per system and op in each round
	Rounds  int    `json:"rounds"`   // the systems alternate: off, on, off, on, ...
	PauseMS int    `json:"pause_ms"` // stands in for an agent thinking between the restore and its next command
	Image   string `json:"image"`

	Notes   []string  `json:"-"`
	Command string    `json:"-"`
	Log     io.Writer `json:"-"`
}

// DefaultWarmOptions are the parameters docs/BENCHMARKS.md quotes.
func DefaultWarmOptions() WarmOptions {
	return WarmOptions{HeapMB: 50, Samples: 15, Rounds: 2, PauseMS: 300, Image: "default"}
}

// Validate checks the options' ranges.
func (o WarmOptions) Validate() error {
	if o.HeapMB < 1 || o.Samples < 1 || o.Rounds < 1 || o.PauseMS < 0 {
		return fmt.Errorf("want heap-mb, samples and rounds >= 1 and pause-ms >= 0")
	}
	return nil
}

// warmTouch writes one byte in every page of the heap and returns what the first byte
// was: 0 on the checkpoint's state, 1 once the command has run since.
const warmTouch = "_w = a[0]\nfor i in range(0, len(a), 4096): a[i] = 1\n_w"

type warmRun struct {
	c     *client.Client
	o     WarmOptions
	f     *File
	start time.Time
	s     map[string]map[string][]float64          // system -> op -> client ms
	cmd   map[string]map[string][]float64          // system -> op -> the command's own duration (session)
	ph    map[string]map[string][]map[string]int64 // system -> op -> the daemon's phases of each restore
	bytes map[string]int64                         // system -> bytes warmed
}

func (r *warmRun) logf(format string, a ...any) {
	progress(r.o.Log, r.start, format, a...)
}

// RunWarm runs the bench on the daemon c talks to.
func RunWarm(ctx context.Context, c *client.Client, o WarmOptions) (f *File, err error) {
	start := time.Now()
	f = &File{Bench: "warm", Command: o.Command, Machine: CurrentMachine(), Started: start.UTC()}
	if err := o.Validate(); err != nil {
		return f, err
	}
	f.Notes = append(f.Notes, o.Notes...)
	if err := c.Health(ctx); err != nil {
		return f, err
	}
	settings, _ := json.Marshal(o)
	json.Unmarshal(settings, &f.Settings)
	f.Description = warmDescription(o)
	r := &warmRun{c: c, o: o, f: f, start: start, s: map[string]map[string][]float64{}, cmd: map[string]map[string][]float64{},
		bytes: map[string]int64{}, ph: map[string]map[string][]map[string]int64{}}
	defer func() {
		f.Finished = time.Now().UTC()
		f.DurationS = float64(int(time.Since(start).Seconds()*10)) / 10
		f.Machine.LoadAvgEnd = LoadAvg()
	}()
	for round := 0; round < o.Rounds; round++ {
		for _, sys := range []string{SysWarmOff, SysWarmOn} {
			if err := r.round(ctx, sys, round); err != nil {
				f.Results = r.rows()
				return f, fmt.Errorf("%s, round %d: %w", sys, round+1, err)
			}
		}
	}
	f.Results = r.rows()
	return f, nil
}

func warmDescription(o WarmOptions) string {
	return fmt.Sprintf("The async warm-up of restored processes (`warm_processes`, docs/DESIGN.md) off (`%s`) and on (`%s`), "+
		"in sandboxes of the same daemon, alternating %d times. Each sandbox has a python session holding `a = bytearray(%d MiB)`, "+
		"every page written, checkpointed once. The command is `%s` (one byte written in every page of the heap, so that each "+
		"write after a restore is a copy-on-write fault unless the page was pre-faulted); it returns the heap's first byte, "+
		"checked: 0 right after a restore (the node's state), 1 once the command ran. Per sample: `%s` is a restore (the client's "+
		"Restore call) right after the command; `%s` the command at once after it; `%s` the command again (its pages are "+
		"private: the floor); `%s` the command after another restore and a %d ms pause (an agent thinking: the warm-up's window); "+
		"`%s` a restore after a restore, a %d ms pause and a command that writes one page (what pre-faulting costs the next "+
		"restore, whose kill frees the copies). Rows time the client's call; the commands' own durations in the session are in "+
		"the details (`command_p50_ms`).",
		SysWarmOff, SysWarmOn, o.Rounds, o.HeapMB, strings.ReplaceAll(warmTouch, "\n", "; "), WarmOpRestore, WarmOpFirst, WarmOpSecond,
		WarmOpPaused, o.PauseMS, WarmOpNextRestore, o.PauseMS)
}

func (r *warmRun) add(sys, op string, clientMS, cmdMS float64) {
	if r.s[sys] == nil {
		r.s[sys], r.cmd[sys] = map[string][]float64{}, map[string][]float64{}
	}
	r.s[sys][op] = append(r.s[sys][op], clientMS)
	if cmdMS >= 0 {
		r.cmd[sys][op] = append(r.cmd[sys][op], cmdMS)
	}
}

// round creates a sandbox of system sys, takes o.Samples of every op and removes it.
func (r *warmRun) round(ctx context.Context, sys string, round int) (err error) {
	o := r.o
	id := fmt.Sprintf("bench-warm-%d-%s", round, randHex(3))
	if sys == SysWarmOn {
		id += "-on"
	}
	r.logf("%s: sandbox %s, %d samples", sys, id, o.Samples)
	if _, err := r.c.Create(ctx, apitypes.CreateOptions{ID: id, Image: o.Image, WarmProcesses: sys == SysWarmOn}); err != nil {
		return err
	}
	var node string
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		if e := r.c.Remove(cctx, id); e != nil {
			err = errors.Join(err, fmt.Errorf("cleanup: remove sandbox %s: %w", id, e))
		}
		if node != "" {
			if _, e := r.c.RemoveNode(cctx, node); e != nil {
				err = errors.Join(err, fmt.Errorf("cleanup: remove node %s: %w", node, e))
			}
		}
	}()
	if _, err := r.c.StartSession(ctx, id, apitypes.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		return err
	}
	run := func(code, want string) (float64, float64, error) {
		t0 := time.Now()
		res, err := r.c.Run(ctx, id, "py", code, 2*time.Minute)
		d := ms(time.Since(t0))
		switch {
		case err != nil:
			return 0, 0, err
		case res.ExitCode != 0:
			return 0, 0, fmt.Errorf("python session call exited %d: %s", res.ExitCode, strings.TrimSpace(res.Stdout))
		case res.SessionRestarted:
			return 0, 0, fmt.Errorf("the python session was restarted (its state was lost)")
		case want != "" && strings.TrimSpace(res.Stdout) != want:
			return 0, 0, fmt.Errorf("the command answered %q, want %q: the restore did not bring back the node's state", strings.TrimSpace(res.Stdout), want)
		}
		return d, res.DurationMS, nil
	}
	restore := func() (float64, *apitypes.OpResult, error) {
		t0 := time.Now()
		res, err := r.c.Restore(ctx, id, node)
		d := ms(time.Since(t0))
		if err != nil {
			return 0, nil, err
		}
		if res.Processes != 1 || len(res.ProcessErrors) > 0 {
			return 0, nil, fmt.Errorf("restore took %d processes (%v), want the python session", res.Processes, res.ProcessErrors)
		}
		return d, res, nil
	}
	if _, _, err := run(fmt.Sprintf("a = bytearray(b'\\x02' * (%d << 20))\na[0] = 0\n0", o.HeapMB), "0"); err != nil {
		return err
	}
	cp, err := r.c.Checkpoint(ctx, id, "heap")
	if err != nil {
		return err
	}
	node = cp.Node.ID
	before, err := r.c.Get(ctx, id)
	if err != nil {
		return err
	}
	pause := time.Duration(o.PauseMS) * time.Millisecond
	for i := 0; i < o.Samples; i++ {
		d, res, err := restore()
		if err != nil {
			return err
		}
		r.add(sys, WarmOpRestore, d, -1)
		r.phases(sys, WarmOpRestore, res)
		d, cmd, err := run(warmTouch, "0")
		if err != nil {
			return err
		}
		r.add(sys, WarmOpFirst, d, cmd)
		d, cmd, err = run(warmTouch, "1")
		if err != nil {
			return err
		}
		r.add(sys, WarmOpSecond, d, cmd)
		if _, _, err := restore(); err != nil {
			return err
		}
		time.Sleep(pause)
		d, cmd, err = run(warmTouch, "0")
		if err != nil {
			return err
		}
		r.add(sys, WarmOpPaused, d, cmd)
	}
	for i := 0; i < o.Samples; i++ {
		if _, _, err := restore(); err != nil {
			return err
		}
		time.Sleep(pause)
		if _, _, err := run("a[1] = 3\na[0]", "0"); err != nil {
			return err
		}
		d, res, err := restore()
		if err != nil {
			return err
		}
		r.add(sys, WarmOpNextRestore, d, -1)
		r.phases(sys, WarmOpNextRestore, res)
	}
	after, err := r.c.Get(ctx, id)
	if err != nil {
		return err
	}
	r.bytes[sys] += after.Stats.WarmedBytes - before.Stats.WarmedBytes
	return nil
}

func (r *warmRun) phases(sys, op string, res *apitypes.OpResult) {
	if r.ph[sys] == nil {
		r.ph[sys] = map[string][]map[string]int64{}
	}
	r.ph[sys][op] = append(r.ph[sys][op], res.PhasesUS)
}

func (r *warmRun) rows() []Row {
	cmds := map[string][]string{
		WarmOpRestore:     {"client.Restore(sandbox, node)"},
		WarmOpFirst:       {"client.Run(sandbox, \"py\", TOUCH) right after the restore"},
		WarmOpSecond:      {"client.Run(sandbox, \"py\", TOUCH) again"},
		WarmOpPaused:      {"client.Run(sandbox, \"py\", TOUCH) after a restore and the pause"},
		WarmOpNextRestore: {"client.Restore(sandbox, node) after a restore, the pause and a one-page command"},
	}
	var rows []Row
	for _, op := range []string{WarmOpRestore, WarmOpFirst, WarmOpPaused, WarmOpSecond, WarmOpNextRestore} {
		for _, sys := range []string{SysWarmOff, SysWarmOn} {
			xs := r.s[sys][op]
			if len(xs) == 0 {
				continue
			}
			row := Summarize(xs).Row(sys, op, 0, cmds[op]...)
			row.Info = map[string]any{}
			if c := r.cmd[sys][op]; len(c) > 0 {
				row.Info["command_p50_ms"] = Summarize(c).P50
			}
			if op == WarmOpRestore {
				row.Info["warmed_mib"] = r.bytes[sys] >> 20
			}
			if ph := r.ph[sys][op]; len(ph) > 0 {
				row.Info["phases_p50_us"] = phaseMedians(ph, func(m map[string]int64) map[string]int64 { return m })
			}
			rows = append(rows, row)
		}
	}
	return rows
}
