package bench

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/criu"
)

// File is one benchmark's JSON output. Every bench writes this shape, so that
// `deltabox bench report` can turn any of them into tables.
type File struct {
	Bench string `json:"bench"`
	// Command is the command line that produced the file.
	Command string `json:"command"`
	// Description says, in markdown, what was measured and how; the report prints it.
	Description string         `json:"description,omitempty"`
	Machine     Machine        `json:"machine"`
	Started     time.Time      `json:"started"`
	Finished    time.Time      `json:"finished"`
	DurationS   float64        `json:"duration_s"`
	Settings    map[string]any `json:"settings,omitempty"`
	Results     []Row          `json:"results"`
	Targets     []Target       `json:"targets,omitempty"`
	// Workspaces describes the workspaces of a filesystem bench (one per size).
	Workspaces []Workspace `json:"workspaces,omitempty"`
	// MCTS holds the rows of `bench mcts` (end-to-end tree search), which are not
	// latency distributions.
	MCTS  []MCTSRow `json:"mcts,omitempty"`
	Notes []string  `json:"notes,omitempty"`
}

// Row is one measured operation of one system.
type Row struct {
	System      string  `json:"system"`
	Op          string  `json:"op"`
	WorkspaceMB int     `json:"workspace_mb,omitempty"`
	P50         float64 `json:"p50_ms"`
	P95         float64 `json:"p95_ms"`
	P99         float64 `json:"p99_ms"`
	Mean        float64 `json:"mean_ms"`
	Min         float64 `json:"min_ms"`
	Max         float64 `json:"max_ms"`
	N           int     `json:"n"`
	// Layers is the depth (layers in the mounted stack, image excluded) over the
	// samples; null where the system has no layers.
	Layers *Layers `json:"layers"`
	// Commands are the exact commands or API calls inside the timed interval, in order.
	Commands []string `json:"commands"`
	// Info holds row-specific details (daemon-side time, phases, counts).
	Info map[string]any `json:"info,omitempty"`
}

// MCTSRow is one system's run of the same search trajectory in `bench mcts`.
type MCTSRow struct {
	System string  `json:"system"`
	ThinkS float64 `json:"think_s"`
	TotalS float64 `json:"total_s"`
	// StateS is the time spent in state management (checkpoints, rollbacks, replays).
	StateS float64 `json:"state_s"`
	// OverheadFrac = (total - think - the same commands' time in an isolated run) / total.
	OverheadFrac float64 `json:"overhead_frac"`
	// ScoresMatch says every node reached the score it has in the reference run.
	ScoresMatch bool `json:"scores_match"`
	// Commands are the exact commands or API calls the system used for state management.
	Commands []string       `json:"commands"`
	Info     map[string]any `json:"info,omitempty"`
}

// UnavailableRows are the rows of a system that could not run here: no samples, and
// Info["unavailable"] says why. The reports print the reason where the figures would be.
func UnavailableRows(system string, mb int, reason string, ops ...string) []Row {
	var rows []Row
	for _, op := range ops {
		rows = append(rows, Row{System: system, Op: op, WorkspaceMB: mb, Info: map[string]any{"unavailable": reason}})
	}
	return rows
}

// Unavailable is why the row's system could not run ("" if it ran).
func (r Row) Unavailable() string {
	s, _ := r.Info["unavailable"].(string)
	return s
}

// Unavailable is why the row's system could not run ("" if it ran).
func (r MCTSRow) Unavailable() string {
	s, _ := r.Info["unavailable"].(string)
	return s
}

// criuNote says how CRIU ran, for a bench's notes.
func criuNote(r *criu.Runner) string {
	switch r.Mode {
	case criu.Plain:
		return fmt.Sprintf("ran plainly (%s); its self-test took %.2f s", r.Bin, r.ProbeS)
	case criu.NoBreakpoints:
		return fmt.Sprintf("every CRIU command ran with %s (%s), CRIU's no-breakpoints mode (PTRACE_SYSCALL stops); "+
			"its self-test took %.2f s: %s", criu.NoBreakpointsEnv, r.Bin, r.ProbeS, r.Reason)
	}
	return fmt.Sprintf("unusable here, so its rows are marked unavailable (self-test %.2f s): %s", r.ProbeS, r.Reason)
}

// Layers summarises stack depths.
type Layers struct {
	Min  int     `json:"min"`
	P50  int     `json:"p50"`
	Mean float64 `json:"mean"`
	Max  int     `json:"max"`
}

// Target is a goal a row's statistic must meet: Row.<Stat> <= MaxMS for every row of
// System and Op.
type Target struct {
	System string  `json:"system"`
	Op     string  `json:"op"`
	Stat   string  `json:"stat"` // p50_ms, p95_ms or p99_ms
	MaxMS  float64 `json:"max_ms"`
}

// Value returns the row's statistic named stat (p50_ms, p95_ms, p99_ms, mean_ms, max_ms).
func (r Row) Value(stat string) (float64, bool) {
	switch stat {
	case "p50_ms":
		return r.P50, true
	case "p95_ms":
		return r.P95, true
	case "p99_ms":
		return r.P99, true
	case "mean_ms":
		return r.Mean, true
	case "max_ms":
		return r.Max, true
	}
	return 0, false
}

// Machine describes where a bench ran.
type Machine struct {
	Kernel       string  `json:"kernel"`
	CPUs         int     `json:"cpus"`
	CPUModel     string  `json:"cpu_model,omitempty"`
	MemMB        int     `json:"mem_mb,omitempty"`
	Date         string  `json:"date"`
	GoVersion    string  `json:"go_version"`
	Revision     string  `json:"revision,omitempty"` // VCS revision of the bench binary
	LoadAvgStart float64 `json:"loadavg_start"`      // 1-minute load average
	LoadAvgEnd   float64 `json:"loadavg_end"`
	StoreFS      string  `json:"store_fs,omitempty"`
	Python       string  `json:"python,omitempty"`
	// CRIU is how CRIU ran (criu.Probe's answer), where a CRIU baseline was asked for.
	CRIU *criu.Runner `json:"criu,omitempty"`
}

// Revision is the VCS revision of the binary, set with
// -ldflags "-X deltabox/internal/bench.Revision=..." (GOFLAGS may disable VCS stamping).
var Revision string

// CurrentMachine collects what can be known about this machine now.
func CurrentMachine() Machine {
	m := Machine{CPUs: runtime.NumCPU(), Date: time.Now().UTC().Format(time.RFC3339), GoVersion: runtime.Version()}
	var u unix.Utsname
	if unix.Uname(&u) == nil {
		m.Kernel = unix.ByteSliceToString(u.Sysname[:]) + " " + unix.ByteSliceToString(u.Release[:]) + " " + unix.ByteSliceToString(u.Machine[:])
	}
	m.CPUModel = procField("/proc/cpuinfo", "model name")
	if v := procField("/proc/meminfo", "MemTotal"); v != "" {
		if kb, err := strconv.Atoi(strings.Fields(v)[0]); err == nil {
			m.MemMB = kb / 1024
		}
	}
	m.LoadAvgStart = LoadAvg()
	if bi, ok := debug.ReadBuildInfo(); ok {
		var rev, dirty string
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				rev = s.Value
			case "vcs.modified":
				if s.Value == "true" {
					dirty = "+modified"
				}
			}
		}
		if len(rev) > 12 {
			rev = rev[:12]
		}
		if rev != "" {
			m.Revision = rev + dirty
		}
	}
	if Revision != "" {
		m.Revision = Revision
	}
	return m
}

// LoadAvg is the 1-minute load average (0 if unknown).
func LoadAvg() float64 {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 0
	}
	v, _ := strconv.ParseFloat(f[0], 64)
	return v
}

func procField(path, key string) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if ok && strings.TrimSpace(k) == key {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

// fsType names the filesystem of path.
func fsType(path string) string {
	var st unix.Statfs_t
	if unix.Statfs(path, &st) != nil {
		return ""
	}
	switch st.Type {
	case 0x58465342:
		return "xfs"
	case 0x9123683e:
		return "btrfs"
	case 0xef53:
		return "ext4"
	case 0x01021994:
		return "tmpfs"
	case 0x794c7630:
		return "overlay"
	}
	return fmt.Sprintf("0x%x", st.Type)
}

// WriteFile writes f as indented JSON to path (atomically: temp file, rename).
func WriteFile(path string, f *File) error {
	b, err := json.MarshalIndent(f, "", "  ")
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, append(b, '\n'), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// ReadFile reads a bench's JSON output.
func ReadFile(path string) (*File, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var f File
	if err := json.Unmarshal(b, &f); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return &f, nil
}

// ShellJoin quotes args so that a recorded command line can be pasted into a shell.
func ShellJoin(args []string) string {
	var out []string
	for _, a := range args {
		if a != "" && strings.Trim(a, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_=.,/:+@%") == "" {
			out = append(out, a)
		} else {
			out = append(out, "'"+strings.ReplaceAll(a, "'", `'\''`)+"'")
		}
	}
	return strings.Join(out, " ")
}

// progress writes one line of a bench's progress to w (nil: none), stamped with the
// seconds since start.
func progress(w io.Writer, start time.Time, format string, a ...any) {
	if w != nil {
		fmt.Fprintf(w, "[%7.1fs] %s\n", time.Since(start).Seconds(), fmt.Sprintf(format, a...))
	}
}
