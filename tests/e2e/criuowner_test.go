package e2e

import (
	"strings"
	"testing"

	"deltabox/internal/testutil"
)

// TestCRIUTreeOfSeveralUsers: a session's tree holds processes of two users of the
// sandbox (its root's bash and sleep, and a python3 that became nobody), which only
// CRIU can carry. The checkpoint carries all three, and a restore brings nobody's
// process back as nobody's. CRIU's dump reads every task's rlimits, which the kernel
// allows on another user's task only with CAP_SYS_RESOURCE over its user namespace:
// host root lacks it on these VMs and, no longer the namespace's owner, must dump as
// the owner (internal/durable/owner.go).
func TestCRIUTreeOfSeveralUsers(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "cuids"
	dbxCreate(t, d, id)
	sessRun(t, d, id, "main", "python3 -c 'import os,time; os.setgroups([]); os.setgid(65534); os.setuid(65534); time.sleep(1000)' >/dev/null 2>&1 &")
	sessRun(t, d, id, "main", "sleep 1000 >/dev/null 2>&1 &")
	cp := dbxCheckpoint(t, d, id, "a")
	if cp.CRIUProcesses != 3 {
		t.Fatalf("checkpoint: %d processes through CRIU, want 3 (bash, sleep, nobody's python3): %+v", cp.CRIUProcesses, cp)
	}
	dbxSh(t, d, id, "pkill -u nobody python3; true")
	res := dbxRestore(t, d, id, cp.Node.ID)
	if res.CRIUProcesses != 3 {
		t.Fatalf("restore: %d processes through CRIU, want 3: %+v", res.CRIUProcesses, res)
	}
	ps := dbxSh(t, d, id, "ps -eo uid=,comm=")
	found := false
	for _, l := range strings.Split(ps, "\n") {
		if f := strings.Fields(l); len(f) == 2 && f[0] == "65534" && f[1] == "python3" {
			found = true
		}
	}
	if !found {
		t.Errorf("after the restore, no python3 of nobody (uid 65534):\n%s", ps)
	}
}
