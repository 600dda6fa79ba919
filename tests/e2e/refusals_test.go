package e2e

import (
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/errdefs"
	"deltabox/internal/testutil"
)

// TestFastPathThreadIsARefusal: a python session that runs a thread refuses the
// checkpoint with 409 (not 500), naming the session and the process by its PID in the
// sandbox, with what to do; nothing changes, and the checkpoint works once the thread
// has ended.
func TestFastPathThreadIsARefusal(t *testing.T) {
	// Durable images off: with them, CRIU takes the session instead (state/criutrees.go,
	// TestCRIUSessionTreesRoundTrip), and the refusal is what is left without it.
	d := testutil.StartDaemonEnv(t, testutil.NewStore(t), "DELTABOX_DURABLE=0")
	dbxCreate(t, d, "th")
	if _, err := d.C.StartSession(dbxCtx(t), "th", apitypes.SessionOptions{Name: "py", Kind: apitypes.SessionPython}); err != nil {
		t.Fatal(err)
	}
	sessRun(t, d, "th", "py", `import threading, os
ev = threading.Event()
th = threading.Thread(target=ev.wait); th.start()
x = 41`)
	pid := strings.TrimSpace(sessRun(t, d, "th", "py", "print(os.getpid())"))
	if _, err := strconv.Atoi(pid); err != nil {
		t.Fatalf("pid %q", pid)
	}
	fpRefused(t, d, "th", "session py", "process "+pid+" ", "more than one thread", "OMP_NUM_THREADS")
	sessRun(t, d, "th", "py", "ev.set(); th.join(); x += 1")
	dbxCheckpoint(t, d, "th", "single-threaded")
	if out := sessRun(t, d, "th", "py", "print(x)"); out != "42\n" {
		t.Fatalf("python after the refusal and a checkpoint: %q", out)
	}
}

// TestSessionKilledBySignalSaysWhich: a session whose process is killed by SIGKILL says
// "killed by SIGKILL" (it read "killed by killed").
func TestSessionKilledBySignalSaysWhich(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "ks")
	if _, err := d.C.StartSession(dbxCtx(t), "ks", apitypes.SessionOptions{Name: "py", Kind: apitypes.SessionPython}); err != nil {
		t.Fatal(err)
	}
	pid := strings.TrimSpace(sessRun(t, d, "ks", "py", "import os; print(os.getpid())"))
	dbxSignal(t, d, "ks", "KILL", pid)
	for i := 0; ; i++ {
		ss, err := d.C.Sessions(dbxCtx(t), "ks")
		if err != nil {
			t.Fatal(err)
		}
		var exit string
		for _, s := range ss {
			if s.Name == "py" && !s.Running {
				exit = s.Exit
			}
		}
		if exit == "killed by SIGKILL" {
			return
		}
		if i == 100 {
			t.Fatalf("the killed session's exit reads %q, want %q", exit, "killed by SIGKILL")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestAnswersNameSessions: a checkpoint's answer names the sessions whose processes the
// node keeps; a restore's names those it brought back and those it ended.
func TestAnswersNameSessions(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "an")
	dbxSh(t, d, "an", "echo 0 > f")
	c0 := dbxCheckpoint(t, d, "an", "none")
	if len(c0.Sessions) != 0 {
		t.Fatalf("a checkpoint without sessions names %v", c0.Sessions)
	}
	if _, err := d.C.StartSession(dbxCtx(t), "an", apitypes.SessionOptions{Name: "py", Kind: apitypes.SessionPython}); err != nil {
		t.Fatal(err)
	}
	sessRun(t, d, "an", "py", "x = 1")
	sessRun(t, d, "an", "main", "X=1")
	c1 := dbxCheckpoint(t, d, "an", "two")
	if got := strings.Join(c1.Sessions, ","); got != "main,py" {
		t.Fatalf("checkpoint sessions %q, want main,py", got)
	}
	r := dbxRestore(t, d, "an", c0.Node.ID)
	if len(r.Sessions) != 0 || strings.Join(r.SessionsEnded, ",") != "main,py" {
		t.Fatalf("restore to a node without sessions: sessions %v ended %v, want none and main,py", r.Sessions, r.SessionsEnded)
	}
	r = dbxRestore(t, d, "an", c1.Node.ID)
	if strings.Join(r.Sessions, ",") != "main,py" || len(r.SessionsEnded) != 0 {
		t.Fatalf("restore to the node with both: sessions %v ended %v, want main,py and none", r.Sessions, r.SessionsEnded)
	}
	if out := sessRun(t, d, "an", "py", "print(x)"); out != "1\n" {
		t.Fatalf("python after the restore: %q", out)
	}
}

// TestSessionCallRefusesWhatItWouldIgnore: a session call with dir, env or stdin is a
// 400 naming the field (they were dropped silently: a session call runs in the
// session's own directory and environment).
func TestSessionCallRefusesWhatItWouldIgnore(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "sc")
	for _, r := range []apitypes.ExecRequest{
		{Argv: []string{"pwd"}, Session: "main", Dir: "/tmp"},
		{Argv: []string{"echo $X"}, Session: "main", Env: []string{"X=1"}},
		{Argv: []string{"cat"}, Session: "main", Stdin: "in"},
	} {
		_, err := d.C.Exec(dbxCtx(t), "sc", r)
		if !errors.Is(err, errdefs.ErrInvalid) {
			t.Fatalf("session call %+v: %v, want invalid argument", r, err)
		}
	}
	if out := sessRun(t, d, "sc", "main", "pwd"); out != "/workspace\n" {
		t.Fatalf("session after the refusals: %q", out)
	}
}
