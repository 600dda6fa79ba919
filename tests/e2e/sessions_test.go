package e2e

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"deltabox/internal/api"
	"deltabox/internal/errdefs"
	"deltabox/internal/state"
	"deltabox/internal/testutil"
)

func sessRun(t *testing.T, d *testutil.Daemon, id, sess, code string) string {
	t.Helper()
	r, err := d.C.Run(dbxCtx(t), id, sess, code, 30*time.Second)
	if err != nil {
		t.Fatalf("%s: %q: %v", sess, code, err)
	}
	if r.ExitCode != 0 {
		t.Fatalf("%s: %q: exit %d: %s", sess, code, r.ExitCode, r.Stdout)
	}
	return r.Stdout
}

// TestBashSessionKeepsState: cwd, exported variables, shell variables, functions and
// aliases persist over 50 calls, and the history records the calls.
func TestBashSessionKeepsState(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "bs")
	sessRun(t, d, "bs", "main", `mkdir -p /tmp/w && cd /tmp/w; export EXP=e0; V=0; inc() { V=$((V+1)); }; alias say='echo said'`)
	for i := 1; i <= 50; i++ {
		out := sessRun(t, d, "bs", "main", fmt.Sprintf(`inc; export EXP=e%d; echo "$(pwd) $V $EXP $(bash -c 'echo $EXP')"; say %d`, i, i))
		want := fmt.Sprintf("/tmp/w %d e%d e%d\nsaid %d\n", i, i, i, i)
		if out != want {
			t.Fatalf("call %d: got %q, want %q", i, out, want)
		}
	}
	h := sessRun(t, d, "bs", "main", "history | tail -2")
	if !strings.Contains(h, "say 50") || strings.Contains(h, "__db_") {
		t.Fatalf("history should hold the calls and no protocol lines:\n%s", h)
	}
	// A terminal, for interactive programs; the exit code of the call.
	if tty := sessRun(t, d, "bs", "main", "tty; [ -t 0 ] && echo isatty"); !strings.Contains(tty, "/dev/pts/") || !strings.Contains(tty, "isatty") {
		t.Fatalf("session has no terminal: %q", tty)
	}
	r, err := d.C.Run(dbxCtx(t), "bs", "main", "f() { return 7; }; f", time.Minute)
	if err != nil || r.ExitCode != 7 {
		t.Fatalf("exit code: %+v %v", r, err)
	}
	// A long call goes through the terminal's line buffer in several lines.
	long := strings.Repeat("x", 20000)
	if out := sessRun(t, d, "bs", "main", "echo "+long+" | wc -c"); strings.TrimSpace(out) != "20001" {
		t.Fatalf("long call: %q", out)
	}
}

// TestPythonSessionKeepsObjects: globals survive between calls, including a dict of
// 10^5 objects; exceptions come back with a traceback and status 1.
func TestPythonSessionKeepsObjects(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "ps")
	if _, err := d.C.StartSession(dbxCtx(t), "ps", state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	sessRun(t, d, "ps", "py", "import os, random\nd = {i: str(i) * 3 for i in range(10**5)}\nrng = random.Random(5)\npid = os.getpid()")
	for i := 0; i < 5; i++ {
		out := sessRun(t, d, "ps", "py", "len(d), d[99999][:5], pid == os.getpid()")
		if out != "(100000, '99999', True)\n" {
			t.Fatalf("call %d: %q", i, out)
		}
	}
	r, err := d.C.Run(dbxCtx(t), "ps", "py", "def g():\n    raise ValueError('boom')\ng()", time.Minute)
	if err != nil || r.ExitCode != 1 || !strings.Contains(r.Stdout, "ValueError: boom") || !strings.Contains(r.Stdout, "Traceback") {
		t.Fatalf("exception: %+v %v", r, err)
	}
	if out := sessRun(t, d, "ps", "py", "len(d)"); out != "100000\n" {
		t.Fatalf("after an exception: %q", out)
	}
}

// TestSessionTimeoutInterruptsCommandNotSession, for bash and python.
func TestSessionTimeoutInterruptsCommandNotSession(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "to")
	d.C.StartSession(dbxCtx(t), "to", state.SessionOptions{Name: "py", Kind: "python"})
	sessRun(t, d, "to", "main", "KEEP=yes")
	sessRun(t, d, "to", "py", "keep = 'yes'")
	for _, c := range []struct{ sess, code, check string }{
		{"main", "sleep 1000", "echo $KEEP"},
		{"main", "while :; do :; done", "echo $KEEP"},
		{"py", "import time\nwhile True: time.sleep(0.01)", "print(keep)"},
	} {
		start := time.Now()
		r, err := d.C.Run(dbxCtx(t), "to", c.sess, c.code, 500*time.Millisecond)
		if err != nil {
			t.Fatalf("%s %q: %v", c.sess, c.code, err)
		}
		if !r.TimedOut || !strings.Contains(r.Stdout, "timed out") || time.Since(start) > 4*time.Second {
			t.Fatalf("%s %q: timed_out=%v after %v: %q", c.sess, c.code, r.TimedOut, time.Since(start), r.Stdout)
		}
		if out := sessRun(t, d, "to", c.sess, c.check); out != "yes\n" {
			t.Fatalf("%s lost its state after a timeout: %q", c.sess, out)
		}
	}
}

// TestSessionStartLongLivedCommand: a server started as a session keeps running
// across calls, its output is kept, and plain execs reach it.
func TestSessionStartLongLivedCommand(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "ll")
	if _, err := d.C.StartSession(dbxCtx(t), "ll", state.SessionOptions{Name: "srv", Argv: []string{"python3", "-m", "http.server", "8123"}}); err != nil {
		t.Fatal(err)
	}
	var body string
	for i := 0; i < 50; i++ {
		r, err := d.C.Exec(dbxCtx(t), "ll", api.ExecRequest{Argv: []string{"python3", "-c", "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8123/').status)"}})
		if err == nil && r.ExitCode == 0 {
			body = r.Stdout
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if body != "200\n" {
		t.Fatalf("the server session did not answer: %q", body)
	}
	logs, err := d.C.SessionLogs(dbxCtx(t), "ll", "srv")
	if err != nil || !strings.Contains(logs, "GET / HTTP") {
		t.Fatalf("session logs: %q %v", logs, err)
	}
	l, _ := d.C.Sessions(dbxCtx(t), "ll")
	if len(l) != 1 || !l[0].Running || l[0].Kind != "command" {
		t.Fatalf("sessions: %+v", l)
	}
	// A command session takes no calls; unknown sessions are 404.
	if _, err := d.C.Run(dbxCtx(t), "ll", "srv", "echo hi", time.Second); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("call into a command session: %v", err)
	}
	if _, err := d.C.Run(dbxCtx(t), "ll", "nope", "echo hi", time.Second); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("unknown session: %v", err)
	}
	if err := d.C.KillSession(dbxCtx(t), "ll", "srv"); err != nil {
		t.Fatal(err)
	}
	dbxWaitOnlyInit(t, d, "ll", 5*time.Second)
}

// TestStreamingDeliversOutputBeforeTheEnd, for plain exec and for a session.
func TestStreamingDeliversOutputBeforeTheEnd(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "st")
	for _, sess := range []string{"", "main"} {
		start := time.Now()
		var first time.Duration
		var got strings.Builder
		argv := []string{"bash", "-c", "echo first; sleep 2; echo second"}
		if sess != "" {
			argv = []string{"echo first; sleep 2; echo second"}
		}
		r, err := d.C.ExecStream(dbxCtx(t), "st", api.ExecRequest{Argv: argv, Session: sess}, func(stream, data string) {
			if first == 0 && strings.Contains(data, "first") {
				first = time.Since(start)
			}
			got.WriteString(data)
		})
		if err != nil {
			t.Fatal(err)
		}
		total := time.Since(start)
		if first == 0 || first > total-time.Second {
			t.Fatalf("session %q: first line after %v of %v: not streamed", sess, first, total)
		}
		if got.String() != "first\nsecond\n" || r.Stdout != "first\nsecond\n" {
			t.Fatalf("session %q: streamed %q, result %q", sess, got.String(), r.Stdout)
		}
	}
}

// TestCheckpointRestoreWithSessions: checkpoint and restore carry the sessions' process
// state (the fast path): after a checkpoint the session goes on as it was; a restore
// brings back its variables and cwd with the same PID; they answer 409 while a session
// call runs.
func TestCheckpointRestoreWithSessions(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "cr")
	pid := sessRun(t, d, "cr", "main", "echo v1 > f; V=one; cd /tmp; echo $$")
	n1 := dbxCheckpoint(t, d, "cr", "one")
	if n1.Processes != 1 || len(n1.ProcessErrors) > 0 {
		t.Fatalf("checkpoint took %d processes (%v), want the session's", n1.Processes, n1.ProcessErrors)
	}
	r, err := d.C.Run(dbxCtx(t), "cr", "main", "cat /workspace/f; echo v2 > /workspace/f; echo $V $$ $(pwd); V=two; cd /", time.Minute)
	if err != nil || r.SessionRestarted || r.Stdout != "v1\none "+strings.TrimSpace(pid)+" /tmp\n" {
		t.Fatalf("after a checkpoint: %+v %v", r, err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := d.C.Run(context.Background(), "cr", "main", "sleep 2", time.Minute)
		done <- err
	}()
	time.Sleep(500 * time.Millisecond)
	if _, err := d.C.Checkpoint(dbxCtx(t), "cr", "busy"); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("checkpoint during a session call: %v, want 409", err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	res := dbxRestore(t, d, "cr", n1.Node.ID)
	if res.Processes != 1 {
		t.Fatalf("restore brought back %d processes (%v)", res.Processes, res.ProcessErrors)
	}
	if out := sessRun(t, d, "cr", "main", "cat /workspace/f; echo $V $$ $(pwd)"); out != "v1\none "+strings.TrimSpace(pid)+" /tmp\n" {
		t.Fatalf("after restore: %q", out)
	}
}
