package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"

	"deltabox/internal/api"
	"deltabox/internal/cgroup"
	"deltabox/internal/sbinit"
	"deltabox/internal/state"
	"deltabox/internal/store"
)

func daemonCmd() *cobra.Command {
	var root string
	c := &cobra.Command{
		Use:   "daemon [--root DIR]",
		Short: "Run the DeltaBox daemon (as root)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if os.Geteuid() != 0 {
				return fmt.Errorf("the daemon must run as root (it mounts, makes namespaces and ptraces)")
			}
			// Whatever the daemon inherited must not leak into sandboxes.
			sbinit.CloseOnExecFrom(3)
			level := slog.LevelInfo
			if os.Getenv("DELTABOX_DEBUG") == "1" {
				level = slog.LevelDebug
			}
			log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
			cgroup.SetRootFor(root, store.DefaultRoot)
			st, err := store.Open(root)
			if err != nil {
				return err
			}
			m, err := state.New(st, log)
			if err != nil {
				st.Close()
				return err
			}
			ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
			defer cancel()
			log.Info("deltabox daemon listening", "socket", socketPath, "root", root)
			err = api.New(m, log).Listen(ctx, socketPath, 0o600)
			if cerr := m.Close(); err == nil {
				err = cerr
			}
			cgroup.RemoveRoot()
			return err
		},
	}
	def := os.Getenv("DELTABOX_ROOT")
	if def == "" {
		def = store.DefaultRoot
	}
	c.Flags().StringVar(&root, "root", def, "state directory (env DELTABOX_ROOT); on a reflink XFS, see scripts/setup.sh")
	return c
}
