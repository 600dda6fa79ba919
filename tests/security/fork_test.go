package security

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/testutil"
)

// forkProc is a process of the host, as the host sees it.
type forkProc struct {
	pid, uid     int
	state, pidns string
	uidMap       string
}

func forkReadProc(t *testing.T, pid int) (forkProc, bool) {
	t.Helper()
	p := forkProc{pid: pid}
	st, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return p, false
	}
	for _, l := range strings.Split(string(st), "\n") {
		f := strings.Fields(l)
		switch {
		case len(f) >= 2 && f[0] == "State:":
			p.state = f[1]
		case len(f) >= 2 && f[0] == "Uid:":
			p.uid, _ = strconv.Atoi(f[1])
		}
	}
	if p.pidns, err = os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", pid)); err != nil {
		return p, false
	}
	m, err := os.ReadFile(fmt.Sprintf("/proc/%d/uid_map", pid))
	if err != nil {
		return p, false
	}
	p.uidMap = strings.Join(strings.Fields(string(m)), " ")
	return p, true
}

// TestForkBranchesCannotReachEachOther: the branches of a fork (POST /v1/nodes/ID/fork)
// and the source sandbox are apart as any two sandboxes are: each runs the node's
// background process in a PID namespace of its own, as a host uid range of its own
// (the durable path restores the image's credentials inside each branch's user
// namespace); from branch 0, as its root, kill(2) reaches no PID but its own, /proc
// lists only its own, and kill -9 -1 leaves the sibling's and the source's processes
// running.
func TestForkBranchesCannotReachEachOther(t *testing.T) {
	d := testutil.StartDaemon(t)
	const src = "fsec"
	if _, err := d.C.Create(ctx(t), apitypes.CreateOptions{ID: src}); err != nil {
		t.Fatal(err)
	}
	marker := strconv.Itoa(4000000 + os.Getpid()%100000)
	if _, err := d.C.Run(ctx(t), src, "main", "nohup sleep "+marker+" </dev/null >/dev/null 2>&1 &", 30*time.Second); err != nil {
		t.Fatal(err)
	}
	cp, err := d.C.Checkpoint(ctx(t), src, "fsec")
	if err != nil {
		t.Fatal(err)
	}
	res, err := d.C.Fork(ctx(t), cp.Node.ID, apitypes.ForkRequest{Count: 2, CreateOptions: apitypes.CreateOptions{ID: "fsec-b"}})
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range res.Branches {
		if b.Path != "durable" {
			t.Fatalf("branch %d: path %s (%s): the test needs the processes carried", b.Branch, b.Path, b.Reason)
		}
	}
	// The running copies of the sleep (templates are stopped: T), as the host sees them.
	live := func() map[string]forkProc {
		out := map[string]forkProc{}
		for _, pid := range hostPidsWith(t, "sleep\x00"+marker) {
			if p, ok := forkReadProc(t, pid); ok && p.state == "S" {
				out[p.pidns] = p
			}
		}
		return out
	}
	var procs map[string]forkProc
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if procs = live(); len(procs) == 3 || time.Now().After(deadline) {
			break
		}
	}
	if len(procs) != 3 {
		t.Fatalf("want the sleep running in 3 PID namespaces (source, 2 branches), got %+v", procs)
	}
	uids, maps := map[int]bool{}, map[string]bool{}
	for _, p := range procs {
		uids[p.uid], maps[p.uidMap] = true, true
	}
	if len(uids) != 3 || len(maps) != 3 {
		t.Fatalf("the source and branches share host uids or uid maps: %+v", procs)
	}
	// Branch 0's own PIDs, and every PID it can signal (kill -0 of 1..65535, as root).
	r, err := d.C.Run(ctx(t), "fsec-b-0", "main", `own=" $(cd /proc && echo [0-9]*) "
for p in $(seq 1 65535); do
  kill -0 $p 2>/dev/null || continue
  case "$own" in *" $p "*) ;; *) echo "SIGNALLED $p";; esac
done
grep -l `+marker+` /proc/[0-9]*/cmdline 2>/dev/null | wc -l
echo done`, 120*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(r.Stdout, "SIGNALLED") || !strings.Contains(r.Stdout, "done") {
		t.Fatalf("branch 0 signals PIDs outside its /proc (or the scan did not finish):\n%s", r.Stdout)
	}
	// kill -9 -1 from branch 0's session (the sleep's parent: in its Landlock domain, so
	// that the kill reaches it): the sibling's and the source's sleeps go on. The
	// session dies with it: its call's error is expected.
	d.C.Run(ctx(t), "fsec-b-0", "main", "kill -9 -1", 30*time.Second)
	var after map[string]forkProc
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if after = live(); len(after) <= 2 || time.Now().After(deadline) {
			break
		}
	}
	for ns, p := range procs {
		q, ok := after[ns]
		if !ok || q.pid != p.pid {
			continue
		}
		delete(procs, ns)
	}
	if len(procs) != 1 {
		t.Fatalf("kill -9 -1 in branch 0 should end only its own sleep; still to end or gone: %+v (now %+v)", procs, after)
	}
	for _, p := range procs {
		if q, ok := after[p.pidns]; ok {
			t.Fatalf("branch 0's sleep survived its own kill -9 -1: %+v", q)
		}
	}
}

// TestForkFastBranchesCannotReachEachOther: the fast path's branches (sb.fork with
// the fast path on, the default) are siblings in the family's PID namespace, and the source moved
// into one of its own: each runs the node's background process at its PID in a PID and
// user namespace of its own (the family's host uids: docs/design/fork.md). From branch
// 0, as its root, kill(2) reaches no PID but its own and /proc lists only its own; from
// the source, /proc lists none of the branches' (no live code in their ancestor); so
// too from a member a later fork of the node made (forkfamily.go); kill -9 -1 from
// branch 0 leaves the siblings' and the source's processes running.
func TestForkFastBranchesCannotReachEachOther(t *testing.T) {
	d := testutil.StartDaemonEnv(t, testutil.NewStore(t), "DELTABOX_DURABLE=0")
	const src = "ffsec"
	if _, err := d.C.Create(ctx(t), apitypes.CreateOptions{ID: src}); err != nil {
		t.Fatal(err)
	}
	marker := strconv.Itoa(5000000 + os.Getpid()%100000)
	// Started by a command (its parent is init): the fast path forks it.
	if r, err := d.C.Exec(ctx(t), src, apitypes.ExecRequest{Argv: []string{"sh", "-c", "nohup sleep " + marker + " </dev/null >/dev/null 2>&1 &"}}); err != nil || r.ExitCode != 0 {
		t.Fatalf("start the sleep: %v %+v", err, r)
	}
	res, err := d.C.ForkSandbox(ctx(t), src, apitypes.SandboxForkRequest{ForkRequest: apitypes.ForkRequest{Count: 2, CreateOptions: apitypes.CreateOptions{ID: "ffsec-b"}}})
	if err != nil {
		t.Fatal(err)
	}
	// A later fork of the node: one more member of the family, by the fast path too.
	res2, err := d.C.Fork(ctx(t), res.Node, apitypes.ForkRequest{Count: 1, CreateOptions: apitypes.CreateOptions{ID: "ffsec-c"}})
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range append(res.Branches, res2.Branches...) {
		if b.Path != "fast" {
			t.Fatalf("branch %s: path %s (%s): the test needs the fast path", b.Sandbox.ID, b.Path, b.Reason)
		}
	}
	live := func() map[string]forkProc {
		out := map[string]forkProc{}
		for _, pid := range hostPidsWith(t, "sleep\x00"+marker) {
			if p, ok := forkReadProc(t, pid); ok && p.state == "S" {
				out[p.pidns] = p
			}
		}
		return out
	}
	var procs map[string]forkProc
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if procs = live(); len(procs) == 4 || time.Now().After(deadline) {
			break
		}
	}
	if len(procs) != 4 {
		t.Fatalf("want the sleep running in 4 PID namespaces (source, 2 branches, the later fork's), got %+v", procs)
	}
	scan := `own=" $(cd /proc && echo [0-9]*) "
for p in $(seq 1 65535); do
  kill -0 $p 2>/dev/null || continue
  case "$own" in *" $p "*) ;; *) echo "SIGNALLED $p";; esac
done
for f in /proc/[0-9]*/cmdline; do tr '\0' ' ' < $f 2>/dev/null | grep -q "^sleep ` + marker + `" && echo $f; done | wc -l
echo done`
	for _, sb := range []string{"ffsec-b-0", src, "ffsec-c"} {
		r, err := d.C.Run(ctx(t), sb, "main", scan, 120*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(r.Stdout, "SIGNALLED") || !strings.Contains(r.Stdout, "done") {
			t.Fatalf("%s signals PIDs outside its /proc (or the scan did not finish):\n%s", sb, r.Stdout)
		}
		if !strings.Contains("\n"+r.Stdout, "\n1\ndone") {
			t.Fatalf("%s's /proc should list one sleep, its own:\n%s", sb, r.Stdout)
		}
	}
	d.C.Exec(ctx(t), "ffsec-b-0", apitypes.ExecRequest{Argv: []string{"sh", "-c", "kill -9 -1"}})
	time.Sleep(300 * time.Millisecond)
	after := live()
	for ns, p := range procs {
		if q, ok := after[ns]; !ok || q.pid != p.pid {
			if ns != nsOfBranch(t, d, "ffsec-b-0") {
				t.Fatalf("kill -9 -1 in branch 0 reached a process outside it: %+v (now %+v)", p, after)
			}
		}
	}
}

// nsOfBranch is sandbox id's PID namespace, as the host names it.
func nsOfBranch(t *testing.T, d *testutil.Daemon, id string) string {
	t.Helper()
	in, err := d.C.Get(ctx(t), id)
	if err != nil {
		t.Fatal(err)
	}
	l, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", in.InitPid))
	if err != nil {
		t.Fatal(err)
	}
	return l
}
