package main

import (
	"github.com/spf13/cobra"
)

func benchCmd() *cobra.Command {
	c := &cobra.Command{Use: "bench", Short: "Measure DeltaBox beside its baselines"}
	return c
}
