package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"deltabox/internal/bench"
	"deltabox/internal/client"
	"deltabox/internal/store"
)

func benchCmd() *cobra.Command {
	c := &cobra.Command{Use: "bench", Short: "Measure DeltaBox beside its baselines"}
	c.AddCommand(benchFSCmd(), benchLatencyCmd(), benchMCTSCmd(), benchScaleCmd(), benchWarmCmd(), benchExecCmd(), benchDurableCmd(), benchReportCmd(), benchAPICmd(), benchNetCmd(), benchRLCmd(), benchFanoutCmd())
	return c
}

func benchFSCmd() *cobra.Command {
	o := bench.DefaultFSOptions()
	var out, sizes string
	var workspaceMB int
	var noBaselines bool
	c := &cobra.Command{
		Use:   "fs [--json FILE] [--sizes 10,1024]",
		Short: "Time filesystem checkpoints and restores through the API, beside cp -a copies of the workspace",
		Long: `Creates a sandbox on the running daemon, writes a workspace into it (about 20,000
small files and a few large ones), builds a snapshot tree (a chain of checkpoints to
depth --depth, each after --changes changed files, then --restores restores to random
nodes with branch checkpoints), and times every call as the client sees it. The same
workspace is then copied on the host with cp -a --reflink=never (copytree) and
cp --reflink=auto -a (cp-reflink), with the same changes between operations.
The sandbox, its nodes and the host copies are removed at the end, even on failure.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			o.SizesMB = []int{workspaceMB}
			if sizes != "" {
				o.SizesMB = nil
				for _, s := range strings.Split(sizes, ",") {
					v, err := strconv.Atoi(strings.TrimSpace(s))
					if err != nil || v < 1 {
						return fmt.Errorf("--sizes %q: want MiB values like 10,1024", sizes)
					}
					o.SizesMB = append(o.SizesMB, v)
				}
			}
			if o.Checkpoints < 0 || o.Restores < 0 || o.Changes < 1 || o.MaxDepth < 1 || o.BaselineRuns < 1 {
				return fmt.Errorf("--checkpoints and --restores must be >= 0, --changes, --depth and --baseline-runs >= 1")
			}
			o.Baselines = !noBaselines
			if o.HostDir == "" {
				o.HostDir = benchHostDir("bench-fs")
			}
			o.Socket = socketPath
			o.Command = "deltabox " + bench.ShellJoin(os.Args[1:])
			o.Log = os.Stderr
			f, err := bench.RunFS(ctx(), client.New(socketPath), o)
			return finishBench(f, err, out, func() string { return bench.FormatTable(f.Results) + bench.FormatTargets(f) })
		},
	}
	fl := c.Flags()
	// --json FILE here shadows the global --json switch.
	fl.StringVar(&out, "json", "", "write the results as JSON to FILE")
	fl.IntVar(&workspaceMB, "workspace-mb", 1024, "workspace size in MiB")
	fl.StringVar(&sizes, "sizes", "", "comma-separated workspace sizes in MiB, run one after the other (overrides --workspace-mb)")
	fl.IntVar(&o.SmallFiles, "small-files", o.SmallFiles, "small files in the workspace (at most half of its bytes)")
	fl.IntVar(&o.LargeFiles, "large-files", o.LargeFiles, "large files holding the rest of the bytes")
	fl.IntVar(&o.Checkpoints, "checkpoints", o.Checkpoints, "timed checkpoints per size")
	fl.IntVar(&o.Restores, "restores", o.Restores, "timed restores per size")
	fl.IntVar(&o.Changes, "changes", o.Changes, "files changed before each checkpoint and each restore")
	fl.IntVar(&o.MaxDepth, "depth", o.MaxDepth, "depth of the main chain; restores go to nodes of depth 1..depth")
	fl.IntVar(&o.LargeEvery, "large-every", o.LargeEvery, "every N-th change step also writes 64 KiB into a large file (0: never)")
	fl.Int64Var(&o.Seed, "seed", o.Seed, "seed of the workload and of the restore targets")
	fl.IntVar(&o.BaselineRuns, "baseline-runs", o.BaselineRuns, "timed checkpoints and restores per copy baseline and size")
	fl.IntVar(&o.BaselineKeep, "baseline-keep", o.BaselineKeep, "snapshots each copy baseline keeps (older ones are deleted, untimed)")
	fl.BoolVar(&noBaselines, "no-baselines", false, "skip the copy baselines")
	fl.StringVar(&o.Image, "image", o.Image, "image of the bench's sandbox")
	fl.StringArrayVar(&o.Notes, "note", nil, "a note to record in the results (repeatable), e.g. where the daemon runs")
	fl.StringVar(&o.HostDir, "host-dir", "", "directory for the baselines' copies, on the store's filesystem (default: tmp/bench-fs-PID in the state directory, env DELTABOX_ROOT)")
	return c
}

func benchReportCmd() *cobra.Command {
	var dir, out string
	c := &cobra.Command{
		Use:   "report [--dir bench-results] [--out docs/BENCHMARKS.md]",
		Short: "Turn the JSON results of the benches into docs/BENCHMARKS.md",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := bench.WriteReport(dir, out); err != nil {
				return err
			}
			fmt.Println("wrote", out)
			return nil
		},
	}
	c.Flags().StringVar(&dir, "dir", "bench-results", "directory of *.json bench results")
	c.Flags().StringVar(&out, "out", "docs/BENCHMARKS.md", "markdown file to write")
	return c
}

// finishBench prints a bench's table (when it has results, even after a failure: what
// was measured is shown), its notes and duration, then writes the JSON to out.
func finishBench(f *bench.File, err error, out string, table func() string) error {
	if f != nil && len(f.Results) > 0 {
		fmt.Print(table())
		for _, n := range f.Notes {
			fmt.Println("note:", n)
		}
		fmt.Printf("took %.0f s\n", f.DurationS)
	}
	if err != nil {
		return err
	}
	if out != "" {
		if err := bench.WriteFile(out, f); err != nil {
			return err
		}
		fmt.Fprintln(os.Stderr, "wrote", out)
	}
	return nil
}

// benchHostDir is where a bench's host-side copies go by default: the store's tmp/
// (DELTABOX_ROOT or the default state directory), so that cp --reflink can share extents.
func benchHostDir(name string) string {
	root := os.Getenv("DELTABOX_ROOT")
	if root == "" {
		root = store.DefaultRoot
	}
	return filepath.Join(root, "tmp", fmt.Sprintf("%s-%d", name, os.Getpid()))
}
