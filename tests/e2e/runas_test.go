package e2e

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"deltabox/internal/api"
	"deltabox/internal/state"
	"deltabox/internal/testutil"
)

// runasCreate creates a sandbox whose commands run as user.
func runasCreate(t *testing.T, d *testutil.Daemon, id, user string) *state.SandboxInfo {
	t.Helper()
	in, err := d.C.Create(dbxCtx(t), state.CreateOptions{ID: id, User: user})
	if err != nil {
		t.Fatalf("create sandbox %q as %q: %v", id, user, err)
	}
	return in
}

// TestRunAsExecAndSession: with user "1000", an exec and a bash session run with uid and
// gid 1000, HOME "/" (the default image lists no 1000), in a workdir the user owns; a
// file written is owned by 1000; the user cannot write /etc, read root's 0700 home or
// kill a root process. An exec may run as root again (user "0"), and the record keeps
// the user.
func TestRunAsExecAndSession(t *testing.T) {
	d := testutil.StartDaemon(t)
	in := runasCreate(t, d, "ra", "1000")
	if in.User != "1000" {
		t.Fatalf("the sandbox's record says user %q, want \"1000\"", in.User)
	}
	if got := dbxSh(t, d, "ra", `echo $(id -u) $(id -g) $(id -G) $HOME $(pwd)`); got != "1000 1000 1000 / /workspace\n" {
		t.Fatalf("exec: id -u, -g, -G, HOME, pwd: %q", got)
	}
	if got := sessRun(t, d, "ra", "main", `echo $(id -u) $(id -g)`); got != "1000 1000\n" {
		t.Fatalf("session: id -u, -g: %q", got)
	}
	if got := sessRun(t, d, "ra", "main", `echo hi > f && stat -c '%u:%g' f`); got != "1000:1000\n" {
		t.Fatalf("a file the session wrote is owned by %q, want 1000:1000", got)
	}
	r := dbxExec(t, d, "ra", api.ExecRequest{User: "0", Argv: []string{"bash", "-c",
		`mkdir -p /root && chmod 0700 /root && echo secret > /root/s && (sleep 300 >/dev/null 2>&1 & echo $!)`}})
	rootPid := strings.TrimSpace(r.Stdout)
	if r.ExitCode != 0 || rootPid == "" {
		t.Fatalf("set up as root (user \"0\"): exit %d: %s %s", r.ExitCode, r.Stdout, r.Stderr)
	}
	for _, c := range []struct{ what, script string }{
		{"write /etc", `echo x > /etc/owned`},
		{"append to /etc/passwd", `echo 'x::0:0::/:/bin/sh' >> /etc/passwd`},
		{"read /root (0700)", `cat /root/s`},
		{"list /root (0700)", `ls /root`},
		{"kill a root process", `kill -9 ` + rootPid},
	} {
		res := dbxExec(t, d, "ra", api.ExecRequest{Argv: []string{"bash", "-c", c.script}})
		if res.ExitCode == 0 {
			t.Errorf("as 1000, %s succeeded: %s", c.what, res.Stdout)
		}
	}
	if got := dbxSh(t, d, "ra", `kill -0 `+rootPid+` 2>&1; echo $?`); !strings.Contains(got, "Operation not permitted") {
		t.Errorf("kill -0 of root's process as 1000: %q, want EPERM", got)
	}
	if got := dbxExec(t, d, "ra", api.ExecRequest{Argv: []string{"id", "-u"}, User: "0"}).Stdout; got != "0\n" {
		t.Fatalf("exec with user \"0\": id -u = %q", got)
	}
	// A name: resolved in the sandbox's own files, supplementary groups included.
	dbxExec(t, d, "ra", api.ExecRequest{User: "0", Argv: []string{"bash", "-c",
		`echo 'bob:x:1001:1001:Bob:/home/bob:/bin/bash' >> /etc/passwd && echo 'bob:x:1001:' >> /etc/group && echo 'dev:x:2000:bob' >> /etc/group && mkdir -p /home/bob`}})
	if got := dbxExec(t, d, "ra", api.ExecRequest{Argv: []string{"bash", "-c", `echo $(id -u) $(id -G) $HOME $USER`}, User: "bob"}).Stdout; got != "1001 1001 2000 /home/bob bob\n" {
		t.Fatalf("exec as bob: id -u, -G, HOME, USER: %q", got)
	}
	if got := dbxExec(t, d, "ra", api.ExecRequest{Argv: []string{"id", "-u"}, User: "bob:dev"}).Stdout; got != "1001\n" {
		t.Fatalf("exec as bob:dev: id -u = %q", got)
	}
}

// TestRunAsBadUser: a user the sandbox's /etc/passwd does not list is a 400 at create
// naming it and what the file lists, and no sandbox is left; an exec naming one too.
func TestRunAsBadUser(t *testing.T) {
	d := testutil.StartDaemon(t)
	code, body := dbxRaw(t, d, http.MethodPost, "/sandboxes", `{"id":"rabad","user":"bob"}`)
	_, msg := dbxErrorBody(t, body)
	if code != http.StatusBadRequest || !strings.Contains(msg, `no user "bob" in the sandbox's /etc/passwd`) || !strings.Contains(msg, "root") {
		t.Fatalf("create with user bob: %d %s", code, msg)
	}
	if _, err := d.C.Get(dbxCtx(t), "rabad"); err == nil {
		t.Fatal("a sandbox was left by the refused create")
	}
	code, body = dbxRaw(t, d, http.MethodPost, "/sandboxes", `{"id":"rabad","user":"1000:nogroup2"}`)
	if _, msg := dbxErrorBody(t, body); code != http.StatusBadRequest || !strings.Contains(msg, `no group "nogroup2"`) {
		t.Fatalf("create with group nogroup2: %d %s", code, msg)
	}
	dbxCreate(t, d, "rabad")
	code, body = dbxRaw(t, d, http.MethodPost, "/sandboxes/rabad/exec", `{"argv":["id"],"user":"bob"}`)
	if _, msg := dbxErrorBody(t, body); code != http.StatusBadRequest || !strings.Contains(msg, `no user "bob"`) {
		t.Fatalf("exec with user bob: %d %s", code, msg)
	}
}

// TestRunAsCheckpointRestore: a python session running as 1000 across a checkpoint and a
// restore. The fast path cannot carry it (its move is an injected setns, which needs
// CAP_SYS_ADMIN and CAP_SYS_CHROOT in the tracee: state/runas.go), so both take the
// files only and say so: the session is ended (not killed half-moved, as the fast path
// did before it was turned off for such sandboxes), the files come back, and the
// restarted session runs as 1000 again.
func TestRunAsCheckpointRestore(t *testing.T) {
	d := testutil.StartDaemon(t)
	runasCreate(t, d, "rafp", "1000")
	if _, err := d.C.StartSession(dbxCtx(t), "rafp", state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	sessRun(t, d, "rafp", "py", "import os; x = 1; open('f', 'w').write('1')")
	n1, err := d.C.Checkpoint(dbxCtx(t), "rafp", "x=1")
	if err != nil {
		t.Fatalf("checkpoint of a python session as 1000: %v", err)
	}
	if len(n1.SessionsEnded) != 1 || n1.SessionsEnded[0] != "py" || n1.Processes != 0 {
		t.Fatalf("checkpoint of a python session as 1000: sessions kept %v, ended %v, processes %d (errors %v), want py ended", n1.Sessions, n1.SessionsEnded, n1.Processes, n1.ProcessErrors)
	}
	r, err := d.C.Run(dbxCtx(t), "rafp", "py", "import os; open('f', 'w').write('2'); print(os.getuid())", 30*time.Second)
	if err != nil || !r.SessionRestarted || r.Stdout != "1000\n" {
		t.Fatalf("the session after the checkpoint: %+v, %v; want restarted, uid 1000", r, err)
	}
	rr, err := d.C.Restore(dbxCtx(t), "rafp", n1.Node.ID)
	if err != nil {
		t.Fatalf("restore with a python session as 1000: %v", err)
	}
	if len(rr.SessionsEnded) != 1 || len(rr.Sessions) != 0 {
		t.Fatalf("restore: sessions %v, ended %v, want py ended", rr.Sessions, rr.SessionsEnded)
	}
	r, err = d.C.Run(dbxCtx(t), "rafp", "py", "import os; print(os.getuid(), open('f').read())", 30*time.Second)
	if err != nil || !r.SessionRestarted || r.Stdout != "1000 1\n" {
		t.Fatalf("the session after the restore: %+v, %v; want restarted, \"1000 1\"", r, err)
	}
	in, err := d.C.Get(dbxCtx(t), "rafp")
	if err != nil {
		t.Fatal(err)
	}
	if in.Stats.CheckpointPaths.RunAs != 1 || in.Stats.RestorePaths.RunAs != 1 {
		t.Fatalf("paths: checkpoint %+v, restore %+v; want run_as 1 each", in.Stats.CheckpointPaths, in.Stats.RestorePaths)
	}
}

// TestRunAsSurvivesRestart: the user is in the sandbox's record, so after a daemon
// restart its commands and sessions still run as that user.
func TestRunAsSurvivesRestart(t *testing.T) {
	d := testutil.StartDaemon(t)
	runasCreate(t, d, "rarst", "1000")
	d.Stop()
	d = testutil.StartDaemonOn(t, d.Root)
	in, err := d.C.Get(dbxCtx(t), "rarst")
	if err != nil || in.User != "1000" {
		t.Fatalf("after a restart: user %q, %v; want \"1000\"", in.User, err)
	}
	if got := dbxSh(t, d, "rarst", "id -u"); got != "1000\n" {
		t.Fatalf("exec after a restart: id -u = %q", got)
	}
	if got := sessRun(t, d, "rarst", "main", "id -u"); got != "1000\n" {
		t.Fatalf("session after a restart: id -u = %q", got)
	}
}
