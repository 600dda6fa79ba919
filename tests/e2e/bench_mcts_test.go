package e2e

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"deltabox/internal/bench"
	"deltabox/internal/criu"
	"deltabox/internal/testutil"
)

// TestBenchMCTSShort runs `deltabox bench mcts --short` against a private daemon: the
// search with DeltaBox, then its replays (isolated reference, copytree+replay,
// fs-only+replay, the fs-only negative control, git-reset+replay, criu+copytree). Every
// system's node scores must equal the isolated reference's, the negative control's
// must not, and nothing may be left behind in the daemon.
func TestBenchMCTSShort(t *testing.T) {
	_, err := exec.LookPath("python3")
	testutil.Require(t, err == nil, "needs python3 for the search and the replays: %v", err)
	workloads := filepath.Join(testutil.MainRoot(), "workloads")
	_, err = os.Stat(filepath.Join(workloads, "jsonlib", "manifest.json"))
	testutil.Require(t, err == nil, "the jsonlib workload is not prepared (run scripts/setup.sh): %v", err)
	criuBin := bench.DefaultMCTSOptions().CRIU
	_, err = os.Stat(criuBin)
	testutil.Require(t, err == nil, "needs CRIU for criu+copytree (scripts/setup.sh builds it): %v", err)
	repo := exRepo(t)
	d := testutil.StartDaemon(t)

	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	// A tmpfs directory of the test's own: other runs on the machine put theirs in /dev/shm.
	shm, err := os.MkdirTemp("/dev/shm", "e2e-mcts-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(shm)
	f := mctsBench(t, d, repo, workloads, "--criu", criuBin, "--criu-images", shm)
	if f.Bench != "mcts" || f.Description == "" {
		t.Errorf("bench %q, description %d bytes", f.Bench, len(f.Description))
	}
	want := append([]string{bench.MCTSDeltaBox}, bench.MCTSBaselines...)
	got := map[string]bench.MCTSRow{}
	for _, r := range f.MCTS {
		if r.ThinkS != 0 {
			t.Errorf("row %s at %v s think in short mode", r.System, r.ThinkS)
		}
		got[r.System] = r
	}
	for _, sys := range want {
		r, ok := got[sys]
		if !ok {
			t.Errorf("no %s row", sys)
			continue
		}
		if _, failed := r.Info["error"]; failed {
			t.Errorf("%s failed: %v", sys, r.Info["error"])
			continue
		}
		if r.TotalS <= 0 || r.StateS <= 0 || len(r.Commands) == 0 {
			t.Errorf("%s: total %v s, state %v s, %d commands", sys, r.TotalS, r.StateS, len(r.Commands))
		}
		if n, _ := r.Info["nodes_scored"].(float64); n != 7 {
			t.Errorf("%s scored %v nodes, want 7 (root + 6 expansions)", sys, r.Info["nodes_scored"])
		}
		if sys == bench.MCTSNegative {
			if r.ScoresMatch {
				t.Errorf("the negative control (fs-only, no replay) matches the reference: the score does not see the session's memory")
			}
		} else if !r.ScoresMatch {
			t.Errorf("%s: scores differ from the isolated reference: %v", sys, r.Info)
		}
	}
	if len(f.MCTS) != len(want) {
		t.Errorf("%d rows, want %d", len(f.MCTS), len(want))
	}
	// criu+copytree ran the way CRIU's self-test found to work here.
	if c := f.Machine.CRIU; c == nil || !c.Usable() {
		t.Errorf("machine.criu: %+v", c)
	} else if m := got[bench.MCTSCRIUCopy].Info["criu_mode"]; m != string(c.Mode) {
		t.Errorf("criu+copytree ran in mode %v, the self-test found %s", m, c.Mode)
	}
	md := bench.Markdown([]*bench.File{f}, []string{"mcts.json"})
	if !strings.Contains(md, "### Targets") || !strings.Contains(md, "| fs-only | 0 |") {
		t.Errorf("the report lacks the mcts tables:\n%s", md)
	}

	// The search and the replays remove their sandboxes and checkpoints.
	sbs, err := d.C.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(sbs) != 0 {
		t.Errorf("%d sandboxes left behind", len(sbs))
	}
	tree, err := d.C.Tree(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(tree.Nodes) != 0 {
		t.Errorf("%d checkpoints left behind", len(tree.Nodes))
	}
	if left, _ := os.ReadDir(shm); len(left) != 0 {
		t.Errorf("CRIU images left behind in %s: %v", shm, left)
	}
}

// mctsBench runs `deltabox bench mcts --short` with args against d and returns its
// results.
func mctsBench(t *testing.T, d *testutil.Daemon, repo, workloads string, args ...string) *bench.File {
	t.Helper()
	return mctsBenchWithin(t, 4*time.Minute, d, repo, workloads, args...)
}

// mctsBenchWithin is mctsBench with the command's deadline.
func mctsBenchWithin(t *testing.T, limit time.Duration, d *testutil.Daemon, repo, workloads string, args ...string) *bench.File {
	t.Helper()
	out := filepath.Join(t.TempDir(), "mcts.json")
	cmd := testutil.Command(t, limit, testutil.Binary(t), append([]string{"--socket", d.Socket, "bench", "mcts", "--short",
		"--json", out, "--repo", repo}, args...)...)
	cmd.Dir = repo
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		if k == "PYTHONPATH" || k == "PYTHONHOME" || strings.HasPrefix(k, "DELTABOX_") {
			continue
		}
		cmd.Env = append(cmd.Env, kv)
	}
	cmd.Env = append(cmd.Env, "DELTABOX_WORKLOADS="+workloads)
	start := time.Now()
	b, err := cmd.CombinedOutput()
	t.Logf("deltabox bench mcts --short %s (%.1fs):\n%s", strings.Join(args, " "), time.Since(start).Seconds(), b)
	if err != nil {
		t.Fatalf("bench mcts: %v; the daemon's log:\n%s", err, d.Log())
	}
	f, err := bench.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// TestBenchMCTSCRIUHangs: with a criu that never returns, criu+copytree is marked
// unavailable with the self-test's reason; the bench neither hangs nor fails, and no
// process of the fake criu is left.
func TestBenchMCTSCRIUHangs(t *testing.T) {
	_, err := exec.LookPath("python3")
	testutil.Require(t, err == nil, "needs python3 for the search and the replays: %v", err)
	workloads := filepath.Join(testutil.MainRoot(), "workloads")
	_, err = os.Stat(filepath.Join(workloads, "jsonlib", "manifest.json"))
	testutil.Require(t, err == nil, "the jsonlib workload is not prepared (run scripts/setup.sh): %v", err)
	repo := exRepo(t)
	d := testutil.StartDaemon(t)
	fake, pids := hangingCRIU(t)
	f := mctsBench(t, d, repo, workloads, "--systems", bench.MCTSCRIUCopy, "--criu", fake)
	var row *bench.MCTSRow
	for i, r := range f.MCTS {
		if r.System == bench.MCTSCRIUCopy {
			row = &f.MCTS[i]
		}
	}
	if row == nil || !strings.Contains(row.Unavailable(), "did not finish within "+criu.ProbeTimeout.String()) {
		t.Fatalf("criu+copytree row: %+v", row)
	}
	if c := f.Machine.CRIU; c == nil || c.Mode != criu.Unusable {
		t.Errorf("machine.criu: %+v", c)
	}
	if md := bench.Markdown([]*bench.File{f}, nil); !strings.Contains(md, "| criu+copytree | 0 | unavailable: CRIU is unusable here") {
		t.Errorf("the report does not mark criu+copytree unavailable:\n%s", md)
	}
	noneLeft(t, pids)
}
