package main

import (
	"os"

	"github.com/spf13/cobra"

	"deltabox/internal/bench"
	"deltabox/internal/client"
)

func benchNetCmd() *cobra.Command {
	o := bench.DefaultNetOptions()
	var out string
	c := &cobra.Command{
		Use:   "net [--json FILE]",
		Short: "Measure the network proxy: a request through it against the same request from the host, and a checkpoint after requests against one after none",
		Long: `Makes a network namespace with an HTTP server, joined to the host by a veth (needs root
and iproute2), and a sandbox allowed to reach it. Times --requests GETs on new connections
from a python session in the sandbox (through the daemon's proxy) and from the host's
python3 (direct), then --samples checkpoints of the session right after two requests on a
kept-alive connection (after-net) and after a call without any (no-net), alternating. The
sandbox, its nodes, the namespace and the server are removed at the end, even on failure.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := o.Validate(); err != nil {
				return err
			}
			o.Command = "deltabox " + bench.ShellJoin(os.Args[1:])
			o.Log = os.Stderr
			f, err := bench.RunNet(ctx(), client.New(socketPath), o)
			return finishBench(f, err, out, func() string { return bench.FormatTable(f.Results) })
		},
	}
	fl := c.Flags()
	fl.StringVar(&out, "json", "", "write the results as JSON to FILE")
	fl.IntVar(&o.Requests, "requests", o.Requests, "timed requests per system")
	fl.IntVar(&o.Samples, "samples", o.Samples, "checkpoints per system")
	fl.StringVar(&o.Image, "image", o.Image, "image of the bench's sandbox")
	fl.StringArrayVar(&o.Notes, "note", nil, "a note to record in the results (repeatable)")
	return c
}
