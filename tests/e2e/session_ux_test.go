package e2e

import (
	"testing"

	"deltabox/internal/api"
	"deltabox/internal/apitypes"
	"deltabox/internal/state"
	"deltabox/internal/testutil"
)

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
