package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"deltabox/internal/api"
	"deltabox/internal/cgroup"
	"deltabox/internal/overlay"
	"deltabox/internal/sbinit"
	"deltabox/internal/state"
	"deltabox/internal/store"
)

func daemonCmd() *cobra.Command {
	var root, listen, tlsCert, tlsKey string
	c := &cobra.Command{
		Use:   "daemon [--root DIR] [--listen ADDR [--tls-cert FILE --tls-key FILE]]",
		Short: "Run the DeltaBox daemon (as root)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if os.Geteuid() != 0 {
				return fmt.Errorf("the daemon must run as root (it mounts, makes namespaces and ptraces)")
			}
			// Whatever the daemon inherited must not leak into sandboxes.
			sbinit.CloseOnExecFrom(3)
			useEmbeddedInit()
			level := slog.LevelInfo
			if os.Getenv("DELTABOX_DEBUG") == "1" {
				level = slog.LevelDebug
			}
			log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
			cgroup.SetRootFor(root, store.DefaultRoot)
			// Before the store is opened: nothing of a sandbox runs before it is nosuid.
			if err := store.Harden(root); err != nil {
				return err
			}
			st, err := store.Open(root)
			if err != nil {
				return err
			}
			cfg, err := configFromEnv(os.Getenv)
			if err != nil {
				st.Close()
				return err
			}
			m, err := state.New(st, log, cfg)
			if err != nil {
				st.Close()
				return err
			}
			ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
			defer cancel()
			initBin, initWhy := sbinit.InitBinary()
			log.Info("deltabox daemon listening", "socket", socketPath, "root", root, "branch_init", initBin, "branch_init_why", initWhy)
			native := api.New(m, log)
			if listen != "" {
				var stop context.CancelCauseFunc
				ctx, stop = context.WithCancelCause(ctx)
				go func() {
					// A listener that cannot start (address taken, bad certificate)
					// stops the daemon: it was asked to serve there.
					stop(serveTCP(ctx, log, m, native, root, listen, tlsCert, tlsKey))
				}()
			}
			err = native.Listen(ctx, socketPath, 0o600)
			if cerr := context.Cause(ctx); err == nil && cerr != nil && !errors.Is(cerr, context.Canceled) {
				err = cerr
			}
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
	c.Flags().StringVar(&listen, "listen", "", "also serve both APIs (DeltaBox's /v1 and E2B's) on this TCP address, for holders of an API key (deltabox key create)")
	c.Flags().StringVar(&tlsCert, "tls-cert", "", "with --listen: serve TLS with this certificate (PEM)")
	c.Flags().StringVar(&tlsKey, "tls-key", "", "with --listen: the certificate's private key (PEM)")
	c.Flags().StringVar(&root, "root", def, "state directory (env DELTABOX_ROOT); on a reflink XFS, see scripts/setup.sh")
	return c
}

// configFromEnv is the state manager's configuration, read once at start from the
// daemon's environment. Each variable is a switch for measuring or debugging one
// mechanism (docs/DESIGN.md); a value that does not parse is refused, not ignored.
//
//	DELTABOX_FASTPATH=0       checkpoints carry files only (no process templates)
//	DELTABOX_WARM_PROC=1      warm restored processes' memory in every sandbox
//	DELTABOX_FORK_FAST=0      a fork of a live sandbox takes the durable path, never the fast one
//	DELTABOX_SPARES=0         no spares: a member's restores of pre-fork nodes always fork (docs/design/spares.md)
//	DELTABOX_NO_PREPARE=1     no next checkpoint state mounted ahead of time
//	DELTABOX_EARLY_ANSWER=0   checkpoints answer once their node is complete (not once
//	                          the processes are seized)
//	DELTABOX_WARM_MAX=N       warm restore states kept per sandbox (0: none)
//	DELTABOX_SQUASH_DEPTH=N   squash a node's stack once it has N layers (default 64; 0: never)
//	DELTABOX_ANSWER_DELAY=D   how long background work waits after an answer (Go duration)
//	DELTABOX_MAX_SESSIONS_PER_SANDBOX=N  sessions a sandbox may hold at once (default 64)
//	DELTABOX_MAX_SESSIONS=N   sessions all sandboxes may hold at once (default 1024)
//	DELTABOX_TEMPLATE_BUDGET=SIZE        a sandbox's template memory budget when its
//	                          create names none (512M, 2G; default an eighth of RAM)
//	DELTABOX_TEMPLATE_BUDGET_TOTAL=SIZE  every sandbox's templates together (default a
//	                          quarter of RAM); docs/API.md, Template memory
func configFromEnv(getenv func(string) string) (state.Config, error) {
	cfg := state.DefaultConfig()
	bad := func(name, v, want string) error {
		return fmt.Errorf("%s=%q: want %s (or unset it)", name, v, want)
	}
	switch v := getenv("DELTABOX_FASTPATH"); v {
	case "", "1":
	case "0":
		cfg.FastPath = false
	default:
		return cfg, bad("DELTABOX_FASTPATH", v, "0 or 1")
	}
	switch v := getenv("DELTABOX_WARM_PROC"); v {
	case "", "0":
	case "1":
		cfg.WarmProcesses = true
	default:
		return cfg, bad("DELTABOX_WARM_PROC", v, "0 or 1")
	}
	switch v := getenv("DELTABOX_FORK_FAST"); v {
	case "", "1":
	case "0":
		cfg.ForkFast = false
	default:
		return cfg, bad("DELTABOX_FORK_FAST", v, "0 or 1")
	}
	switch v := getenv("DELTABOX_SPARES"); v {
	case "", "1":
	case "0":
		cfg.NoSpares = true
	default:
		return cfg, bad("DELTABOX_SPARES", v, "0 or 1")
	}
	switch v := getenv("DELTABOX_NO_PREPARE"); v {
	case "", "0":
	case "1":
		cfg.Prepare = false
	default:
		return cfg, bad("DELTABOX_NO_PREPARE", v, "0 or 1")
	}
	switch v := getenv("DELTABOX_EARLY_ANSWER"); v {
	case "", "1":
	case "0":
		cfg.EarlyAnswer = false
	default:
		return cfg, bad("DELTABOX_EARLY_ANSWER", v, "0 or 1 (checkpoints answer once their node is complete, or once the processes are seized)")
	}
	switch v := getenv("DELTABOX_DURABLE"); v {
	case "", "1":
	case "0":
		cfg.Durable = false
	default:
		return cfg, bad("DELTABOX_DURABLE", v, "0 or 1")
	}
	switch v := getenv("DELTABOX_LAZY_RESTORE"); v {
	case "", "auto":
	case "0":
		cfg.LazyRestoreMinBytes = -1
	case "1":
		cfg.LazyRestoreMinBytes = 0
	default:
		return cfg, bad("DELTABOX_LAZY_RESTORE", v, "auto, 0 or 1 (restores from images: lazy from 64 MiB of pages, never, always)")
	}
	if v := getenv("DELTABOX_NET_DNS"); v != "" {
		if _, err := netip.ParseAddrPort(v); err != nil {
			return cfg, bad("DELTABOX_NET_DNS", v, "IP:PORT of the resolver the network proxy asks (default: the host's, /etc/resolv.conf)")
		}
		cfg.NetDNS = v
	}
	if v := getenv("DELTABOX_SQUASH_DEPTH"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 || n == 1 || n > overlay.MaxLowers-2 {
			return cfg, bad("DELTABOX_SQUASH_DEPTH", v, fmt.Sprintf("a layer count from 2 to %d, or 0 to never squash", overlay.MaxLowers-2))
		}
		cfg.SquashDepth = n
	}
	switch v := getenv("DELTABOX_STOP_SANDBOXES"); v {
	case "", "0":
	case "1":
		cfg.StopSandboxes = true
	default:
		return cfg, bad("DELTABOX_STOP_SANDBOXES", v, "0 or 1")
	}
	switch v := getenv("DELTABOX_ISOLATION"); v {
	case "", "on":
	case "off":
		cfg.NoIsolation = true
	default:
		return cfg, bad("DELTABOX_ISOLATION", v, "on or off (off: no user namespace, for comparisons only)")
	}
	if v := getenv("DELTABOX_WARM_MAX"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return cfg, bad("DELTABOX_WARM_MAX", v, "a count >= 0")
		}
		cfg.WarmMax = n
	}
	if v := getenv("DELTABOX_ANSWER_DELAY"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d < 0 {
			return cfg, bad("DELTABOX_ANSWER_DELAY", v, "a duration >= 0, like 2ms")
		}
		cfg.AnswerDelay = d
	}
	for _, c := range []struct {
		name string
		to   *int
	}{{"DELTABOX_MAX_SESSIONS_PER_SANDBOX", &cfg.MaxSessionsPerSandbox}, {"DELTABOX_MAX_SESSIONS", &cfg.MaxSessions}} {
		if v := getenv(c.name); v != "" {
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 {
				return cfg, bad(c.name, v, "a count >= 1")
			}
			*c.to = n
		}
	}
	for _, c := range []struct {
		name string
		to   *int64
	}{{"DELTABOX_TEMPLATE_BUDGET", &cfg.TemplateBudgetBytes}, {"DELTABOX_TEMPLATE_BUDGET_TOTAL", &cfg.TemplateBudgetTotalBytes}} {
		if v := getenv(c.name); v != "" {
			mb, err := parseSizeMB(c.name, v)
			if err != nil {
				return cfg, bad(c.name, v, "a size like 512M or 2G")
			}
			*c.to = mb << 20
		}
	}
	return cfg, nil
}
