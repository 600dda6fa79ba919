package pydriver

import (
	"os/exec"
	"strings"
	"testing"

	"deltabox/internal/testutil"
)

// TestExecRunsAsTheInterpreterShows: run keeps globals across calls, returns the repr of
// a last expression (None for a statement or a None value), and names "<session>" in a
// traceback.
func TestExecRunsAsTheInterpreterShows(t *testing.T) {
	_, err := exec.LookPath("python3")
	testutil.Require(t, err == nil, "needs python3 on the host")
	prog := "import ast, traceback\n" + Exec + `
assert run("x = 41") is None
assert run("x + 1") == "42", run("x + 1")
assert run("'a'") == "'a'"
assert run("None") is None
assert run("def f():\n    return x\nf()") == "41"
try:
    run("1/0")
except ZeroDivisionError:
    assert "<session>" in traceback.format_exc()
print("ok")
`
	out, err := exec.Command("python3", "-c", prog).CombinedOutput()
	if err != nil || strings.TrimSpace(string(out)) != "ok" {
		t.Fatalf("python3: %v\n%s", err, out)
	}
}
