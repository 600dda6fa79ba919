package e2e

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/testutil"
)

// TestFastPathThreadIsARefusal: a python session that runs a thread refuses the
// checkpoint with 409 (not 500), naming the session and the process by its PID in the
// sandbox, with what to do; nothing changes, and the checkpoint works once the thread
// has ended.
func TestFastPathThreadIsARefusal(t *testing.T) {
	d := testutil.StartDaemon(t)
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
	dbxSh(t, d, "ks", "kill -9 "+pid)
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
