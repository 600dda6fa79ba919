package e2e

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"deltabox/internal/deadline"
	"deltabox/internal/testutil"
)

// TestPythonClient runs the Python client's unittest suite (clients/python/tests)
// against a private daemon, so that the client is tested by the project's go test:
//
//   - source: python3 with PYTHONPATH=clients/python (usable without installing);
//   - python3.9: the same with Python 3.9, the oldest the client supports, when this
//     machine has one (pyenv's included);
//   - installed: `pip install ./clients/python` into a fresh venv with no package
//     index at all, then the suite against the installed package.
func TestPythonClient(t *testing.T) {
	py, err := exec.LookPath("python3")
	testutil.Require(t, err == nil, "needs python3 for the Python client's tests: %v", err)
	repo := pycRepo(t)
	d := testutil.StartDaemonNoImages(t)
	env := map[string]string{
		"DELTABOX_SOCKET":         d.Socket,
		"PYTHONDONTWRITEBYTECODE": "1",
		"PYTHONUNBUFFERED":        "1",
	}
	src := filepath.Join(repo, "clients", "python")

	t.Run("source", func(t *testing.T) {
		pycUnittest(t, d.Log, py, repo, pycWith(env, "PYTHONPATH", src))
	})

	t.Run("python3.9", func(t *testing.T) {
		py39 := pycFindPython39()
		if py39 == "" {
			t.Skip("no Python 3.9 on this machine (python3.9 or pyenv's versions/3.9.*)")
		}
		pycUnittest(t, d.Log, py39, repo, pycWith(env, "PYTHONPATH", src))
	})

	t.Run("installed", func(t *testing.T) {
		venv := filepath.Join(t.TempDir(), "venv")
		out, err := pycCmd(t, py, repo, env, "-m", "venv", venv).CombinedOutput()
		testutil.Require(t, err == nil, "cannot make a venv with %s (%v): %s", py, err, out)
		vpy := filepath.Join(venv, "bin", "python")
		// No index at all: the package must build with its own backend, offline.
		pipEnv := pycWith(env, "PIP_NO_INDEX", "1")
		out, err = pycCmd(t, vpy, repo, pipEnv, "-m", "pip", "install", "--no-input", "./clients/python").CombinedOutput()
		if err != nil {
			t.Fatalf("pip install ./clients/python: %v\n%s", err, out)
		}
		// From a directory with no deltabox in it, the installed package is imported.
		where, err := pycCmd(t, vpy, t.TempDir(), env, "-c", "import deltabox; print(deltabox.__file__)").CombinedOutput()
		if err != nil || !strings.HasPrefix(strings.TrimSpace(string(where)), venv) {
			t.Fatalf("import deltabox from the venv: %v: %s", err, where)
		}
		pycUnittest(t, d.Log, vpy, t.TempDir(), pycWith(env, "DELTABOX_TEST_INSTALLED", "1"))
	})
}

// pycRepo is the repository's root (go test runs in tests/e2e).
func pycRepo(t *testing.T) string {
	t.Helper()
	_, file, _, _ := runtime.Caller(0)
	repo, err := filepath.Abs(filepath.Join(filepath.Dir(file), "..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	return repo
}

func pycWith(env map[string]string, k, v string) map[string]string {
	out := make(map[string]string, len(env)+1)
	for a, b := range env {
		out[a] = b
	}
	out[k] = v
	return out
}

// pycCmd is python with args in dir, with env over this process's environment
// (less any PYTHONPATH or DELTABOX_* of the caller's).
func pycCmd(t *testing.T, python, dir string, env map[string]string, args ...string) *deadline.Cmd {
	cmd := testutil.Command(t, 10*time.Minute, python, args...)
	cmd.Dir = dir
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		if k == "PYTHONPATH" || k == "PYTHONHOME" || strings.HasPrefix(k, "DELTABOX_") {
			continue
		}
		cmd.Env = append(cmd.Env, kv)
	}
	keys := make([]string, 0, len(env))
	for k := range env {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		cmd.Env = append(cmd.Env, k+"="+env[k])
	}
	return cmd
}

var (
	pycRanRE  = regexp.MustCompile(`(?m)^Ran (\d+) tests? in `)
	pycSkipRE = regexp.MustCompile(`(?m)^(\S+) \(.*\) \.\.\. skipped '(.*)'$`)
	pycOkRE   = regexp.MustCompile(`(?m)^(\S+) \(.*\) \.\.\. ok$`)
)

// pycRequired are the tests that must pass in every run, whatever skips: the client's
// report of what checkpoints and restores did with a real bash and python session's
// processes (kept, restored, ended), the split of a checkpoint's result from its node,
// the modules' one-way imports, and the asyncio client (its context manager, and a
// cancelled call ending its command on the daemon), must not go untested by a rename or
// a skip.
var pycRequired = []string{
	"test_process_models",
	"test_process_half_of_checkpoint_and_restore",
	"test_background_job_counts_as_a_process",
	"test_aio_calls_run_at_once",
	"test_aio_sandbox",
	"test_aio_cancel_closes_the_connection",
	"test_aio_cancel_ends_the_command",
	"test_aio_create_awaitable_and_context_manager",
	"test_checkpoint_result_and_node_are_split",
	"test_modules_import_in_one_direction",
}

// pycUnittest runs the client's suite with python in dir and fails t on a failure,
// on no test run, on a pycRequired test that did not pass, or on a daemon test skipped
// (under CI=true, on any skip).
func pycUnittest(t *testing.T, daemonLog func() string, python, dir string, env map[string]string) {
	t.Helper()
	tests := filepath.Join(pycRepo(t), "clients", "python", "tests")
	start := time.Now()
	cmd := pycCmd(t, python, dir, env, "-m", "unittest", "discover", "-s", tests, "-t", tests, "-v")
	out, err := cmd.CombinedOutput()
	t.Logf("%s -m unittest (%.1fs):\n%s", python, time.Since(start).Seconds(), out)
	if err != nil {
		t.Fatalf("the Python client's tests failed (%v); the daemon's log:\n%s", err, daemonLog())
	}
	m := pycRanRE.FindSubmatch(out)
	if m == nil {
		t.Fatalf("no unittest summary in the output")
	}
	if n, _ := strconv.Atoi(string(m[1])); n == 0 {
		t.Fatalf("unittest ran no test")
	}
	passed := map[string]bool{}
	for _, ok := range pycOkRE.FindAllSubmatch(out, -1) {
		passed[string(ok[1])] = true
	}
	for _, name := range pycRequired {
		if !passed[name] {
			t.Errorf("%s did not pass (renamed, skipped or missing from clients/python/tests?)", name)
		}
	}
	for _, s := range pycSkipRE.FindAllSubmatch(out, -1) {
		msg := string(s[1]) + ": " + string(s[2])
		if strings.Contains(string(s[2]), "DELTABOX_SOCKET") {
			t.Errorf("skipped although DELTABOX_SOCKET was set: %s", msg)
		} else if os.Getenv("CI") == "true" {
			t.Errorf("skipped (CI=true forbids skipping): %s", msg)
		} else {
			t.Logf("skipped: %s", msg)
		}
	}
}

// pycFindPython39 is a Python 3.9 interpreter that runs, or "".
func pycFindPython39() string {
	cands := []string{}
	if p, err := exec.LookPath("python3.9"); err == nil {
		cands = append(cands, p)
	}
	roots := []string{os.Getenv("PYENV_ROOT")}
	if h, err := os.UserHomeDir(); err == nil {
		roots = append(roots, filepath.Join(h, ".pyenv"))
	}
	for _, r := range roots {
		if r == "" {
			continue
		}
		m, _ := filepath.Glob(filepath.Join(r, "versions", "3.9*", "bin", "python3.9"))
		sort.Sort(sort.Reverse(sort.StringSlice(m)))
		cands = append(cands, m...)
	}
	for _, c := range cands {
		out, err := deadline.Command(context.Background(), 30*time.Second, c, "-c", "import sys; print(sys.version_info[:2] == (3, 9))").Output()
		if err == nil && strings.TrimSpace(string(out)) == "True" {
			return c
		}
	}
	return ""
}
