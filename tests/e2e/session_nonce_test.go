package e2e

import (
	"testing"
	"time"

	"deltabox/internal/testutil"
)

// sessRunWant runs code in a session and requires exactly want (output) and rc.
func sessRunWant(t *testing.T, d *testutil.Daemon, id, sess, code, want string, rc int) {
	t.Helper()
	r, err := d.C.Run(dbxCtx(t), id, sess, code, 30*time.Second)
	if err != nil {
		t.Fatalf("%s: %q: %v", sess, code, err)
	}
	if r.Stdout != want || r.ExitCode != rc {
		t.Fatalf("%s: %q: got %q exit %d, want %q exit %d (a call that ended on another call's sentinel?)", sess, code, r.Stdout, r.ExitCode, want, rc)
	}
}

// TestSessionCallAfterRestartAndRestore: a session restarted since a node, then restored
// to it, runs its next call. The restored shell holds the id of its last call before the
// checkpoint, and prints it after each line it reads; with ids from a per-session
// counter the restarted session's next call had that same id, and returned at once, exit
// 0 and no output, before its command ran.
func TestSessionCallAfterRestartAndRestore(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "nonce")
	for i := 0; i < 3; i++ {
		sessRun(t, d, "nonce", "main", "echo before")
	}
	n := dbxCheckpoint(t, d, "nonce", "three calls").Node.ID
	if err := d.C.KillSession(dbxCtx(t), "nonce", "main"); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 2; i++ { // the default session starts again: a new session
		sessRun(t, d, "nonce", "main", "echo restarted")
	}
	if op := dbxRestore(t, d, "nonce", n); op.Processes != 1 {
		t.Fatalf("restore brought back %d processes, want the shell", op.Processes)
	}
	for i := 0; i < 3; i++ {
		sessRunWant(t, d, "nonce", "main", "echo after; false", "after\n", 1)
	}
}

// TestSessionSentinelNotForgeable: a process of the sandbox that writes sentinels on a
// session's terminal, with every id it could know or guess (its copy of the shell's
// variables, counters, "ready"), cannot end another call early.
func TestSessionSentinelNotForgeable(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "forge")
	sessRun(t, d, "forge", "main", "echo warm")
	// A background job of the session: its output is the session's terminal. It starts
	// forging while the next call runs.
	sessRun(t, d, "forge", "main", `(sleep 0.5
printf '\036DBX:%s:0\036' "$__db_id" ready
for i in $(seq 0 100); do printf '\036DBX:c%d:0\036\036DBX:%d:0\036' $i $i; done) >/dev/tty 2>&1 &
disown`)
	start := time.Now()
	sessRunWant(t, d, "forge", "main", "sleep 1.5; echo real", "real\n", 0)
	if el := time.Since(start); el < 1500*time.Millisecond {
		t.Fatalf("the call returned after %v, before its command ended", el)
	}
	sessRunWant(t, d, "forge", "main", "echo next", "next\n", 0)
}
