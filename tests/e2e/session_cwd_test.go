package e2e

import (
	"strings"
	"testing"

	"deltabox/internal/api"
	"deltabox/internal/state"
	"deltabox/internal/testutil"
)

// TestSessionRelativeDir: a session's dir, like an exec's, is relative to the sandbox's
// workdir (issue 16, item 8: cwd="src" in the Python client).
func TestSessionRelativeDir(t *testing.T) {
	d := testutil.StartDaemon(t)
	in, err := d.C.Create(dbxCtx(t), state.CreateOptions{ID: "cwd1", Workdir: "/srv/w"})
	if err != nil {
		t.Fatal(err)
	}
	dbxSh(t, d, in.ID, "mkdir -p src/deep")
	for _, o := range []state.SessionOptions{{Name: "b", Dir: "src"}, {Name: "p", Kind: "python", Dir: "src/deep"}} {
		if _, err := d.C.StartSession(dbxCtx(t), in.ID, o); err != nil {
			t.Fatalf("session %s with dir %q: %v", o.Name, o.Dir, err)
		}
	}
	if r := dbxExec(t, d, in.ID, api.ExecRequest{Session: "b", Argv: []string{"pwd"}}); r.Stdout != "/srv/w/src\n" {
		t.Fatalf("bash session in src: %q", r.Stdout)
	}
	if r := dbxExec(t, d, in.ID, api.ExecRequest{Session: "p", Argv: []string{"import os; os.getcwd()"}}); r.Stdout != "'/srv/w/src/deep'\n" {
		t.Fatalf("python session in src/deep: %q", r.Stdout)
	}
	_, err = d.C.StartSession(dbxCtx(t), in.ID, state.SessionOptions{Name: "x", Dir: "missing"})
	if err == nil || !strings.Contains(err.Error(), "/srv/w/missing") {
		t.Fatalf("a missing relative dir: %v, want an error naming /srv/w/missing", err)
	}
}
