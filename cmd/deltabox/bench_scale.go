package main

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"deltabox/internal/bench"
	"deltabox/internal/client"
)

func benchScaleCmd() *cobra.Command {
	o := bench.DefaultScaleOptions()
	var out, depths, workspaces, rss string
	c := &cobra.Command{
		Use:   "scale [--json FILE] [--depths 1,10,50,100,200,400] [--workspaces-mb 10,100,1024,4096] [--rss-mb 10,100,1024,2048]",
		Short: "Restore latency against tree depth, workspace size and session RSS",
		Long: `Times checkpoints and restores through the API (until the sandbox can run its next
exec) at points along three dimensions, each in its own sandboxes on the running daemon:
the depth of the restored node (a chain of checkpoints, one layer per level; warm
restores and cold ones into sandboxes that never mounted the node), the size of the
workspace (files written in the sandbox), and the heap of a live python session
(checkpointed and restored with the session alive). An empty list skips a dimension
(--rss-mb ''). Every sandbox and node the bench made is removed at the end, even on
failure.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			var err error
			fl := cmd.Flags()
			if fl.Changed("depths") {
				if o.Depths, err = intList("--depths", depths); err != nil {
					return err
				}
			}
			if fl.Changed("workspaces-mb") {
				if o.WorkspacesMB, err = intList("--workspaces-mb", workspaces); err != nil {
					return err
				}
			}
			if fl.Changed("rss-mb") {
				if o.RSSMB, err = intList("--rss-mb", rss); err != nil {
					return err
				}
			}
			if err := o.Check(); err != nil {
				return err
			}
			o.Socket = socketPath
			o.Command = "deltabox " + bench.ShellJoin(os.Args[1:])
			o.Log = os.Stderr
			f, err := bench.RunScale(ctx(), client.New(socketPath), o)
			return finishBench(f, err, out, func() string { return bench.FormatScaleTable(f.Results) })
		},
	}
	fl := c.Flags()
	// --json FILE here shadows the global --json switch.
	fl.StringVar(&out, "json", "", "write the results as JSON to FILE")
	fl.StringVar(&depths, "depths", intsFlag(o.Depths), "depths of the restored nodes, increasing (empty: skip)")
	fl.StringVar(&workspaces, "workspaces-mb", intsFlag(o.WorkspacesMB), "workspace sizes in MiB (empty: skip)")
	fl.StringVar(&rss, "rss-mb", intsFlag(o.RSSMB), "heap of the python session in MiB (empty: skip)")
	fl.IntVar(&o.Samples, "samples", o.Samples, "timed restores and timed checkpoints per point")
	fl.IntVar(&o.ColdSamples, "cold-samples", o.ColdSamples, "cold restores per depth and workspace point (a new sandbox each; 0: none)")
	fl.IntVar(&o.Files, "files", o.Files, "files written before every checkpoint and restore")
	fl.IntVar(&o.SmallFiles, "small-files", o.SmallFiles, "small files of a generated workspace (at most half of its bytes)")
	fl.IntVar(&o.LargeFiles, "large-files", o.LargeFiles, "large files holding the rest of a workspace's bytes")
	fl.Int64Var(&o.Seed, "seed", o.Seed, "seed of the workspaces and of the cold restores' order")
	fl.StringVar(&o.Image, "image", o.Image, "image of the bench's sandboxes")
	fl.StringArrayVar(&o.Notes, "note", nil, "a note to record in the results (repeatable), e.g. where the daemon runs")
	return c
}

// intList parses "1,10,50"; "" is the empty list.
func intList(flag, s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		v, err := strconv.Atoi(f)
		if err != nil || v < 1 {
			return nil, fmt.Errorf("%s %q: want positive integers like 1,10,50", flag, s)
		}
		out = append(out, v)
	}
	return out, nil
}

func intsFlag(v []int) string {
	var s []string
	for _, x := range v {
		s = append(s, strconv.Itoa(x))
	}
	return strings.Join(s, ",")
}
