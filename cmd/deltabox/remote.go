package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"

	"github.com/spf13/cobra"

	"deltabox/internal/auth"
	"deltabox/internal/e2b"
	"deltabox/internal/gateway"
	"deltabox/internal/state"
	"deltabox/internal/store"
)

// serveTCP serves both APIs on addr for key holders until ctx ends (internal/gateway).
func serveTCP(ctx context.Context, log *slog.Logger, m *state.Manager, native http.Handler, root, addr, cert, key string) error {
	es := e2b.New(m, log, "default")
	keys := auth.Open(root)
	es.KeyValid = keys.Valid // a revoked key's sandbox tokens stop working with it
	c := &gateway.Config{Addr: addr, CertFile: cert, KeyFile: key, Keys: keys, Native: native, E2B: es,
		EnvdToken: es.TokenOK, IsEnvd: e2b.IsEnvd, IsPort: e2b.IsPort, PortToken: es.PortTokenOK, Log: log}
	err := c.Listen(ctx, func(a net.Addr) {
		log.Info("deltabox daemon listening on TCP (both APIs; API keys required)", "addr", a.String(), "tls", cert != "", "keys", c.Keys.Path())
	})
	if err != nil {
		log.Error("the TCP listener stopped", "addr", addr, "err", err)
	}
	return err
}

func rootFlag(c *cobra.Command, root *string) {
	def := os.Getenv("DELTABOX_ROOT")
	if def == "" {
		def = store.DefaultRoot
	}
	c.Flags().StringVar(root, "root", def, "the daemon's state directory (env DELTABOX_ROOT), where its keys file is")
}

func keyCmd() *cobra.Command {
	c := &cobra.Command{Use: "key", Short: "API keys for the daemon's TCP listener (as root)"}
	var root string
	create := &cobra.Command{
		Use:   "create NAME",
		Short: "Make a key; it is printed once, on the last line (only its hash is kept)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			k, err := auth.Open(root).Create(args[0])
			if err != nil {
				return err
			}
			fmt.Fprintf(os.Stderr, "key %s created; it is shown only now (use it as DELTABOX_API_KEY or E2B_API_KEY):\n", args[0])
			fmt.Println(k)
			return nil
		},
	}
	rootFlag(create, &root)
	ls := &cobra.Command{
		Use:   "ls",
		Short: "List the keys (names and creation times)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			keys, err := auth.Open(root).List()
			if err != nil {
				return err
			}
			for _, k := range keys {
				fmt.Printf("%s\t%s\n", k.Name, k.Created.Format("2006-01-02T15:04:05Z"))
			}
			return nil
		},
	}
	rootFlag(ls, &root)
	rm := &cobra.Command{
		Use:   "rm NAME",
		Short: "Revoke a key (refused from the next request on)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return auth.Open(root).Remove(args[0])
		},
	}
	rootFlag(rm, &root)
	c.AddCommand(create, ls, rm)
	return c
}

func e2bCmd() *cobra.Command {
	c := &cobra.Command{Use: "e2b", Short: "Point E2B's SDKs at this daemon"}
	var key, host, domain string
	env := &cobra.Command{
		Use:   "env --key KEY [--host URL] [--domain NAME]",
		Short: "Print the export lines that point E2B's SDK at the daemon's TCP listener",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if key == "" {
				key = os.Getenv("DELTABOX_API_KEY")
			}
			if key == "" {
				return fmt.Errorf("--key KEY is required (deltabox key create NAME makes one)")
			}
			if host == "" {
				host = os.Getenv("DELTABOX_HOST")
			}
			if host == "" {
				return fmt.Errorf("--host URL is required (the daemon's --listen address, as http://HOST:PORT or https://HOST:PORT), or set DELTABOX_HOST")
			}
			u := hostURL(host)
			fmt.Printf("export E2B_API_URL=%s\nexport E2B_SANDBOX_URL=%s\nexport E2B_API_KEY=%s\n", u, u, key)
			if domain != "" {
				// getHost(port) is PORT-SANDBOXID.E2B_DOMAIN: the listener's port goes with it.
				pu, err := url.Parse(u)
				if err != nil {
					return fmt.Errorf("--host %s: %v", host, err)
				}
				if _, _, err := net.SplitHostPort(domain); err != nil && pu.Port() != "" {
					domain = net.JoinHostPort(domain, pu.Port())
				}
				fmt.Printf("export E2B_DOMAIN=%s\n", domain)
			}
			return nil
		},
	}
	env.Flags().StringVar(&key, "key", "", "an API key (deltabox key create NAME; env DELTABOX_API_KEY)")
	env.Flags().StringVar(&host, "host", "", "the daemon's TCP address, http://HOST:PORT or https://HOST:PORT (env DELTABOX_HOST)")
	env.Flags().StringVar(&domain, "domain", "", "a DNS name whose subdomains (*.NAME) resolve to the daemon: getHost(port) is then PORT-SANDBOXID.NAME (E2B_DOMAIN)")
	c.AddCommand(env)
	return c
}

// hostURL makes HOST:PORT an http:// URL; a URL stays as it is.
func hostURL(h string) string {
	if strings.Contains(h, "://") {
		return strings.TrimRight(h, "/")
	}
	return "http://" + h
}
