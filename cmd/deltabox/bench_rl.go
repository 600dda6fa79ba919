package main

import (
	"os"
	"strings"

	"github.com/spf13/cobra"

	"deltabox/internal/bench"
	"deltabox/internal/client"
	"deltabox/internal/store"
)

func benchRLCmd() *cobra.Command {
	o := bench.DefaultRLOptions()
	var out, branches, systems, modes string
	c := &cobra.Command{
		Use:   "rl [--json FILE] [--branches 8,32,64] [--policy-ms 500]",
		Short: "Measure an RL trainer's loop: how busy a simulated GPU stays while B branches act and reset, beside CRIU, copytree+replay and podman",
		Long: `Per step: --policy-ms of simulated generation (a sleep standing for the GPU), then one action
in each of B branches and a reset of each to the step's start state, the branches at once.
Reports the step's wall time and the GPU's busy fraction (policy / wall) for DeltaBox
(a sandbox and python session per branch, reset by restore), CRIU (a python3 per branch
on the host, reset by kill and criu restore; process only), deltabox-fork (each step forks B
sandboxes from one node, processes included), copytree+replay (reset by
copying the workspace back and rebuilding the heap in a fresh python3) and podman (a
container per branch, reset by podman container restore --import of its checkpoint). --modes
serial,overlap adds the pipelined trainer's loop, where each branch's reset runs during the
next step's policy, for every system. Needs root for
CRIU. Every sandbox, node and host process the bench made is removed at the end.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			var err error
			if cmd.Flags().Changed("branches") {
				if o.Branches, err = intList("--branches", branches); err != nil {
					return err
				}
			}
			if cmd.Flags().Changed("systems") {
				o.Systems = nil
				for _, s := range strings.Split(systems, ",") {
					if s = strings.TrimSpace(s); s != "" {
						o.Systems = append(o.Systems, s)
					}
				}
			}
			if cmd.Flags().Changed("modes") {
				o.Modes = nil
				for _, m := range strings.Split(modes, ",") {
					if m = strings.TrimSpace(m); m != "" {
						o.Modes = append(o.Modes, m)
					}
				}
			}
			if err := o.Validate(); err != nil {
				return err
			}
			o.Command = "deltabox " + bench.ShellJoin(os.Args[1:])
			o.Log = os.Stderr
			o.Socket = socketPath
			if o.Root = os.Getenv("DELTABOX_ROOT"); o.Root == "" {
				o.Root = store.DefaultRoot
			}
			f, err := bench.RunRL(ctx(), client.New(socketPath), o)
			return finishBench(f, err, out, func() string { return bench.FormatTable(f.Results) })
		},
	}
	fl := c.Flags()
	fl.StringVar(&out, "json", "", "write the results as JSON to FILE")
	fl.StringVar(&branches, "branches", intsFlag(o.Branches), "branch counts B")
	fl.StringVar(&systems, "systems", strings.Join(o.Systems, ","), "systems to run")
	fl.StringVar(&modes, "modes", strings.Join(o.Modes, ","), "trainer loops: serial (policy, then act and reset), overlap (resets during the next policy)")
	fl.IntVar(&o.PolicyMS, "policy-ms", o.PolicyMS, "simulated policy time per step (ms)")
	fl.IntVar(&o.Steps, "steps", o.Steps, "timed steps per point (after one untimed)")
	fl.IntVar(&o.HeapMB, "heap-mb", o.HeapMB, "each branch's python heap (MiB)")
	fl.IntVar(&o.WorkspaceMB, "workspace-mb", o.WorkspaceMB, "each branch's workspace (MiB)")
	fl.StringVar(&o.Image, "image", o.Image, "image of the bench's sandboxes")
	fl.StringVar(&o.CRIU, "criu", o.CRIU, "criu binary (default: the daemon's)")
	fl.StringArrayVar(&o.Notes, "note", nil, "a note to record in the results (repeatable)")
	return c
}
