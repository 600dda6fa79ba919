package e2e

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"deltabox/internal/deadline"
	"deltabox/internal/testutil"
)

// TestExamples runs the tree-search workload against a private daemon: the bug
// catalogue's verification with the real test suite (workload/tasks.py --verify),
// then each example of examples/ in its short mode, checking its exit code, the lines
// it prints and the trajectory.json it writes. At the end the examples must have
// removed their sandboxes and their checkpoints.
func TestExamples(t *testing.T) {
	py, err := exec.LookPath("python3")
	testutil.Require(t, err == nil, "needs python3 for the examples: %v", err)
	workloads := filepath.Join(testutil.MainRoot(), "workloads")
	_, err = os.Stat(filepath.Join(workloads, "jsonlib", "manifest.json"))
	testutil.Require(t, err == nil, "the jsonlib workload is not prepared (run scripts/setup.sh): %v", err)
	repo := exRepo(t)
	d := testutil.StartDaemon(t)
	env := map[string]string{
		"DELTABOX_SOCKET":         d.Socket,
		"DELTABOX_WORKLOADS":      workloads,
		"PYTHONPATH":              filepath.Join(repo, "clients", "python") + ":" + repo,
		"PYTHONDONTWRITEBYTECODE": "1",
		"PYTHONUNBUFFERED":        "1",
	}
	run := func(t *testing.T, args ...string) string {
		t.Helper()
		start := time.Now()
		out, err := exCmd(t, py, repo, env, args...).CombinedOutput()
		t.Logf("python3 %s (%.1fs):\n%s", strings.Join(args, " "), time.Since(start).Seconds(), out)
		if err != nil {
			t.Fatalf("python3 %s: %v; the daemon's log:\n%s", strings.Join(args, " "), err, d.Log())
		}
		return string(out)
	}

	t.Run("verify-catalogue", func(t *testing.T) {
		if testing.Short() {
			t.Skip("-short: the catalogue's verification runs the suite ~75 times (20 s)")
		}
		out := run(t, "-m", "workload.tasks", "--verify")
		exWant(t, out, `(?m)^pristine whole suite\s+ok`, `(?m)^all hold: \d+ mutations`)
		if strings.Contains(out, " FAIL ") {
			t.Errorf("a mutation does not hold")
		}
	})

	t.Run("mcts", func(t *testing.T) {
		dir := t.TempDir()
		out := run(t, "examples/mcts.py", "--short", "--out", dir)
		// The process fast path keeps the agent's python session across checkpoints
		// and rollbacks: its memory matches the path at every node.
		if n := exInt(t, out, `(?m)^session state intact at (\d+) of 6 expanded nodes`); n != 6 {
			t.Errorf("session state intact at %d of 6 nodes, want all with the process fast path", n)
		}
		exWant(t, out,
			`(?m)^root: unsolved  tests \d+/\d+`,
			`(?m)^\[  1\] n1 `,
			`(?m)^      rollback 1: n\d+ -> n\d+ `,
			`(?m)^expansions: 6  rollbacks: \d+  \(planned 6 and 2`,
			`(?m)^fix found: yes, at expansion \d+`,
			`(?m)^  checkpoint .* calls`,
			`(?m)^  restore .* calls`,
			`(?m)^  time in checkpoint/restore/fork: [0-9.]+ s of [0-9.]+ s total`)
		rb := exInt(t, out, `(?m)^expansions: 6  rollbacks: (\d+)`)
		if rb < 2 {
			t.Errorf("%d rollbacks, want at least the 2 planned", rb)
		}
		tr := exTrajectory(t, dir)
		if len(tr.Nodes) != 7 {
			t.Errorf("trajectory has %d nodes, want 7 (root + 6 expansions)", len(tr.Nodes))
		}
		n := 0
		for _, e := range tr.Events {
			if e.Type == "rollback" {
				n++
			}
		}
		if n != rb {
			t.Errorf("trajectory has %d rollback events, the output says %d", n, rb)
		}
		exCheckNodes(t, tr)
	})

	// Without the fast path a checkpoint ends the session: the same search scores
	// lower wherever the session's memory of the path is lost.
	t.Run("mcts-fastpath-off", func(t *testing.T) {
		t.Setenv("DELTABOX_FASTPATH", "0") // read by the daemon started here
		// A subtest's store is tests/TestExamples/NAME-x: remove the parent once empty
		// (registered first, so it runs after the store's own cleanup).
		t.Cleanup(func() { os.Remove(filepath.Join(testutil.MainRoot(), "tests", "TestExamples")) })
		d0 := testutil.StartDaemon(t)
		env0 := exWith(env, "DELTABOX_SOCKET", d0.Socket)
		start := time.Now()
		out, err := exCmd(t, py, repo, env0, "examples/mcts.py", "--short", "--out", t.TempDir()).CombinedOutput()
		t.Logf("examples/mcts.py --short, DELTABOX_FASTPATH=0 (%.1fs):\n%s", time.Since(start).Seconds(), out)
		if err != nil {
			t.Fatalf("examples/mcts.py: %v; the daemon's log:\n%s", err, d0.Log())
		}
		exWant(t, string(out), `\(session restarted\)`, `(?m)^fix found: yes`)
		if n := exInt(t, string(out), `(?m)^session state intact at (\d+) of 6 expanded nodes`); n >= 6 {
			t.Errorf("session state intact at %d of 6 nodes although checkpoints end processes", n)
		}
	})

	t.Run("best_of_n", func(t *testing.T) {
		dir := t.TempDir()
		out := run(t, "examples/best_of_n.py", "--short", "--out", dir)
		exWant(t, out,
			`(?m)^forked 2 sandboxes from n[0-9a-f]+ in `,
			`(?m)^fork paths: 2 (durable|files) \(`,
			`(?m)^attempt [01] step 1: `,
			`(?m)^best of 2: attempt [01], score [0-9.]+`,
			`(?m)^fix found: (yes|no)`,
			`(?m)^rolled the first sandbox over to the winner \(n[0-9a-f]+\): tests \d+/\d+ there`,
			`(?m)^  fork .* calls`,
			`(?m)^  time in checkpoint/restore/fork: `)
		tr := exTrajectory(t, dir)
		if len(tr.Nodes) < 3 {
			t.Errorf("trajectory has %d nodes, want the root and at least one step per attempt", len(tr.Nodes))
		}
		exCheckNodes(t, tr)
	})

	t.Run("rl_fanout", func(t *testing.T) {
		dir := t.TempDir()
		out := run(t, "examples/rl_fanout.py", "--short", "--out", dir)
		exWant(t, out,
			`(?m)^fork paths: 2 (durable|files) \(`,
			`(?m)^  round 1 rollout [01] step 1: `,
			`(?m)^round 1: scores [0-9.]+ [0-9.]+  mean `,
			`(?m)^rounds: \d+  rollouts: \d+  steps per rollout: 2  worker restores: \d+`,
			`(?m)^fix found: (yes|no)`,
			`(?m)^  time in checkpoint/restore/fork: `)
		rounds := exInt(t, out, `(?m)^rounds: (\d+)`)
		if rounds < 1 || rounds > 2 {
			t.Errorf("%d rounds, want 1 or 2", rounds)
		}
		if r := exInt(t, out, `worker restores: (\d+)`); r != 2*(rounds-1) {
			t.Errorf("%d worker restores, want %d (2 workers rolled back before each round after the first)", r, 2*(rounds-1))
		}
		exCheckNodes(t, exTrajectory(t, dir))
	})

	// The examples clean up after themselves: no sandbox and no checkpoint left.
	ctx := context.Background()
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
}

type exTraj struct {
	Example string `json:"example"`
	Task    struct {
		Bugs  []string `json:"bugs"`
		Tests []string `json:"tests"`
	} `json:"task"`
	Setup struct {
		Commands []map[string]any `json:"commands"`
	} `json:"setup"`
	Nodes []struct {
		ID       int              `json:"id"`
		Path     []string         `json:"path"`
		Commands []map[string]any `json:"commands"`
		Score    float64          `json:"score"`
		Tests    int              `json:"tests_passed"`
		Total    int              `json:"tests_total"`
	} `json:"nodes"`
	Events []struct {
		Type string `json:"type"`
	} `json:"events"`
}

func exTrajectory(t *testing.T, dir string) *exTraj {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "trajectory.json"))
	if err != nil {
		t.Fatal(err)
	}
	var tr exTraj
	if err := json.Unmarshal(b, &tr); err != nil {
		t.Fatalf("trajectory.json: %v", err)
	}
	if len(tr.Task.Bugs) == 0 || len(tr.Task.Tests) == 0 || len(tr.Setup.Commands) == 0 {
		t.Errorf("trajectory.json lacks the task or its setup: %+v", tr.Task)
	}
	return &tr
}

// exCheckNodes: every node but the root was made by an edit, a session call and a
// test run, all recorded; scores are at least the tests passed.
func exCheckNodes(t *testing.T, tr *exTraj) {
	t.Helper()
	for _, n := range tr.Nodes[1:] {
		if len(n.Path) == 0 || len(n.Commands) != 3 {
			t.Errorf("node %d: path %v, %d commands (want an edit, a session call and the tests)", n.ID, n.Path, len(n.Commands))
			continue
		}
		kinds := []string{}
		for _, c := range n.Commands {
			k, _ := c["kind"].(string)
			kinds = append(kinds, k)
		}
		if strings.Join(kinds, ",") != "exec,session,exec" {
			t.Errorf("node %d: commands %v", n.ID, kinds)
		}
		if n.Total == 0 || n.Tests > n.Total || n.Score < float64(n.Tests) {
			t.Errorf("node %d: tests %d/%d, score %v", n.ID, n.Tests, n.Total, n.Score)
		}
	}
}

func exWant(t *testing.T, out string, res ...string) {
	t.Helper()
	for _, re := range res {
		if !regexp.MustCompile(re).MatchString(out) {
			t.Errorf("output lacks %s", re)
		}
	}
}

func exInt(t *testing.T, out, re string) int {
	t.Helper()
	m := regexp.MustCompile(re).FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("output lacks %s", re)
	}
	n, _ := strconv.Atoi(m[1])
	return n
}

func exWith(env map[string]string, k, v string) map[string]string {
	out := make(map[string]string, len(env)+1)
	for a, b := range env {
		out[a] = b
	}
	out[k] = v
	return out
}

// exRepo is the repository's root (go test runs in tests/e2e).
func exRepo(t *testing.T) string {
	t.Helper()
	_, file, _, _ := runtime.Caller(0)
	repo, err := filepath.Abs(filepath.Join(filepath.Dir(file), "..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	return repo
}

// exCmd is python with args in dir, with env over this process's environment (less
// any PYTHONPATH or DELTABOX_* of the caller's).
func exCmd(t *testing.T, python, dir string, env map[string]string, args ...string) *deadline.Cmd {
	cmd := testutil.Command(t, 5*time.Minute, python, args...)
	cmd.Dir = dir
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		if k == "PYTHONPATH" || k == "PYTHONHOME" || strings.HasPrefix(k, "DELTABOX_") {
			continue
		}
		cmd.Env = append(cmd.Env, kv)
	}
	for k, v := range env {
		cmd.Env = append(cmd.Env, k+"="+v)
	}
	return cmd
}
