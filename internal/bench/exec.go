package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/client"
	"deltabox/internal/deadline"
)

// `deltabox bench exec`: what a command costs through the API, as an agent issues
// them: a trivial call and calls that print 1 MB and 100 MB, through exec (a new
// process each), the bash session and a python session, beside `podman exec` into a
// container of the same image (the docker-exec-like baseline) where podman runs here.

// Systems of the exec bench.
const (
	SysExecPlain  = "deltabox-exec"   // POST /v1/sandboxes/{id}/exec: a new process per call
	SysExecBash   = "deltabox-bash"   // a call in the bash session "main"
	SysExecPython = "deltabox-python" // a call in a python session
	SysExecPodman = "podman-exec"     // podman exec into a running container of the image's rootfs
)

// Ops of the exec bench.
const (
	ExecOpCall     = "call"         // true (shell), pass (python)
	ExecOpOutSmall = "output-1MB"   // prints 10^6 bytes
	ExecOpOutLarge = "output-100MB" // prints 10^8 bytes (DeltaBox keeps 1 MiB of them)
)

// execTargetGapMS is the target: a bash session call's p50 within this of a python
// session call's (report_summary.go checks it).
const execTargetGapMS = 2

// ExecOptions configures `deltabox bench exec`.
type ExecOptions struct {
	Samples      int    `json:"samples"`       // trivial calls per system
	SamplesSmall int    `json:"samples_1mb"`   // 1 MB calls per system
	SamplesLarge int    `json:"samples_100mb"` // 100 MB calls per system
	Image        string `json:"image"`
	Baseline     bool   `json:"podman"` // run the podman exec baseline
	Root         string `json:"-"`      // the store, whose images/<image>/rootfs the baseline runs
	Podman       string `json:"-"`      // podman binary (default: on PATH)

	Notes   []string  `json:"-"`
	Command string    `json:"-"`
	Log     io.Writer `json:"-"`
}

// DefaultExecOptions are the parameters docs/BENCHMARKS.md quotes.
func DefaultExecOptions() ExecOptions {
	return ExecOptions{Samples: 200, SamplesSmall: 20, SamplesLarge: 5, Image: "default", Baseline: true}
}

// Validate checks the options' ranges.
func (o ExecOptions) Validate() error {
	if o.Samples < 1 || o.SamplesSmall < 0 || o.SamplesLarge < 0 {
		return fmt.Errorf("want samples >= 1, samples-1mb and samples-100mb >= 0")
	}
	return nil
}

// The output is lines of 128 bytes (127 and a newline), cut at exactly n bytes.
const execLine = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ+-="

func execShellOutput(n int) string { return fmt.Sprintf("yes %s | head -c %d", execLine, n) }

func execPythonOutput(n int) string {
	return fmt.Sprintf("import sys\n_b = %q * 8192\nfor _ in range(%d): sys.stdout.write(_b)\nsys.stdout.write(_b[:%d])\nsys.stdout.flush()",
		execLine+"\n", n>>20, n&(1<<20-1))
}

// execCase is one op of one system: what runs, and the check of its answer.
type execCase struct {
	sys, op string
	cmd     string                  // the timed call, as the row names it
	run     func() (float64, error) // the call, checked; the daemon's duration_ms (-1: none)
}

type execRun struct {
	c     *client.Client
	o     ExecOptions
	f     *File
	start time.Time
	s     map[string]map[string][]float64 // system -> op -> client ms
	d     map[string]map[string][]float64 // system -> op -> daemon ms
}

func (r *execRun) logf(format string, a ...any) {
	progress(r.o.Log, r.start, format, a...)
}

// RunExec runs the bench on the daemon c talks to.
func RunExec(ctx context.Context, c *client.Client, o ExecOptions) (f *File, err error) {
	start := time.Now()
	f = &File{Bench: "exec", Command: o.Command, Machine: CurrentMachine(), Started: start.UTC()}
	if err := o.Validate(); err != nil {
		return f, err
	}
	f.Notes = append(f.Notes, o.Notes...)
	if err := c.Health(ctx); err != nil {
		return f, err
	}
	settings, _ := json.Marshal(o)
	json.Unmarshal(settings, &f.Settings)
	f.Description = execDescription(o)
	r := &execRun{c: c, o: o, f: f, start: start, s: map[string]map[string][]float64{}, d: map[string]map[string][]float64{}}
	defer func() {
		f.Finished = time.Now().UTC()
		f.DurationS = float64(int(time.Since(start).Seconds()*10)) / 10
		f.Machine.LoadAvgEnd = LoadAvg()
	}()

	id := "bench-exec-" + randHex(3)
	r.logf("sandbox %s", id)
	if _, err := c.Create(ctx, apitypes.CreateOptions{ID: id, Image: o.Image}); err != nil {
		return f, err
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Minute)
		defer cancel()
		if e := c.Remove(cctx, id); e != nil {
			err = errors.Join(err, fmt.Errorf("cleanup: remove sandbox %s: %w", id, e))
		}
	}()
	if _, err := c.StartSession(ctx, id, apitypes.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		return f, err
	}
	cases := r.deltaboxCases(ctx, id)
	var unavailable []Row
	if o.Baseline {
		pc, stop, why := r.podmanCases(ctx)
		if why != "" {
			r.logf("podman: unavailable, not run: %s", why)
			unavailable = UnavailableRows(SysExecPodman, 0, why, ExecOpCall, ExecOpOutSmall, ExecOpOutLarge)
		} else {
			defer stop()
			cases = append(cases, pc...)
		}
	}
	// Untimed: every case once (starts the bash session, warms the caches and checks
	// the answers before anything is timed).
	for _, cs := range cases {
		if err := r.sample(cs, false); err != nil {
			return f, err
		}
	}
	// The systems alternate within each op, sample by sample, so that a drift of the
	// machine spreads over all of them.
	for _, op := range []struct {
		op string
		n  int
	}{{ExecOpCall, o.Samples}, {ExecOpOutSmall, o.SamplesSmall}, {ExecOpOutLarge, o.SamplesLarge}} {
		r.logf("%s: %d samples per system", op.op, op.n)
		for i := 0; i < op.n; i++ {
			for _, cs := range cases {
				if cs.op != op.op {
					continue
				}
				if err := r.sample(cs, true); err != nil {
					f.Results = r.rows(cases, unavailable)
					return f, err
				}
			}
		}
	}
	f.Results = r.rows(cases, unavailable)
	return f, nil
}

// sample runs one case, checks its answer and, if timed, records it.
func (r *execRun) sample(cs execCase, timed bool) error {
	t0 := time.Now()
	dms, err := cs.run()
	d := ms(time.Since(t0))
	if err != nil {
		return fmt.Errorf("%s %s: %w", cs.sys, cs.op, err)
	}
	if !timed {
		return nil
	}
	if r.s[cs.sys] == nil {
		r.s[cs.sys], r.d[cs.sys] = map[string][]float64{}, map[string][]float64{}
	}
	r.s[cs.sys][cs.op] = append(r.s[cs.sys][cs.op], d)
	if dms >= 0 {
		r.d[cs.sys][cs.op] = append(r.d[cs.sys][cs.op], dms)
	}
	return nil
}

var execTotalRE = regexp.MustCompile(`of ([0-9]+) bytes\]`)

// deltaboxCases are the calls through the API: exec, the bash session, the python session.
func (r *execRun) deltaboxCases(ctx context.Context, id string) []execCase {
	small, large := 1000000, 100000000
	execCall := func(argv []string, want int) func() (float64, error) {
		return func() (float64, error) {
			res, err := r.c.Exec(ctx, id, apitypes.ExecRequest{Argv: argv, TimeoutMS: 120000})
			if err != nil {
				return 0, err
			}
			if res.ExitCode != 0 {
				return 0, fmt.Errorf("exit %d: %s", res.ExitCode, strings.TrimSpace(res.Stderr))
			}
			if err := execCheck(want, len(res.Stdout), res.StdoutTruncated, ""); err != nil {
				return 0, err
			}
			return res.DurationMS, nil
		}
	}
	sessCall := func(sess, code string, want int) func() (float64, error) {
		return func() (float64, error) {
			res, err := r.c.Run(ctx, id, sess, code, 2*time.Minute)
			switch {
			case err != nil:
				return 0, err
			case res.ExitCode != 0:
				return 0, fmt.Errorf("exit %d: %s", res.ExitCode, strings.TrimSpace(res.Stdout))
			case res.SessionRestarted:
				return 0, fmt.Errorf("the session %s was restarted", sess)
			}
			if err := execCheck(want, len(res.Stdout), res.StdoutTruncated, res.Stdout); err != nil {
				return 0, err
			}
			return res.DurationMS, nil
		}
	}
	sh := func(n int) []string { return []string{"sh", "-c", execShellOutput(n)} }
	return []execCase{
		{sys: SysExecPlain, op: ExecOpCall, cmd: `client.Exec(sandbox, {argv: ["true"]})`, run: execCall([]string{"true"}, 0)},
		{sys: SysExecBash, op: ExecOpCall, cmd: `client.Run(sandbox, "main", "true")`, run: sessCall("main", "true", 0)},
		{sys: SysExecPython, op: ExecOpCall, cmd: `client.Run(sandbox, "py", "pass")`, run: sessCall("py", "pass", 0)},
		{sys: SysExecPlain, op: ExecOpOutSmall, cmd: fmt.Sprintf("client.Exec(sandbox, {argv: %q})", sh(small)), run: execCall(sh(small), small)},
		{sys: SysExecBash, op: ExecOpOutSmall, cmd: fmt.Sprintf("client.Run(sandbox, \"main\", %q)", execShellOutput(small)), run: sessCall("main", execShellOutput(small), small)},
		{sys: SysExecPython, op: ExecOpOutSmall, cmd: "client.Run(sandbox, \"py\", WRITE_1MB)", run: sessCall("py", execPythonOutput(small), small)},
		{sys: SysExecPlain, op: ExecOpOutLarge, cmd: fmt.Sprintf("client.Exec(sandbox, {argv: %q})", sh(large)), run: execCall(sh(large), large)},
		{sys: SysExecBash, op: ExecOpOutLarge, cmd: fmt.Sprintf("client.Run(sandbox, \"main\", %q)", execShellOutput(large)), run: sessCall("main", execShellOutput(large), large)},
		{sys: SysExecPython, op: ExecOpOutLarge, cmd: "client.Run(sandbox, \"py\", WRITE_100MB)", run: sessCall("py", execPythonOutput(large), large)},
	}
}

// execCheck checks an answer of want bytes of output: all of it when it fits in the
// 1 MiB kept, else a truncated answer whose marker (sessions) counts want bytes.
func execCheck(want, got int, truncated bool, out string) error {
	if want <= 1<<20 {
		if got != want || truncated {
			return fmt.Errorf("%d bytes of output (truncated %v), want %d", got, truncated, want)
		}
		return nil
	}
	if !truncated {
		return fmt.Errorf("%d bytes of output, not truncated: want %d bytes, truncated to 1 MiB", got, want)
	}
	if out != "" {
		m := execTotalRE.FindStringSubmatch(out)
		if m == nil || m[1] != strconv.Itoa(want) {
			return fmt.Errorf("the truncation marker says %v bytes in all, want %d", m, want)
		}
	}
	return nil
}

// podmanCases starts a container of the image's rootfs and returns the baseline's
// cases and how to remove it, or why it cannot run here.
func (r *execRun) podmanCases(ctx context.Context) ([]execCase, func(), string) {
	bin := r.o.Podman
	if bin == "" {
		var err error
		if bin, err = exec.LookPath("podman"); err != nil {
			return nil, nil, "podman is not installed (apt-get install podman)"
		}
	}
	rootfs := filepath.Join(r.o.Root, "images", r.o.Image, "rootfs")
	if _, err := os.Stat(rootfs); err != nil {
		return nil, nil, fmt.Sprintf("no rootfs of image %s to run: %v", r.o.Image, err)
	}
	name := "deltabox-bench-exec-" + randHex(3)
	// --rootfs DIR:O runs the image's own directory under an overlay (nothing written
	// to it). What podman needs on these VMs: runc (crun refuses the hybrid cgroup
	// layout), cgroupfs and a file event log (no systemd), no network, and rlimits no
	// higher than ours (no CAP_SYS_RESOURCE to raise them).
	out, err := deadline.Command(ctx, 2*time.Minute, bin, podmanArgs("run", "-d", "--name", name, "--network=none",
		"--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024", "--rootfs", rootfs+":O", "sleep", "infinity")...).CombinedOutput()
	if err != nil {
		deadline.Command(context.WithoutCancel(ctx), time.Minute, bin, podmanArgs("rm", "-f", name)...).Run()
		return nil, nil, fmt.Sprintf("podman run failed here: %v: %s", err, firstLine(string(out)))
	}
	stop := func() {
		if out, err := deadline.Command(context.WithoutCancel(ctx), time.Minute, bin, podmanArgs("rm", "-f", "-t", "0", name)...).CombinedOutput(); err != nil {
			r.logf("podman rm %s: %v: %s", name, err, firstLine(string(out)))
		}
	}
	run := func(want int, args ...string) func() (float64, error) {
		return func() (float64, error) {
			cmd := deadline.Command(ctx, 2*time.Minute, bin, podmanArgs(append([]string{"exec", name}, args...)...)...)
			var n countWriter
			var stderr strings.Builder
			cmd.Stdout, cmd.Stderr = &n, &stderr
			if err := cmd.Run(); err != nil {
				return 0, fmt.Errorf("%v: %s", err, firstLine(stderr.String()))
			}
			if int(n) != want {
				return 0, fmt.Errorf("%d bytes of output, want %d", n, want)
			}
			return -1, nil
		}
	}
	// A first exec proves it works before anything is timed.
	if _, err := run(0, "true")(); err != nil {
		stop()
		return nil, nil, fmt.Sprintf("podman exec failed here: %v", err)
	}
	small, large := 1000000, 100000000
	cmd := func(a ...string) string {
		return "podman " + ShellJoin(podmanGlobal) + " exec CONTAINER " + ShellJoin(a)
	}
	return []execCase{
		{sys: SysExecPodman, op: ExecOpCall, cmd: cmd("true"), run: run(0, "true")},
		{sys: SysExecPodman, op: ExecOpOutSmall, cmd: cmd("sh", "-c", execShellOutput(small)), run: run(small, "sh", "-c", execShellOutput(small))},
		{sys: SysExecPodman, op: ExecOpOutLarge, cmd: cmd("sh", "-c", execShellOutput(large)), run: run(large, "sh", "-c", execShellOutput(large))},
	}, stop, ""
}

// podmanGlobal are podman's global options for the baseline (podmanCases says why).
var podmanGlobal = []string{"--runtime", "runc", "--cgroup-manager=cgroupfs", "--events-backend=file"}

func podmanArgs(args ...string) []string {
	return append(append([]string(nil), podmanGlobal...), args...)
}

type countWriter int64

func (c *countWriter) Write(p []byte) (int, error) {
	*c += countWriter(len(p))
	return len(p), nil
}

func firstLine(s string) string {
	s = strings.TrimSpace(s)
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		s = s[:i]
	}
	return s
}

func (r *execRun) rows(cases []execCase, unavailable []Row) []Row {
	var rows []Row
	for _, op := range []string{ExecOpCall, ExecOpOutSmall, ExecOpOutLarge} {
		for _, cs := range cases {
			xs := r.s[cs.sys][cs.op]
			if cs.op != op || len(xs) == 0 {
				continue
			}
			row := Summarize(xs).Row(cs.sys, cs.op, 0, cs.cmd)
			if d := r.d[cs.sys][cs.op]; len(d) > 0 {
				row.Info = map[string]any{"daemon_p50_ms": us(Summarize(d).P50)}
			}
			rows = append(rows, row)
		}
		for _, u := range unavailable {
			if u.Op == op {
				rows = append(rows, u)
			}
		}
	}
	return rows
}

func execDescription(o ExecOptions) string {
	return fmt.Sprintf("What one command costs through the API, timed at the Go client (HTTP over the daemon's unix socket): `%s` "+
		"is POST /v1/sandboxes/{id}/exec (a new process in the sandbox per call: init spawns it, its stdout and stderr come back "+
		"over pipes); `%s` a call in the bash session `main` and `%s` one in a python session (code typed into the session's "+
		"terminal, output read back from it until the call's end marker); `%s` is `podman exec` into a running container of "+
		"the same image's rootfs (`--rootfs DIR:O`, `--network=none`, runc), the docker-exec-like baseline, where podman runs here "+
		"(scripts/setup.sh installs podman and runc). "+
		"Ops: `%s` is `true` (python: `pass`); `%s` and `%s` print 10^6 and 10^8 bytes (lines of 128 bytes: `yes LINE | head -c N`; "+
		"python: `sys.stdout.write` of 1 MiB blocks). DeltaBox keeps 1 MiB of a call's output (exec: the first MiB; sessions: "+
		"the first quarter and the last three quarters) and reads and drops the rest; the podman rows read all of it. Every "+
		"answer is checked (exit 0, the output's size, the truncation marker's count). The systems alternate sample by sample "+
		"within each op (%d, %d and %d samples), after one untimed call of each. `daemon_p50_ms` is the daemon's own "+
		"`duration_ms` of the call. Target: a bash session call's p50 within %d ms of a python session call's.",
		SysExecPlain, SysExecBash, SysExecPython, SysExecPodman, ExecOpCall, ExecOpOutSmall, ExecOpOutLarge,
		o.Samples, o.SamplesSmall, o.SamplesLarge, execTargetGapMS)
}

// FormatExecTarget says whether the exec bench met its target.
func FormatExecTarget(f *File) string {
	l, ok := execTarget(f.Results)
	if !ok {
		return ""
	}
	verdict := "met"
	if !l.Met {
		verdict = "MISSED"
	}
	return fmt.Sprintf("target %s: %s, %s\n", l.Target, l.Measured, verdict)
}
