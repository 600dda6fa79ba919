package main

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"
)

func killCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "kill SANDBOX PID [SIGNAL]",
		Short: "Send a signal (default TERM) to a process of a sandbox, from outside its commands",
		Long: "Inside a sandbox a command cannot signal a process another command started (each runs in a " +
			"Landlock domain of its own: docs/SECURITY.md); this sends the signal through the sandbox's init. " +
			"PID is the process's PID in the sandbox; SIGNAL a number or a name (KILL, SIGKILL).",
		Args: cobra.RangeArgs(2, 3),
		RunE: func(cmd *cobra.Command, args []string) error {
			pid, err := strconv.Atoi(args[1])
			if err != nil {
				return fmt.Errorf("PID %q is not a number (ps in the sandbox lists them)", args[1])
			}
			sig := 0
			if len(args) == 3 {
				if sig, err = strconv.Atoi(args[2]); err != nil {
					name := strings.ToUpper(args[2])
					if !strings.HasPrefix(name, "SIG") {
						name = "SIG" + name
					}
					if sig = int(unix.SignalNum(name)); sig == 0 {
						return fmt.Errorf("no signal %q (kill -l lists them)", args[2])
					}
				}
			}
			_, err = cli().Signal(ctx(), args[0], pid, sig)
			return err
		},
	}
}
