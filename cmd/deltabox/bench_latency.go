package main

import "github.com/spf13/cobra"

func benchLatencyCmd() *cobra.Command {
	return notBuilt("latency", "Time checkpoints and restores of files and processes beside CRIU", "issue 4")
}
