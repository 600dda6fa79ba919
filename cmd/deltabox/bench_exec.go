package main

import (
	"os"

	"github.com/spf13/cobra"

	"deltabox/internal/bench"
	"deltabox/internal/client"
	"deltabox/internal/store"
)

func benchExecCmd() *cobra.Command {
	o := bench.DefaultExecOptions()
	var out string
	var noBaseline bool
	c := &cobra.Command{
		Use:   "exec [--json FILE]",
		Short: "Time a trivial command and 1 MB / 100 MB outputs through exec and the sessions, beside podman exec",
		Long: `Creates a sandbox on the running daemon with a python session beside the bash session
"main", and times, as the client sees them: a trivial call (true; python: pass) and calls
that print 10^6 and 10^8 bytes, through exec (a new process each), the bash session and
the python session. Beside them, where podman runs here, podman exec into a container of
the same image's rootfs (--rootfs DIR:O, no network); where it does not, its rows say
unavailable and why. The systems alternate sample by sample. The sandbox and the
container are removed at the end, even on failure. Target: a bash session call's p50
within 2 ms of a python session call's.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := o.Validate(); err != nil {
				return err
			}
			o.Baseline = !noBaseline
			if o.Root = os.Getenv("DELTABOX_ROOT"); o.Root == "" {
				o.Root = store.DefaultRoot
			}
			o.Command = "deltabox " + bench.ShellJoin(os.Args[1:])
			o.Log = os.Stderr
			f, err := bench.RunExec(ctx(), client.New(socketPath), o)
			return finishBench(f, err, out, func() string { return bench.FormatTable(f.Results) + bench.FormatExecTarget(f) })
		},
	}
	fl := c.Flags()
	// --json FILE here shadows the global --json switch.
	fl.StringVar(&out, "json", "", "write the results as JSON to FILE")
	fl.IntVar(&o.Samples, "samples", o.Samples, "trivial calls per system")
	fl.IntVar(&o.SamplesSmall, "samples-1mb", o.SamplesSmall, "1 MB calls per system")
	fl.IntVar(&o.SamplesLarge, "samples-100mb", o.SamplesLarge, "100 MB calls per system")
	fl.BoolVar(&noBaseline, "no-baseline", false, "skip podman exec")
	fl.StringVar(&o.Podman, "podman", "", "podman binary (default: podman on PATH)")
	fl.StringVar(&o.Image, "image", o.Image, "image of the bench's sandbox and container")
	fl.StringArrayVar(&o.Notes, "note", nil, "a note to record in the results (repeatable), e.g. where the daemon runs")
	return c
}
