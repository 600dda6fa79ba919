package main

import "github.com/spf13/cobra"

func benchMCTSCmd() *cobra.Command {
	return notBuilt("mcts", "Run one tree search with DeltaBox and with its baselines", "issue 5")
}
