package main

import (
	"os"

	"github.com/spf13/cobra"

	"deltabox/internal/bench"
	"deltabox/internal/client"
)

func benchDurableCmd() *cobra.Command {
	o := bench.DefaultDurableOptions()
	var out string
	c := &cobra.Command{
		Use:   "durable [--json FILE]",
		Short: "Measure durable process images: bytes per checkpoint, restores from an image",
		Long: `Creates a sandbox on the running daemon with a python session holding a --heap-mb heap
(each size in turn), makes --checkpoints checkpoints, each after --step-mb of the heap
changed, and waits for their durable images. Reports the bytes each image added to the
page store beside its full CRIU images; then --restores restores whose templates were
evicted (they come back from the image), eagerly and lazily (lazy_image), timed until the
first session call after them returns and until a call that reads the whole heap returns,
beside the same restores from templates and plain CRIU restores of a host python
with the same heap, in the same run. Sandboxes and nodes are removed at the end.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := o.Validate(); err != nil {
				return err
			}
			o.Command = "deltabox " + bench.ShellJoin(os.Args[1:])
			o.Log = os.Stderr
			f, err := bench.RunDurable(ctx(), client.New(socketPath), o)
			return finishBench(f, err, out, func() string { return bench.FormatTable(f.Results) })
		},
	}
	fl := c.Flags()
	fl.StringVar(&out, "json", "", "write the results as JSON to FILE")
	fl.IntSliceVar(&o.HeapMB, "heap-mb", o.HeapMB, "the python session's heap in MiB (comma-separated: one run per size)")
	fl.IntVar(&o.Checkpoints, "checkpoints", o.Checkpoints, "checkpoints per run")
	fl.IntVar(&o.StepMB, "step-mb", o.StepMB, "MiB of the heap rewritten before each checkpoint")
	fl.IntVar(&o.Restores, "restores", o.Restores, "restores from the image (and from templates, and plain CRIU)")
	fl.StringVar(&o.Image, "image", o.Image, "image of the bench's sandbox")
	fl.StringVar(&o.Python, "python", o.Python, "host python3 for the plain CRIU baseline")
	fl.StringVar(&o.TmpfsDir, "tmpfs-dir", o.TmpfsDir, "directory for plain CRIU's images (tmpfs)")
	fl.StringVar(&o.CRIU, "criu", "", "CRIU binary (default: the one scripts/setup.sh builds, else criu on PATH)")
	fl.StringArrayVar(&o.Notes, "note", nil, "a note to record in the results (repeatable)")
	return c
}
