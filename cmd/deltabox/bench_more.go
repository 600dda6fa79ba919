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
