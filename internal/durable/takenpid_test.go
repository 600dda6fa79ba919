package durable

import "testing"

// A failed restore names the PID CRIU found taken, from its log, not the root's when
// another task's was (the EEXIST of a child's PID).
func TestTakenPid(t *testing.T) {
	for _, tc := range []struct {
		msg  string
		want int
	}{
		{`criu restore failed (errno 17); the end of its log x/restore.log: "Error (criu/cr-restore.c:1230): Can't fork for 23: File exists | Error (criu/cr-restore.c:2320): Restoring FAILED."`, 23},
		{`criu restore failed (errno 17); the end of its log x/restore.log: "Error (criu/cr-restore.c:2320): Restoring FAILED."`, 15},
	} {
		if got := takenPid(tc.msg, 15); got != tc.want {
			t.Errorf("takenPid(%q, 15) = %d, want %d", tc.msg, got, tc.want)
		}
	}
}
