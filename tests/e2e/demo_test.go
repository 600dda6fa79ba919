package e2e

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"deltabox/internal/testutil"
)

// TestDemo runs scripts/demo.sh, the README's first command, against a private daemon
// (DELTABOX_SOCKET: the script then neither sets the machine up nor touches the default
// daemon) and checks that it shows what DeltaBox is for (issue 16): a python session's
// objects and the files coming back together, the latency of each step beside copying
// the workspace and replaying the session, and what to do next, whose Python snippet
// runs.
func TestDemo(t *testing.T) {
	repo := pycRepo(t)
	script, err := os.ReadFile(filepath.Join(repo, "scripts", "demo.sh"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(script), "DELTABOX_SOCKET") {
		t.Fatal("scripts/demo.sh cannot run against a private daemon (DELTABOX_SOCKET): it would set up this machine and restart the default daemon")
	}
	d := testutil.StartDaemon(t)
	cmd := testutil.Command(t, 10*time.Minute, "bash", "scripts/demo.sh")
	cmd.Dir = repo
	cmd.Env = append(os.Environ(), "DELTABOX_SOCKET="+d.Socket)
	out, err := cmd.CombinedOutput()
	t.Logf("scripts/demo.sh:\n%s", out)
	if err != nil {
		t.Fatalf("scripts/demo.sh: %v; the daemon's log:\n%s", err, d.Log())
	}
	text := string(out)
	for _, re := range []string{
		// The session's objects, made, broken, and back with the files.
		`model step 3, 200000 weights, 100000 cache entries\n(?s:.*)model step 99, 0 weights, 0 cache entries\n(?s:.*)restore +n[0-9a-f]+ +[0-9.]+ ms in the daemon  \(1 process: session py\)\nmodel step 3, 200000 weights, 100000 cache entries\n[0-9a-f]+ init\ndef add`,
		`checkpoint n[0-9a-f]+ +[0-9.]+ ms in the daemon  \(1 process: session py\); its template: [0-9]+ MiB resident`,
		`copy /workspace \(cp -a\): +[0-9.]+ ms`,
		`replay the python session's code: +[0-9.]+ ms`,
		`demo-[0-9]+  checkpoints 2 \(process 2, files only 0\)  restores 11 \(process 11, files only 0\)`,
		`which prints:\n +\(10, 'v1'\)\n +checkpoint [0-9.]+ ms, template [0-9]+ MiB`,
		`examples/mcts.py`,
	} {
		if !regexp.MustCompile(re).MatchString(text) {
			t.Errorf("the demo's output lacks %s", re)
		}
	}
	if strings.Contains(text, "warning:") {
		t.Errorf("the demo warns")
	}
	// It cleans up after itself.
	sbs, err := d.C.List(dbxCtx(t))
	if err != nil || len(sbs) != 0 {
		t.Errorf("the demo left sandboxes: %v %v", sbs, err)
	}
}
