package main

import (
	"fmt"
	"os"

	"github.com/spf13/cobra"

	"deltabox/internal/apitypes"
)

func sessionCmd() *cobra.Command {
	c := &cobra.Command{Use: "session", Short: "Persistent shells, interpreters and long-lived commands in a sandbox"}
	var python bool
	var dir string
	start := &cobra.Command{
		Use:   "start SANDBOX NAME [--python] [-- CMD ARG...]",
		Short: "Start a bash session (default), a python session, or a long-lived command",
		Args:  cobra.MinimumNArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			o := apitypes.SessionOptions{Name: args[1], Argv: args[2:], Dir: dir}
			if python {
				o.Kind = apitypes.SessionPython
			}
			in, err := cli().StartSession(ctx(), args[0], o)
			if err != nil {
				return err
			}
			if jsonOut {
				printJSON(in)
			} else {
				fmt.Printf("%s: %s session, pid %d in the sandbox\n", in.Name, in.Kind, in.Pid)
			}
			return nil
		},
	}
	start.Flags().BoolVar(&python, "python", false, "a persistent python3 interpreter")
	start.Flags().StringVarP(&dir, "workdir", "w", "", "working directory (default: the sandbox's)")
	c.AddCommand(start, &cobra.Command{
		Use:   "ls SANDBOX",
		Short: "List a sandbox's sessions",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			l, err := cli().Sessions(ctx(), args[0])
			if err != nil {
				return err
			}
			if jsonOut {
				printJSON(l)
				return nil
			}
			fmt.Printf("%-12s %-8s %-6s %-8s %s\n", "SESSION", "KIND", "PID", "STATE", "COMMAND / EXIT")
			for _, s := range l {
				st, what := "running", fmt.Sprint(s.Argv)
				if !s.Running {
					st, what = "ended", s.Exit
				} else if s.Busy {
					st = "busy"
				}
				fmt.Printf("%-12s %-8s %-6d %-8s %s\n", s.Name, s.Kind, s.Pid, st, what)
			}
			return nil
		},
	}, &cobra.Command{
		Use:   "logs SANDBOX NAME",
		Short: "Print what a session printed that no call consumed (a command session's output)",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			s, err := cli().SessionLogs(ctx(), args[0], args[1])
			if err != nil {
				return err
			}
			os.Stdout.WriteString(s)
			return nil
		},
	}, &cobra.Command{
		Use:   "kill SANDBOX NAME",
		Short: "End a session",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			return cli().KillSession(ctx(), args[0], args[1])
		},
	})
	return c
}
