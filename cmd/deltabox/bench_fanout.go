package main

import (
	"os"

	"github.com/spf13/cobra"

	"deltabox/internal/bench"
	"deltabox/internal/client"
	"deltabox/internal/store"
)

func benchFanoutCmd() *cobra.Command {
	o := bench.DefaultFanoutOptions()
	var out string
	var noReplay, noPodman bool
	c := &cobra.Command{
		Use:   "fanout [--json FILE] [--counts 1,8,32,64]",
		Short: "Measure forks of one node into N live sandboxes (POST /v1/nodes/ID/fork) beside a files-only fork with replay",
		Long: `Creates a sandbox on the running daemon with a python session holding a --heap-mb heap and a
--workspace-mb workspace, checkpoints it and waits for its durable image. Then, for each
--counts N, forks the node into N sandboxes, timed until every branch's python has
answered its first call, beside the same fork with files only and the session's code
replayed in each branch, a fork of a fresh source made the same way by
POST /v1/sandboxes/ID/fork (deltabox-fast: the fast path unless the daemon runs with
DELTABOX_FORK_FAST=0), a fork of that fork's node again (deltabox-family: its family's
holder keeps its templates, so the fast path too, by the request of the deltabox row),
and podman (where it runs here): a container of the same python
exported once by podman container checkpoint and restored N times by podman container
restore --import. Branches, containers and the sources are removed at the end.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			o.Replay = !noReplay
			o.Podman = !noPodman
			if o.Root = os.Getenv("DELTABOX_ROOT"); o.Root == "" {
				o.Root = store.DefaultRoot
			}
			if err := o.Validate(); err != nil {
				return err
			}
			o.Command = "deltabox " + bench.ShellJoin(os.Args[1:])
			o.Log = os.Stderr
			f, err := bench.RunFanout(ctx(), client.New(socketPath), o)
			return finishBench(f, err, out, func() string { return bench.FormatTable(f.Results) })
		},
	}
	fl := c.Flags()
	fl.StringVar(&out, "json", "", "write the results as JSON to FILE")
	fl.IntSliceVar(&o.Counts, "counts", o.Counts, "branches per fork (comma-separated: one fork each)")
	fl.IntVar(&o.HeapMB, "heap-mb", o.HeapMB, "the python session's heap in MiB")
	fl.IntVar(&o.WorkspaceMB, "workspace-mb", o.WorkspaceMB, "MiB of files in the workspace")
	fl.StringVar(&o.Image, "image", o.Image, "image of the bench's sandbox")
	fl.BoolVar(&noReplay, "no-replay", false, "skip the files+replay baseline")
	fl.BoolVar(&noPodman, "no-podman", false, "skip the podman checkpoint/restore baseline")
	fl.StringArrayVar(&o.Notes, "note", nil, "a note to record in the results (repeatable)")
	return c
}
