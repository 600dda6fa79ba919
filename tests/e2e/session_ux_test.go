package e2e

import (
	"strings"
	"testing"
	"time"

	"deltabox/internal/api"
	"deltabox/internal/apitypes"
	"deltabox/internal/state"
	"deltabox/internal/testutil"
)

// TestCommandSessionLogsSurviveCheckpoint: what a command session printed before a
// checkpoint is still in its logs after it, and after a restore to it.
func TestCommandSessionLogsSurviveCheckpoint(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "lg")
	if _, err := d.C.StartSession(dbxCtx(t), "lg", state.SessionOptions{Name: "job", Argv: []string{"python3", "-u", "-c",
		"import time, os\nprint('started', flush=True)\nwhile not os.path.exists('/tmp/go'): time.sleep(0.02)\nprint('went on', flush=True)\ntime.sleep(1000)"}}); err != nil {
		t.Fatal(err)
	}
	waitLogs := func(want string) string {
		t.Helper()
		var logs string
		for i := 0; i < 250; i++ {
			var err error
			if logs, err = d.C.SessionLogs(dbxCtx(t), "lg", "job"); err != nil {
				t.Fatal(err)
			}
			if strings.Contains(logs, want) {
				return logs
			}
			time.Sleep(20 * time.Millisecond)
		}
		l, _ := d.C.Sessions(dbxCtx(t), "lg")
		t.Fatalf("session logs %q, want %q (sessions %+v)", logs, want, l)
		return ""
	}
	waitLogs("started")
	n := dbxCheckpoint(t, d, "lg", "started")
	if n.Processes != 1 {
		t.Fatalf("checkpoint took %d processes, want the job (%v)", n.Processes, n.ProcessErrors)
	}
	if logs := waitLogs("started"); strings.Contains(logs, "went on") {
		t.Fatalf("logs after the checkpoint: %q", logs)
	}
	sessRun(t, d, "lg", "main", "touch /tmp/go")
	if logs := waitLogs("went on"); !strings.Contains(logs, "started") {
		t.Fatalf("logs lost what came before the checkpoint: %q", logs)
	}
	dbxRestore(t, d, "lg", n.Node.ID)
	if logs := waitLogs("started"); strings.Contains(logs, "went on") {
		t.Fatalf("logs after a restore to the node: %q, want what the job had printed by then", logs)
	}
}

// TestSessionStartRelativeDir: a session's relative dir is resolved against the
// sandbox's workdir, as exec's is. On main it was refused.
func TestSessionStartRelativeDir(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "rel")
	sessRun(t, d, "rel", "main", "mkdir -p sub/dir")
	for _, k := range []string{"bash", "python"} {
		if _, err := d.C.StartSession(dbxCtx(t), "rel", state.SessionOptions{Name: "s" + k, Kind: apitypes.SessionKind(k), Dir: "sub/dir"}); err != nil {
			t.Fatalf("%s session in a relative dir: %v", k, err)
		}
	}
	if out := sessRun(t, d, "rel", "sbash", "pwd"); out != "/workspace/sub/dir\n" {
		t.Fatalf("bash session cwd %q", out)
	}
	if out := sessRun(t, d, "rel", "spython", "import os\nos.getcwd()"); out != "'/workspace/sub/dir'\n" {
		t.Fatalf("python session cwd %q", out)
	}
	r := dbxExec(t, d, "rel", api.ExecRequest{Argv: []string{"pwd"}, Dir: "sub/dir"})
	if r.Stdout != "/workspace/sub/dir\n" {
		t.Fatalf("exec cwd %q", r.Stdout)
	}
}
