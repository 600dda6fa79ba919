package main

import (
	"fmt"
	"os"
	"time"

	"github.com/spf13/cobra"

	"deltabox/internal/apitypes"
)

func forkCmd() *cobra.Command {
	var q apitypes.ForkRequest
	var memory string
	var imageWait time.Duration
	c := &cobra.Command{
		Use:   "fork NODE --count N [--name ID] [--workdir DIR] [--memory 2G] [--pids 512] [--cpus 1.5] [--processes auto|require|never]",
		Short: "Make N sandboxes on a node, its processes carried at their PIDs where a path can; prints each branch's id, path and why",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			var err error
			if q.MemoryMB, err = parseMemoryMB(memory); err != nil {
				return err
			}
			q.ImageWaitMS = imageWait.Milliseconds()
			r, err := cli().Fork(ctx(), args[0], q)
			if err != nil {
				return err
			}
			if jsonOut {
				printJSON(r)
				return nil
			}
			for _, b := range r.Branches {
				fmt.Printf("%s\t%s\t%d processes\t%s\n", b.Sandbox.ID, b.Path, b.Restore.Processes, b.Reason)
				printWarnings(b.Restore)
			}
			fmt.Fprintf(os.Stderr, "deltabox: %d branches of %s in %.0f ms (%.0f ms waiting for its durable image)\n", len(r.Branches), r.Node, r.DurationMS, r.ImageWaitMS)
			return nil
		},
	}
	c.Flags().IntVar(&q.Count, "count", 1, "how many sandboxes")
	c.Flags().StringVar(&q.ID, "name", "", "name the branches NAME-0, NAME-1, ... (NAME with --count 1; default: generated ids)")
	c.Flags().StringVar(&q.Workdir, "workdir", "", "working directory of commands (default: that of the sandbox that made the node, else /workspace)")
	c.Flags().StringVar(&memory, "memory", "", "each branch's memory limit, e.g. 512M, 2G (as create's)")
	c.Flags().Int64Var(&q.Pids, "pids", 0, "each branch's limit on processes and threads (default 1024)")
	c.Flags().Float64Var(&q.CPUs, "cpus", 0, "each branch's CPU limit (default: none)")
	c.Flags().StringVar(&q.Processes, "processes", "auto", "auto: carry the node's processes where a path can, else its files with the reason; require: fail rather than fall back; never: files only")
	c.Flags().DurationVar(&imageWait, "image-wait", 0, "wait up to this long for the node's durable image while it is written (0: 2m)")
	return c
}
