package main

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"deltabox/internal/bench"
	"deltabox/internal/client"
)

func benchMCTSCmd() *cobra.Command {
	o := bench.DefaultMCTSOptions()
	var out, thinks, systems string
	var short bool
	c := &cobra.Command{
		Use:   "mcts [--json FILE] [--short]",
		Short: "Run one tree search with DeltaBox, then replay it with its baselines, at 0 s and 2 s of think",
		Long: `Runs examples/mcts.py (UCT over a scripted agent fixing bugs in CPython's json
package, scored by its real tests and by its python session's memory) against the
daemon, recording trajectory.json; then replays the same trajectory (same nodes, same
order) with workload/baselines.py: an isolated reference run (every node rebuilt from
scratch, its own commands timed), copytree+replay, fs-only+replay, the fs-only negative
control, git-reset+replay and criu+copytree. Each row gives the total, think and
state-management time, the overhead over the isolated commands' time, and whether every
node's score equals the reference's, and its state_frac (state / total, the share the
seed's SWE-bench table reports). --workload django runs the same on Django 4.2's
repository, its own test suite (tests/runtests.py, sqlite) and its Python environment,
all in the workspace (62 MB, ~7,700 files: SWE-bench-sized). Needs the workload prepared by scripts/setup.sh,
python3 on the host, and CRIU for criu+copytree (run the way its self-test found to
work here, with CRIU_FAULT=130 where hardware breakpoints are not delivered, or marked
unavailable). The default (100 expansions, 49
rollbacks, every system at 0 s and 2 s of think) takes about 30 minutes; --short takes
seconds. Run it from the repository or pass --repo.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			fl := cmd.Flags()
			if short {
				keep := o
				o.ShortMCTS()
				for name, v := range map[string]*int{"expansions": &o.Expansions, "rollbacks": &o.Rollbacks, "k": &o.K, "bugs": &o.Bugs} {
					if fl.Changed(name) {
						*v = map[string]int{"expansions": keep.Expansions, "rollbacks": keep.Rollbacks, "k": keep.K, "bugs": keep.Bugs}[name]
					}
				}
			}
			if fl.Changed("thinks") || !short {
				o.Thinks = nil
				for _, s := range strings.Split(thinks, ",") {
					v, err := strconv.ParseFloat(strings.TrimSpace(s), 64)
					if err != nil {
						return fmt.Errorf("--thinks %q: want seconds like 0,2", thinks)
					}
					o.Thinks = append(o.Thinks, v)
				}
			}
			if fl.Changed("systems") {
				o.Systems = nil
				for _, s := range strings.Split(systems, ",") {
					if s = strings.TrimSpace(s); s != "" {
						o.Systems = append(o.Systems, s)
					}
				}
			}
			repo, err := bench.FindRepo(o.Repo)
			if err != nil {
				return err
			}
			o.Repo = repo
			o.Socket = socketPath
			o.Command = "deltabox " + bench.ShellJoin(os.Args[1:])
			o.Log = os.Stderr
			f, err := bench.RunMCTS(ctx(), client.New(socketPath), o)
			if f != nil && len(f.MCTS) > 0 {
				fmt.Print(bench.FormatMCTS(f))
				fmt.Printf("took %.0f s\n", f.DurationS)
			}
			if out != "" && f != nil && len(f.MCTS) > 0 {
				if werr := bench.WriteFile(out, f); werr != nil {
					return werr
				}
				fmt.Fprintln(os.Stderr, "wrote", out)
			}
			return err
		},
	}
	fl := c.Flags()
	// --json FILE here shadows the global --json switch.
	fl.StringVar(&out, "json", "", "write the results as JSON to FILE")
	fl.BoolVar(&short, "short", false, "a few nodes at 0 s think only, for CI (6 expansions, 2 rollbacks, k 3, 1 bug; django: 4 expansions, 1 rollback; explicit options still win)")
	fl.StringVar(&o.Workload, "workload", o.Workload, "what the search works on: jsonlib (CPython's json package) or django (Django 4.2's repository, test suite and environment)")
	fl.StringVar(&thinks, "thinks", "0,2", "think seconds per expansion, comma-separated; every system runs at each")
	fl.IntVar(&o.Expansions, "expansions", o.Expansions, "expansions of the search")
	fl.IntVar(&o.Rollbacks, "rollbacks", o.Rollbacks, "rollbacks of the search")
	fl.IntVar(&o.K, "k", o.K, "proposals per node")
	fl.IntVar(&o.Bugs, "bugs", o.Bugs, "bugs injected into the task")
	fl.IntVar(&o.Seed, "seed", o.Seed, "task and agent seed")
	fl.StringVar(&systems, "systems", strings.Join(bench.MCTSBaselines, ","), "baselines to run, comma-separated")
	fl.StringVar(&o.Repo, "repo", "", "the repository with examples/ and workload/ (default: the current directory or a parent, or the binary's)")
	fl.StringVar(&o.Python, "python", o.Python, "the host's python3 (drives the search and the replays)")
	fl.StringVar(&o.CRIU, "criu", o.CRIU, "the criu binary (criu+copytree)")
	fl.IntVar(&o.TemplateBudgetMB, "template-budget-mb", 0, "the search sandbox's template_budget_mb (0: the daemon's default); under a small one nodes are evicted and restored from their durable images (counted: evicted_nodes, image_restores)")
	fl.StringVar(&o.CRIUImages, "criu-images", o.CRIUImages, "directory on tmpfs for CRIU's images")
	fl.StringVar(&o.WorkDir, "workdir", "", "directory for the trajectories and the replays' results, kept (default: a temporary directory, removed unless --keep)")
	fl.BoolVar(&o.Keep, "keep", false, "keep the temporary work directory (trajectories, per-system results) and print where it is")
	fl.StringArrayVar(&o.Notes, "note", nil, "a note to record in the results (repeatable), e.g. where the daemon runs")
	return c
}
