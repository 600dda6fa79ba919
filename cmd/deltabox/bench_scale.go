package main

import "github.com/spf13/cobra"

func benchScaleCmd() *cobra.Command {
	return notBuilt("scale", "Restore latency against tree depth, workspace size and session RSS", "issue 5")
}
