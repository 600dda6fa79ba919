package main

import (
	"os"

	"github.com/spf13/cobra"

	"deltabox/internal/bench"
	"deltabox/internal/client"
)

func benchWarmCmd() *cobra.Command {
	o := bench.DefaultWarmOptions()
	var out string
	c := &cobra.Command{
		Use:   "warm [--json FILE]",
		Short: "Measure the async warm-up of restored processes, off and on",
		Long: `Creates sandboxes on the running daemon, alternately without and with warm_processes,
each with a python session holding a --heap-mb heap, checkpointed once. Times the restore,
the first command after it that writes one byte in every page of the heap (at once, and
after a --pause-ms pause, the warm-up's window), the same command once its pages are
private, and a restore after a pause and a one-page command (what the warm-up costs the
next restore). Sandboxes and nodes are removed at the end, even on failure.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := o.Validate(); err != nil {
				return err
			}
			o.Command = "deltabox " + bench.ShellJoin(os.Args[1:])
			o.Log = os.Stderr
			f, err := bench.RunWarm(ctx(), client.New(socketPath), o)
			return finishBench(f, err, out, func() string { return bench.FormatTable(f.Results) })
		},
	}
	fl := c.Flags()
	// --json FILE here shadows the global --json switch.
	fl.StringVar(&out, "json", "", "write the results as JSON to FILE")
	fl.IntVar(&o.HeapMB, "heap-mb", o.HeapMB, "the python session's heap in MiB")
	fl.IntVar(&o.Samples, "samples", o.Samples, "samples of each op per system and round")
	fl.IntVar(&o.Rounds, "rounds", o.Rounds, "rounds; the systems alternate in each")
	fl.IntVar(&o.PauseMS, "pause-ms", o.PauseMS, "pause between a restore and its command (an agent thinking)")
	fl.StringVar(&o.Image, "image", o.Image, "image of the bench's sandboxes")
	fl.StringArrayVar(&o.Notes, "note", nil, "a note to record in the results (repeatable), e.g. where the daemon runs")
	return c
}
