package main

import (
	"fmt"

	"github.com/spf13/cobra"
)

// notBuilt is a bench subcommand whose measurement is still being written; it says so
// instead of pretending to measure.
func notBuilt(use, short, issue string) *cobra.Command {
	return &cobra.Command{
		Use:   use,
		Short: short + " (not built yet)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return fmt.Errorf("bench %s is not built yet (%s)", use, issue)
		},
	}
}

func benchLatencyCmd() *cobra.Command {
	return notBuilt("latency", "Time checkpoints and restores of files and processes beside CRIU", "issue 4")
}

func benchMCTSCmd() *cobra.Command {
	return notBuilt("mcts", "Run one tree search with DeltaBox and with its baselines", "issue 5")
}

func benchScaleCmd() *cobra.Command {
	return notBuilt("scale", "Restore latency against tree depth, workspace size and session RSS", "issue 5")
}
