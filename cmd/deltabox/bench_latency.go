package main

import (
	"os"
	"strings"

	"github.com/spf13/cobra"

	"deltabox/internal/bench"
	"deltabox/internal/client"
)

func benchLatencyCmd() *cobra.Command {
	o := bench.DefaultLatencyOptions()
	var out, baselines string
	var noBaselines bool
	c := &cobra.Command{
		Use:   "latency [--json FILE]",
		Short: "Time checkpoints and restores of files and processes beside CRIU and replay baselines",
		Long: `Creates a sandbox on the running daemon with a workspace (--workspace-mb, the bench fs
generator) and a python session holding a --heap-mb heap, then times checkpoints and
restores through the API (a chain of --chain checkpoints, then --restores restores to
random nodes, each followed by a branch checkpoint), with --step-mb of the heap and
--changes files changed before every operation; then forks the sandbox once and
restores the fork's node --spare-restores times in its branch, each from a spare made
ahead (restore-spare). Beside it, in the same run: CRIU dump
and restore of a host python3 with the same heap (images on tmpfs), copytree+replay
(cp -a --reflink=auto of the workspace, a fresh python and a replay of the node's
commands) and fs-only+replay (DeltaBox nodes without process state, the session
started again and replayed). Sandboxes, nodes, host copies, CRIU images and host
processes are removed at the end, even on failure. CRIU runs the way its self-test
(a timed dump of a sleep) found to work here: plainly, or with CRIU_FAULT=130 where
the machine does not deliver hardware breakpoints; where neither works, its rows say
unavailable and why. The output names the mode.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			o.Baselines = nil
			if !noBaselines && baselines != "" {
				for _, b := range strings.Split(baselines, ",") {
					o.Baselines = append(o.Baselines, strings.TrimSpace(b))
				}
			}
			if err := o.Validate(); err != nil {
				return err
			}
			if o.HostDir == "" {
				o.HostDir = benchHostDir("bench-latency")
			}
			o.Socket = socketPath
			o.Command = "deltabox " + bench.ShellJoin(os.Args[1:])
			o.Log = os.Stderr
			f, err := bench.RunLatency(ctx(), client.New(socketPath), o)
			return finishBench(f, err, out, func() string { return bench.FormatTable(f.Results) + bench.FormatTargets(f) })
		},
	}
	fl := c.Flags()
	// --json FILE here shadows the global --json switch.
	fl.StringVar(&out, "json", "", "write the results as JSON to FILE")
	fl.IntVar(&o.WorkspaceMB, "workspace-mb", o.WorkspaceMB, "workspace size in MiB")
	fl.IntVar(&o.SmallFiles, "small-files", o.SmallFiles, "small files in the workspace (at most half of its bytes)")
	fl.IntVar(&o.LargeFiles, "large-files", o.LargeFiles, "large files holding the rest of the bytes")
	fl.IntVar(&o.HeapMB, "heap-mb", o.HeapMB, "the python session's heap, in 1 MiB objects")
	fl.IntVar(&o.StepMB, "step-mb", o.StepMB, "MiB of the heap each step rewrites")
	fl.IntVar(&o.Changes, "changes", o.Changes, "files each step changes")
	fl.IntVar(&o.LargeEvery, "large-every", o.LargeEvery, "every N-th step also writes 64 KiB into a large file (0: never)")
	fl.IntVar(&o.Chain, "chain", o.Chain, "checkpoints of the initial chain")
	fl.IntVar(&o.Restores, "restores", o.Restores, "restores to random nodes, each followed by a branch checkpoint")
	fl.IntVar(&o.SpareRestores, "spare-restores", o.SpareRestores, "after the rest: the sandbox forked once, then this many restores of the fork's node in its branch, each from a spare (restore-spare; 0: none)")
	fl.IntVar(&o.MaxNodes, "max-nodes", o.MaxNodes, "nodes the tree keeps (random leaves are removed between operations, untimed)")
	fl.Int64Var(&o.Seed, "seed", o.Seed, "seed of the workload and of the restore targets")
	fl.IntVar(&o.BaselineCheckpoints, "baseline-checkpoints", o.BaselineCheckpoints, "checkpoints per baseline")
	fl.IntVar(&o.BaselineRestores, "baseline-restores", o.BaselineRestores, "restores per baseline")
	fl.IntVar(&o.CRIUKeep, "criu-keep", o.CRIUKeep, "CRIU image sets kept on tmpfs (the restore targets)")
	fl.StringVar(&baselines, "baselines", strings.Join(bench.LatencyBaselines, ","), "baselines to run, comma-separated")
	fl.BoolVar(&noBaselines, "no-baselines", false, "run deltabox only")
	fl.StringVar(&o.Image, "image", o.Image, "image of the bench's sandboxes")
	fl.StringVar(&o.HostDir, "host-dir", "", "directory for copytree's workspace and snapshots, on the store's filesystem (default: tmp/bench-latency-PID in the state directory, env DELTABOX_ROOT)")
	fl.StringVar(&o.TmpfsDir, "tmpfs-dir", o.TmpfsDir, "directory for CRIU's images (tmpfs)")
	fl.StringVar(&o.CRIU, "criu", "", "CRIU binary (default: the one scripts/setup.sh builds, else criu on PATH)")
	fl.StringVar(&o.Python, "python", "", "host python3 for the baselines' process (default: sys.executable of python3 on PATH)")
	fl.StringArrayVar(&o.Notes, "note", nil, "a note to record in the results (repeatable), e.g. where the daemon runs")
	return c
}
