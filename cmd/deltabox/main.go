// Command deltabox is DeltaBox's one binary: the daemon (`deltabox daemon`), the
// client verbs, and (hidden) the sandbox init: the small one it carries
// (cmd/deltabox-init, embedded by scripts/build.sh, initbin.go), else this binary
// re-executed.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"deltabox/internal/apitypes"
	"deltabox/internal/client"
	"deltabox/internal/sbinit"
)

func main() {
	if len(os.Args) > 2 && os.Args[1] == sbinit.InitArg {
		sbinit.Main(os.Args[2])
		return
	}
	if err := rootCmd().Execute(); err != nil {
		var ee exitError
		if errors.As(err, &ee) {
			os.Exit(int(ee))
		}
		fmt.Fprintln(os.Stderr, "deltabox:", err)
		os.Exit(1)
	}
}

// exitError carries a command's exit code out of cobra without printing anything.
type exitError int

func (e exitError) Error() string { return fmt.Sprintf("exit %d", int(e)) }

var (
	socketPath string
	jsonOut    bool
)

func rootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:           "deltabox",
		Short:         "Sandboxes for LLM agents with millisecond checkpoint and rollback",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	def := os.Getenv("DELTABOX_SOCKET")
	if def == "" {
		def = client.DefaultSocket
	}
	root.PersistentFlags().StringVar(&socketPath, "socket", def, "daemon socket (env DELTABOX_SOCKET)")
	root.PersistentFlags().BoolVar(&jsonOut, "json", false, "print the daemon's JSON answer")
	root.AddCommand(exportCmd(), importCmd()) // transfer.go
	root.AddCommand(daemonCmd(), createCmd(), lsCmd(), rmCmd(), execCmd(), checkpointCmd(), restoreCmd(),
		treeCmd(), imageCmd(), syncCmd(), benchCmd(), sessionCmd(), forkCmd(), prepareCmd())
	root.AddCommand(filesCmd(), keyCmd(), e2bCmd(), killCmd())
	return root
}

// cli is the daemon's client: on DELTABOX_HOST (TCP, with DELTABOX_API_KEY) when set,
// else on the unix socket.
func cli() *client.Client {
	if h := os.Getenv("DELTABOX_HOST"); h != "" {
		return client.NewRemote(hostURL(h), os.Getenv("DELTABOX_API_KEY"))
	}
	return client.New(socketPath)
}

func ctx() context.Context {
	c, _ := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	return c
}

func printJSON(v any) {
	e := json.NewEncoder(os.Stdout)
	e.SetIndent("", "  ")
	e.Encode(v)
}

func createCmd() *cobra.Command {
	var o apitypes.CreateOptions
	var memory, disk, budget string
	var allowOut, denyOut []string
	var modelURL, modelKeyEnv string
	c := &cobra.Command{
		Use:   "create [--image NAME] [--workdir DIR] [--name ID] [--memory 2G] [--template-budget 1G] [--disk 10G] [--pids 512] [--cpus 1.5] [--warm-processes] [--allow-out X]... [--deny-out X]...",
		Short: "Create and start a sandbox; prints its id",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			var err error
			if o.MemoryMB, err = parseMemoryMB(memory); err != nil {
				return err
			}
			if o.DiskMB, err = parseSizeMB("--disk", disk); err != nil {
				return err
			}
			if budget == "none" {
				o.TemplateBudgetMB = -1
			} else if o.TemplateBudgetMB, err = parseSizeMB("--template-budget", budget); err != nil {
				return err
			}
			if len(allowOut) > 0 || len(denyOut) > 0 || modelURL != "" {
				o.Network = &apitypes.Network{AllowOut: allowOut, DenyOut: denyOut}
			}
			if modelURL != "" {
				o.Network.Model = &apitypes.ModelEndpoint{URL: modelURL, Key: os.Getenv(modelKeyEnv)}
			}
			in, err := cli().Create(ctx(), o)
			if err != nil {
				return err
			}
			if jsonOut {
				printJSON(in)
			} else {
				fmt.Println(in.ID)
			}
			return nil
		},
	}
	c.Flags().StringVar(&o.Image, "image", "default", "image to start from")
	c.Flags().StringVar(&o.Workdir, "workdir", "/workspace", "working directory of commands")
	c.Flags().StringVar(&o.ID, "name", "", "sandbox id (default: generated)")
	c.Flags().StringVar(&o.Hostname, "hostname", "", "hostname (default: the id)")
	c.Flags().StringVar(&o.User, "user", "", "run sessions and commands as this user of the sandbox's /etc/passwd: NAME, UID, NAME:GROUP or UID:GID (default: root)")
	c.Flags().StringVar(&memory, "memory", "", "memory limit, e.g. 512M, 2G, 1.5G (K/M/G/T are binary; a bare number is MiB; default 4G or half the host's RAM)")
	c.Flags().StringVar(&budget, "template-budget", "", "memory the process templates of its checkpoints may hold apart from --memory, e.g. 1G (default: the daemon's, an eighth of its RAM; none: they count against --memory); past it checkpoints wait, then answer 507")
	c.Flags().StringVar(&disk, "disk", "", "quota on what the sandbox writes between checkpoints (its upper layer), e.g. 500M, 20G (default 10G); over it its processes are killed and writes answer 507")
	c.Flags().Int64Var(&o.Pids, "pids", 0, "limit on processes and threads at once (default 1024)")
	c.Flags().BoolVar(&o.WarmProcesses, "warm-processes", false, "after each restore, pre-fault the pages the restored processes had written while their sessions wait (see docs/DESIGN.md)")
	c.Flags().StringArrayVar(&allowOut, "allow-out", nil, "give the sandbox egress through the daemon's proxy to this domain (pypi.org), wildcard (*.github.com), IP, CIDR or * (everything); repeatable (default: no network)")
	c.Flags().StringVar(&modelURL, "model-url", "", "an OpenAI-compatible endpoint (e.g. https://api.openai.com/v1) the sandbox reaches as http://"+apitypes.ModelHost+", the daemon adding the key (--model-key-env)")
	c.Flags().StringVar(&modelKeyEnv, "model-key-env", "OPENAI_API_KEY", "the environment variable holding the model endpoint's key (never put in the sandbox)")
	c.Flags().StringArrayVar(&denyOut, "deny-out", nil, "refuse this domain, wildcard, IP or CIDR even where --allow-out allows it; repeatable")
	c.Flags().Float64Var(&o.CPUs, "cpus", 0, "CPU time per wall-clock time, e.g. 0.5 or 1.5 (default: all host CPUs, no throttling)")
	return c
}

func lsCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "ls",
		Short: "List sandboxes",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			l, err := cli().List(ctx())
			if err != nil {
				return err
			}
			if jsonOut {
				printJSON(l)
				return nil
			}
			fmt.Printf("%-16s %-10s %-10s %-9s %s\n", "SANDBOX", "IMAGE", "HEAD", "STATUS", "CREATED")
			for _, s := range l {
				head := s.Head
				if head == "" {
					head = "(image)"
				}
				fmt.Printf("%-16s %-10s %-10s %-9s %s\n", s.ID, s.Image, head, s.Status, s.Created.Local().Format(time.DateTime))
			}
			return nil
		},
	}
}

func rmCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "rm SANDBOX...",
		Short: "Remove sandboxes (processes, mounts, cgroup, upper layer); their nodes stay in the tree",
		Args:  cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			var errs []error
			for _, id := range args {
				if err := cli().Remove(ctx(), id); err != nil {
					errs = append(errs, err)
				} else {
					fmt.Println(id)
				}
			}
			return errors.Join(errs...)
		},
	}
}

// Exit codes of exec besides the command's own (docs/API.md, "The CLI's exec"): as
// coreutils timeout and docker run have them, and as a shell reports a signal.
const (
	exitTimedOut    = 124 // the command timed out (what it started killed, or ^C in a session)
	exitFailed      = 125 // deltabox itself failed: the daemon unreachable, the call refused
	exitInterrupted = 130 // interrupted by SIGINT (Ctrl-C); SIGTERM gives 143
)

// signalled is a context's cause when the CLI got a signal.
type signalled struct{ sig syscall.Signal }

func (s signalled) Error() string { return "interrupted (" + unix.SignalName(s.sig) + ")" }

// signalContext is cancelled, with a signalled cause, at SIGINT or SIGTERM.
func signalContext() (context.Context, func()) {
	c, cancel := context.WithCancelCause(context.Background())
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, os.Interrupt, syscall.SIGTERM)
	go func() {
		if s, ok := <-ch; ok {
			cancel(signalled{s.(syscall.Signal)})
		}
	}()
	return c, func() { signal.Stop(ch); close(ch); cancel(nil) }
}

func execCmd() *cobra.Command {
	var q apitypes.ExecRequest
	var timeout time.Duration
	var stdin bool
	c := &cobra.Command{
		Use:   "exec SANDBOX [--timeout D] -- CMD [ARG...]",
		Short: "Run a command in a sandbox; exits with its exit code (124: timed out, 125: deltabox failed, 130: interrupted)",
		Long: `Run a command in a sandbox, its output shown as it is produced, byte for byte.

Exits with the command's exit code (128+N when a signal N killed it), or:
  124  the command timed out (--timeout; a session's command is interrupted with ^C)
  125  deltabox itself failed (the daemon unreachable, the request refused)
  130  interrupted (Ctrl-C; 143 for SIGTERM): the command was killed, or a session's
       command interrupted with ^C
Every marker goes to stderr: "[deltabox: N bytes of stdout dropped]" where output over
--output-limit was dropped (the first quarter and the last three quarters of the
limit are kept), the timeout, the interruption.`,
		Args: cobra.MinimumNArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			q.Argv = args[1:]
			switch {
			case timeout > 0:
				q.TimeoutMS = max(1, timeout.Milliseconds())
			case timeout == 0:
				q.TimeoutMS = -1
			default:
				return fmt.Errorf("--timeout %v: want a duration > 0, or 0 for none", timeout)
			}
			if stdin {
				b, err := io.ReadAll(os.Stdin)
				if err != nil {
					return fmt.Errorf("read stdin: %w", err)
				}
				q.Stdin = string(b)
			}
			if q.Session != "" && len(q.Argv) > 1 {
				// exec --session S -- CODE...: the words are one line of shell code.
				q.Argv = []string{strings.Join(q.Argv, " ")}
			}
			c, stop := signalContext()
			defer stop()
			var r *apitypes.ExecResult
			var err error
			timeoutSaid := false
			if jsonOut {
				r, err = cli().Exec(c, args[0], q)
				if err == nil {
					printJSON(r)
				}
			} else {
				// Output is written as it comes (one write per event), markers on stderr.
				r, err = cli().ExecEvents(c, args[0], q, func(ev apitypes.StreamEvent) {
					switch {
					case ev.Marker != "":
						os.Stderr.WriteString(strings.Trim(ev.Data, "\n") + "\n")
						timeoutSaid = timeoutSaid || ev.Marker == apitypes.MarkerTimeout
					case ev.Type == "stderr":
						os.Stderr.WriteString(ev.Data)
					default:
						os.Stdout.WriteString(ev.Data)
					}
				})
			}
			if err != nil {
				var sig signalled
				if errors.As(context.Cause(c), &sig) {
					what := "the command was killed"
					if q.Session != "" {
						what = "the session's command was interrupted (^C); the session lives on"
					}
					fmt.Fprintf(os.Stderr, "[deltabox: %v; %s]\n", sig, what)
					return exitError(128 + int(sig.sig))
				}
				fmt.Fprintln(os.Stderr, "deltabox:", err)
				return exitError(exitFailed)
			}
			if r.SessionRestarted {
				fmt.Fprintf(os.Stderr, "deltabox: session %s was ended by a checkpoint or restore and started again\n", r.Session)
			}
			if r.OOM != "" {
				fmt.Fprintf(os.Stderr, "deltabox: %s\n", r.OOM)
			}
			if r.TimedOut {
				if !timeoutSaid && !jsonOut {
					fmt.Fprintf(os.Stderr, "[deltabox: timed out after %v]\n", time.Duration(r.TimeoutMS)*time.Millisecond)
				}
				return exitError(exitTimedOut)
			}
			if r.ExitCode != 0 {
				if r.ExitCode < 0 {
					return exitError(128 + r.Signal)
				}
				return exitError(r.ExitCode)
			}
			return nil
		},
	}
	c.Flags().DurationVar(&timeout, "timeout", 10*time.Minute, "kill the command's process group after this long (0: never); exit 124")
	c.Flags().StringArrayVarP(&q.Env, "env", "e", nil, "KEY=VALUE to add to the environment")
	c.Flags().StringVarP(&q.Dir, "workdir", "w", "", "working directory (default: the sandbox's)")
	c.Flags().StringVarP(&q.User, "user", "u", "", "run as this user (NAME, UID, NAME:GROUP, UID:GID; root or 0 for root) instead of the sandbox's; not with --session")
	c.Flags().IntVar(&q.OutputLimit, "output-limit", 0, "bytes kept per stream (default 1 MiB): the first quarter and the last three quarters; what is between is dropped, with a marker on stderr")
	c.Flags().BoolVarP(&stdin, "interactive", "i", false, "send this command's stdin to the sandboxed command")
	c.Flags().StringVarP(&q.Session, "session", "s", "", "run as code in this persistent session (\"main\": the default bash session)")
	return c
}

// waitFlagUsage documents --wait of checkpoint and restore.
const waitFlagUsage = "while commands or file operations run, queue behind them for up to this long instead of refusing (commands arriving meanwhile wait behind it); 0: refuse at once"

func checkpointCmd() *cobra.Command {
	var q apitypes.CheckpointRequest
	var wait time.Duration
	c := &cobra.Command{
		Use:   "checkpoint SANDBOX [--label L] [--end-background] [--wait D] [--pin] [--answer early|complete]",
		Short: "Checkpoint a sandbox; prints the new node's id",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			q.WaitMS = wait.Milliseconds()
			r, err := cli().CheckpointWith(ctx(), args[0], q)
			if err != nil {
				return err
			}
			if jsonOut {
				printJSON(r)
			} else {
				fmt.Println(r.Node.ID)
			}
			printWarnings(r)
			return nil
		},
	}
	c.Flags().StringVar(&q.Label, "label", "", "a label for the node")
	c.Flags().BoolVar(&q.EndBackground, "end-background", false, "end the processes outside sessions that cannot be checkpointed with their state (a pipe, a socket, children...) instead of refusing")
	c.Flags().DurationVar(&wait, "wait", 0, waitFlagUsage)
	c.Flags().BoolVar(&q.Pin, "pin", false, "pin the new node: its templates are never evicted over the template budget")
	c.Flags().StringVar(&q.Answer, "answer", "", "early: answer once the processes are seized (the node pending until its templates are made); complete: once the node is complete (default: the daemon's, early unless DELTABOX_EARLY_ANSWER=0)")
	return c
}

func restoreCmd() *cobra.Command {
	var wait time.Duration
	c := &cobra.Command{
		Use:   "restore SANDBOX NODE [--wait D]",
		Short: "Put a sandbox back to a node of the tree",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			r, err := cli().RestoreWith(ctx(), args[0], apitypes.RestoreRequest{Node: args[1], WaitMS: wait.Milliseconds()})
			if err != nil {
				return err
			}
			if jsonOut {
				printJSON(r)
			} else {
				fmt.Printf("%s is on %s (%.2f ms)\n", args[0], r.Node.ID, r.DurationMS)
			}
			printWarnings(r)
			return nil
		},
	}
	c.Flags().DurationVar(&wait, "wait", 0, waitFlagUsage)
	return c
}

func prepareCmd() *cobra.Command {
	var sandbox string
	c := &cobra.Command{
		Use:   "prepare NODE [--sandbox ID]",
		Short: "Make a spare of a node in a sandbox: its next restore there swaps it in instead of forking",
		Long: `Makes sure the sandbox (default: the node's own) holds a spare of the node: its
processes forked and placed ahead of time in a namespace of their own, stopped, so that
the sandbox's next restore of the node swaps them in (from_spare) instead of forking
them. For a node made before a fork, in a member of the fork's family; refused (409)
otherwise, with the reason (docs/design/spares.md). Returns once the spare is ready.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			n, err := cli().PrepareNode(ctx(), args[0], sandbox)
			if err != nil {
				return err
			}
			if jsonOut {
				printJSON(n)
			} else {
				fmt.Printf("%s has a spare in %s\n", n.ID, strings.Join(n.Spares, ", "))
			}
			return nil
		},
	}
	c.Flags().StringVar(&sandbox, "sandbox", "", "the sandbox that gets the spare (default: the node's own)")
	return c
}

// printWarnings prints an operation's warnings on stderr (templates holding most of the
// memory limit).
func printWarnings(r *apitypes.OpResult) {
	for _, w := range r.Warnings {
		fmt.Fprintf(os.Stderr, "deltabox: warning: %s\n", w)
	}
}

func syncCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "sync",
		Short: "Wait until every node and sandbox record is durable on disk",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return cli().Sync(ctx())
		},
	}
}

func imageCmd() *cobra.Command {
	c := &cobra.Command{Use: "image", Short: "Manage images"}
	c.AddCommand(&cobra.Command{
		Use:   "ls",
		Short: "List images",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			ims, err := cli().Images(ctx())
			if err != nil {
				return err
			}
			if jsonOut {
				printJSON(ims)
				return nil
			}
			fmt.Printf("%-16s %-10s %s\n", "IMAGE", "SIZE", "SOURCE")
			for _, im := range ims {
				fmt.Printf("%-16s %-10s %s\n", im.Name, humanBytes(im.Bytes), im.Source)
			}
			return nil
		},
	})
	c.AddCommand(imageImportCmd(), imageRmCmd())
	return c
}

func humanBytes(b int64) string {
	switch {
	case b < 0:
		return "?"
	case b < 1<<10:
		return fmt.Sprintf("%d B", b)
	case b < 1<<20:
		return fmt.Sprintf("%.1f KiB", float64(b)/(1<<10))
	case b < 1<<30:
		return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20))
	default:
		return fmt.Sprintf("%.2f GiB", float64(b)/(1<<30))
	}
}
