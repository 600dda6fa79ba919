package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"time"

	"github.com/spf13/cobra"

	"deltabox/internal/apitypes"
	"deltabox/internal/client"
)

// benchOps are the operations bench api times, in order; the native API's analogue of
// each is said in the command's help.
var benchOps = []string{"create", "command", "pause", "resume", "fork", "kill"}

func benchAPICmd() *cobra.Command {
	var host, key, sdkDir string
	samples := 10
	c := &cobra.Command{
		Use:   "api --host ADDR --key KEY [--sdk-dir tests/e2b] [--samples N]",
		Short: "Time create, a command, pause, resume, fork and kill through E2B's SDK, beside the native API",
		Long: `Runs tests/e2b/bench.mjs (E2B's npm SDK, as installed by scripts/setup.sh) against the
daemon's TCP listener (--host, a key from deltabox key create), then the same steps through
the daemon's own API on its socket: create; exec of true; pause = a checkpoint; resume = a
restore of it; fork = a checkpoint and a fork of one branch; kill = remove. Each
sample is the latency the client sees. Prints the median and 90th percentile per step.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if host == "" || key == "" {
				return fmt.Errorf("--host (the daemon's --listen address) and --key (deltabox key create NAME) are required")
			}
			if samples < 1 {
				return fmt.Errorf("--samples must be >= 1")
			}
			sdk, err := benchSDK(sdkDir, hostURL(host), key, samples)
			if err != nil {
				return err
			}
			native, err := benchNative(ctx(), client.New(socketPath), samples)
			if err != nil {
				return err
			}
			fmt.Printf("%-8s %22s %22s\n", "op (ms)", "native median / p90", "E2B SDK median / p90")
			for _, op := range benchOps {
				fmt.Printf("%-8s %22s %22s\n", op, medP90(native[op]), medP90(sdk[op]))
			}
			fmt.Printf("samples: %d each; command: deltabox bench api --host %s --samples %d\n", samples, host, samples)
			return nil
		},
	}
	c.Flags().StringVar(&host, "host", os.Getenv("DELTABOX_HOST"), "the daemon's TCP listener, HOST:PORT or http(s)://HOST:PORT (env DELTABOX_HOST)")
	c.Flags().StringVar(&key, "key", os.Getenv("DELTABOX_API_KEY"), "an API key (env DELTABOX_API_KEY)")
	c.Flags().StringVar(&sdkDir, "sdk-dir", "tests/e2b", "the directory of bench.mjs and the installed e2b package")
	c.Flags().IntVar(&samples, "samples", samples, "samples of each step")
	return c
}

func benchSDK(dir, url, key string, samples int) (map[string][]float64, error) {
	if _, err := os.Stat(filepath.Join(dir, "node_modules", "e2b")); err != nil {
		return nil, fmt.Errorf("E2B's SDK is not installed in %s (cd %s && npm ci): %v", dir, dir, err)
	}
	cx, cancel := context.WithTimeout(context.Background(), time.Duration(samples)*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(cx, "node", "bench.mjs")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "E2B_API_URL="+url, "E2B_SANDBOX_URL="+url, "E2B_API_KEY="+key, "BENCH_SAMPLES="+strconv.Itoa(samples))
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("node bench.mjs: %w", err)
	}
	var r map[string][]float64
	if err := json.Unmarshal(out, &r); err != nil {
		return nil, fmt.Errorf("node bench.mjs printed %q: %v", out, err)
	}
	return r, nil
}

func benchNative(cx context.Context, c *client.Client, samples int) (map[string][]float64, error) {
	r := map[string][]float64{}
	time1 := func(op string, fn func() error) error {
		t0 := time.Now()
		err := fn()
		r[op] = append(r[op], float64(time.Since(t0).Microseconds())/1000)
		return err
	}
	for i := 0; i < samples; i++ {
		var sb, fork *apitypes.SandboxInfo
		var node string
		err := time1("create", func() (err error) { sb, err = c.Create(cx, apitypes.CreateOptions{}); return })
		if err == nil {
			err = time1("command", func() error { _, err := c.Exec(cx, sb.ID, apitypes.ExecRequest{Argv: []string{"true"}}); return err })
		}
		if err == nil {
			err = time1("pause", func() error {
				res, err := c.Checkpoint(cx, sb.ID, "")
				if err == nil {
					node = res.Node.ID
				}
				return err
			})
		}
		if err == nil {
			err = time1("resume", func() error { _, err := c.Restore(cx, sb.ID, node); return err })
		}
		if err == nil {
			err = time1("fork", func() error {
				res, err := c.Checkpoint(cx, sb.ID, "")
				if err != nil {
					return err
				}
				fr, err := c.Fork(cx, res.Node.ID, apitypes.ForkRequest{Count: 1})
				if err != nil {
					return err
				}
				fork = &fr.Branches[0].Sandbox
				return nil
			})
		}
		if fork != nil {
			c.Remove(cx, fork.ID)
		}
		if sb != nil {
			if rerr := time1("kill", func() error { return c.Remove(cx, sb.ID) }); err == nil {
				err = rerr
			}
		}
		if err != nil {
			return r, err
		}
	}
	return r, nil
}

func medP90(v []float64) string {
	if len(v) == 0 {
		return "-"
	}
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	return fmt.Sprintf("%.1f / %.1f", s[len(s)/2], s[(len(s)*9)/10-boolInt(len(s)%10 == 0)])
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}
