package state_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"deltabox/internal/cgroup"
	"deltabox/internal/errdefs"
	"deltabox/internal/sandbox"
	"deltabox/internal/sbinit"
	"deltabox/internal/state"
	"deltabox/internal/store"
	"deltabox/internal/testutil"
)

// TestMain lets the test binary serve as the sandbox init: the manager starts inits by
// re-executing /proc/self/exe, which here is this binary.
func TestMain(m *testing.M) {
	if len(os.Args) > 2 && os.Args[1] == sbinit.InitArg {
		sbinit.Main(os.Args[2])
		return
	}
	os.Exit(m.Run())
}

func open(t *testing.T, root string) *state.Manager {
	t.Helper()
	return openWith(t, root, state.DefaultConfig())
}

func openWith(t *testing.T, root string, cfg state.Config) *state.Manager {
	t.Helper()
	st, err := store.Open(root)
	if err != nil {
		t.Fatal(err)
	}
	cgroup.SetRootFor(root, store.DefaultRoot)
	// The test process is the daemon here: sandboxes left running at Close would outlive
	// it (adoption is tested end to end: tests/e2e/restart_test.go).
	cfg.StopSandboxes = true
	// Durable images make stopped copies of templates for a while after each checkpoint
	// (durable.go), which these tests would count as templates; images are tested end to
	// end (tests/e2e/durable_test.go).
	cfg.Durable = false
	m, err := state.New(st, slog.New(slog.NewTextHandler(io.Discard, nil)), cfg)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func sh(t *testing.T, m *state.Manager, id, script string) string {
	t.Helper()
	r, err := m.Exec(context.Background(), id, sandbox.ExecRequest{Argv: []string{"bash", "-c", script}, Timeout: 30 * time.Second})
	if err != nil {
		t.Fatalf("exec %q: %v", script, err)
	}
	if r.ExitCode != 0 {
		t.Fatalf("exec %q: exit %d: %s", script, r.ExitCode, r.Stderr)
	}
	return r.Stdout
}

// manifest lists /workspace and /tmp (path, type, mode, size, content hash), and the
// attributes of / (mode, owner, mtime, xattrs).
const manifest = `cd / && find workspace tmp -printf '%p %y %m %s\n' | sort && find workspace tmp -type f -exec sha256sum {} + | sort &&
	stat -c '%a %u %g %y' / && python3 -c 'import os; print(sorted((n, os.getxattr("/", n)) for n in os.listxattr("/")))'`

// frozenLayers lists the frozen layers on disk (non-empty frozen/ directories; an empty
// one may be a next state being prepared in the background).
func frozenLayers(t *testing.T, root string) []string {
	t.Helper()
	m, _ := filepath.Glob(filepath.Join(root, "layers", "*", "frozen"))
	var out []string
	for _, d := range m {
		if ents, _ := os.ReadDir(d); len(ents) > 0 {
			out = append(out, d)
		}
	}
	return out
}

// TestFailureAtEveryStepLeavesSandboxUnchanged injects a failure at each step of a
// checkpoint and of a restore, and checks that the sandbox is exactly as before: same
// files, same head, same tree, no new frozen layer, and it still works afterwards.
func TestFailureAtEveryStepLeavesSandboxUnchanged(t *testing.T) {
	root := testutil.NewStore(t)
	m := open(t, root)
	defer m.Close()
	ctx := context.Background()
	if _, err := m.Create(ctx, state.CreateOptions{ID: "f1"}); err != nil {
		t.Fatal(err)
	}
	sh(t, m, "f1", "echo base > a.txt && mkdir -p d && echo x > d/x")
	base, err := m.Checkpoint(ctx, "f1", "base")
	if err != nil {
		t.Fatal(err)
	}
	steps := map[string]int{"checkpoint": state.CheckpointStepCount, "restore": state.RestoreStepCount} // checkpointSteps, restoreSteps
	for _, op := range []string{"checkpoint", "restore"} {
		for step := 1; step <= steps[op]; step++ {
			t.Run(fmt.Sprintf("%s-step%d", op, step), func(t *testing.T) {
				// A change in the upper, so that both operations have real work to do.
				sh(t, m, "f1", fmt.Sprintf("echo %s%d >> a.txt && echo t > /tmp/t%d && rm -rf d && touch -d @%d / && python3 -c 'import os; os.setxattr(\"/\", \"user.step\", b\"%s%d\")'",
					op, step, step, 978307200+step, op, step))
				before := sh(t, m, "f1", manifest)
				info, _ := m.Get("f1")
				nodes := len(m.Tree().Nodes)
				frozen := frozenLayers(t, root)
				state.SetFailStep(m, func(o string, k int) error {
					if o == op && k == step {
						return fmt.Errorf("injected failure at %s step %d", o, k)
					}
					return nil
				})
				if op == "checkpoint" {
					err = checkpointFault(t, m, "f1", step, state.CheckpointOptions{Label: "x"}, false)
				} else {
					_, err = m.Restore(ctx, "f1", base.Node.ID)
				}
				state.SetFailStep(m, nil)
				if err == nil || !strings.Contains(err.Error(), "injected") {
					t.Fatalf("%s with a failure at step %d: err = %v, want the injected failure", op, step, err)
				}
				if after := sh(t, m, "f1", manifest); after != before {
					t.Fatalf("files changed by a failed %s:\nbefore:\n%s\nafter:\n%s", op, before, after)
				}
				info2, _ := m.Get("f1")
				if info2.Head != info.Head || info2.Upper != info.Upper {
					t.Fatalf("position changed: head %s->%s upper %d->%d", info.Head, info2.Head, info.Upper, info2.Upper)
				}
				if n := len(m.Tree().Nodes); n != nodes {
					t.Fatalf("a failed %s left %d nodes, had %d", op, n, nodes)
				}
				if f := frozenLayers(t, root); len(f) != len(frozen) {
					t.Fatalf("a failed %s changed the frozen layers: %v -> %v", op, frozen, f)
				}
				// And the operation works once the fault is gone.
				if op == "checkpoint" {
					_, err = m.Checkpoint(ctx, "f1", "ok")
				} else {
					_, err = m.Restore(ctx, "f1", base.Node.ID)
				}
				if err != nil {
					t.Fatalf("%s after the fault: %v", op, err)
				}
			})
		}
	}
}

// TestInterruptedCheckpointIsRepairedAtStart simulates a crash between freezing a
// sandbox's upper and recording the node: the next start must give the sandbox its
// upper back, with every file.
func TestInterruptedCheckpointIsRepairedAtStart(t *testing.T) {
	root := testutil.NewStore(t)
	m := open(t, root)
	ctx := context.Background()
	if _, err := m.Create(ctx, state.CreateOptions{ID: "c1"}); err != nil {
		t.Fatal(err)
	}
	sh(t, m, "c1", "mkdir -p a/b && echo one > a/b/f && echo two > g && ln -s g link")
	want := sh(t, m, "c1", manifest)
	info, _ := m.Get("c1")
	if err := m.Sync(); err != nil {
		t.Fatal(err)
	}
	m.Close()

	st, err := store.Open(root)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Freeze(info.Upper); err != nil { // the crash happens right after this
		t.Fatal(err)
	}
	st.Close()

	m2 := open(t, root)
	defer m2.Close()
	if got := sh(t, m2, "c1", manifest); got != want {
		t.Fatalf("after repair:\n%s\nwant:\n%s", got, want)
	}
	// Its files are back in the upper; a frozen/ may exist again, empty, prepared for
	// the next checkpoint.
	if ents, _ := os.ReadDir(st.LayerFrozen(info.Upper)); len(ents) > 0 {
		t.Fatalf("layer %d is still frozen after the repair: %d entries", info.Upper, len(ents))
	}
	if n := len(m2.Tree().Nodes); n != 0 {
		t.Fatalf("the interrupted checkpoint left %d nodes", n)
	}
}

// checkpointFault runs a checkpoint of sandbox id whose step `step` fails (the caller
// set the fault), as a client sees it, and returns the failure. Before step 2, or when
// it answers at its end (without processes to fork, or o.Answer complete), the
// checkpoint itself fails. From step 2 on, a checkpoint that answers early (it must
// when mustEarly) answers with its node pending; then the sandbox's next call answers
// the failure (409) instead of running, and the node's id answers it too (404), as
// does a restore of it. The next call waits for the checkpoint's end, so the caller may
// clear the fault once this returns.
func checkpointFault(t *testing.T, m *state.Manager, id string, step int, o state.CheckpointOptions, mustEarly bool) error {
	t.Helper()
	ctx := context.Background()
	res, err := m.CheckpointWith(ctx, id, o)
	if err != nil {
		if mustEarly && step > 1 {
			t.Fatalf("checkpoint failing at step %d (after its early answer) failed before it: %v", step, err)
		}
		return err
	}
	if step == 1 || o.Answer == state.AnswerComplete {
		t.Fatalf("checkpoint failing at step %d answered %+v, want the failure", step, res)
	}
	if res.Node == nil || !res.Node.Pending || res.CompleteMS != 0 {
		t.Fatalf("checkpoint failing at step %d: answer %+v node %+v, want an early answer (node pending)", step, res, res.Node)
	}
	_, err = m.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"true"}, Timeout: 30 * time.Second})
	if !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), res.Node.ID) {
		t.Fatalf("the call after a checkpoint that failed at step %d after its answer: %v, want a 409 naming node %s", step, err, res.Node.ID)
	}
	if _, nerr := m.Node(res.Node.ID); !errors.Is(nerr, errdefs.ErrNotFound) || !strings.Contains(nerr.Error(), "injected") {
		t.Fatalf("node %s of a checkpoint that failed at step %d after its answer: %v, want 404 with the failure", res.Node.ID, step, nerr)
	}
	if _, rerr := m.Restore(ctx, id, res.Node.ID); !errors.Is(rerr, errdefs.ErrNotFound) || !strings.Contains(rerr.Error(), "injected") {
		t.Fatalf("restore of node %s, whose checkpoint failed at step %d after its answer: %v, want 404 with the failure", res.Node.ID, step, rerr)
	}
	return err
}
