package security

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/cgroup"
	"deltabox/internal/testutil"
)

// TestSpareUnreachableFromMember: a spare (a fork family member's copies of a node,
// placed ahead and stopped: docs/design/spares.md) sits in a sibling namespace of the
// member's, not in a child of it. From the member's live code, as its root: /proc lists
// none of the spare's processes (one sleep of the node's: its own), no PID outside its
// /proc can be signalled (kill -0 over 1..65535), and kill -9 -1 leaves the spare's copy
// stopped where it was; the restore from the spare then runs the node's sleep. A spare
// in a child of the member's PID namespace would be listed and signalled.
func TestSpareUnreachableFromMember(t *testing.T) {
	root := testutil.NewStore(t)
	d := testutil.StartDaemonEnv(t, root, "DELTABOX_DURABLE=0")
	const src, member = "spsec", "spsec-b"
	if _, err := d.C.Create(ctx(t), apitypes.CreateOptions{ID: src}); err != nil {
		t.Fatal(err)
	}
	marker := strconv.Itoa(5100000 + os.Getpid()%100000)
	if r, err := d.C.Exec(ctx(t), src, apitypes.ExecRequest{Argv: []string{"sh", "-c", "nohup sleep " + marker + " </dev/null >/dev/null 2>&1 &"}}); err != nil || r.ExitCode != 0 {
		t.Fatalf("start the sleep: %v %+v", err, r)
	}
	// The node must hold the sleep itself, not nohup before its exec.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if len(hostPidsWithPrefix(t, "sleep\x00"+marker)) > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the sleep did not start")
		}
	}
	res, err := d.C.ForkSandbox(ctx(t), src, apitypes.SandboxForkRequest{ForkRequest: apitypes.ForkRequest{Count: 1, CreateOptions: apitypes.CreateOptions{ID: member}}})
	if err != nil {
		t.Fatal(err)
	}
	if b := res.Branches[0]; b.Path != "fast" {
		t.Fatalf("path %s (%s): the test needs the fast path", b.Path, b.Reason)
	}
	n, err := d.C.PrepareNode(ctx(t), res.Node, member)
	if err != nil || !slices.Contains(n.Spares, member) {
		t.Fatalf("prepare: %v %+v", err, n)
	}
	memberNS := nsOfBranch(t, d, member)
	// The spare's copy of the sleep: in its cgroup (member~spareN), stopped.
	spare := func() (forkProc, bool) {
		dirs, _ := filepath.Glob(filepath.Join(cgroup.RootFor(root), member+"~spare*"))
		for _, dir := range dirs {
			b, _ := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
			for _, f := range strings.Fields(string(b)) {
				pid, _ := strconv.Atoi(f)
				cmd, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
				if !strings.HasPrefix(string(cmd), "sleep\x00"+marker) {
					continue
				}
				if p, ok := forkReadProc(t, pid); ok && (p.state == "t" || p.state == "T") && p.pidns != memberNS {
					return p, true
				}
			}
		}
		return forkProc{}, false
	}
	sp, ok := spare()
	if !ok {
		t.Fatal("no stopped copy of the sleep in a namespace of its own: where is the spare?")
	}
	scan := `own=" $(cd /proc && echo [0-9]*) "
for p in $(seq 1 65535); do
  kill -0 $p 2>/dev/null || continue
  case "$own" in *" $p "*) ;; *) echo "SIGNALLED $p";; esac
done
for f in /proc/[0-9]*/cmdline; do tr '\0' ' ' < $f 2>/dev/null | grep -q "^sleep ` + marker + `" && echo $f; done | wc -l
echo done`
	r, err := d.C.Run(ctx(t), member, "main", scan, 120*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(r.Stdout, "SIGNALLED") || !strings.Contains("\n"+r.Stdout, "\n1\ndone") {
		t.Fatalf("the member signals PIDs outside its /proc, or lists more than its own sleep (the spare's?):\n%s", r.Stdout)
	}
	d.C.Exec(ctx(t), member, apitypes.ExecRequest{Argv: []string{"sh", "-c", "kill -9 -1"}})
	time.Sleep(300 * time.Millisecond)
	if p, ok := forkReadProc(t, sp.pid); !ok || p.state != "t" || p.pidns != sp.pidns {
		t.Fatalf("the spare's copy after kill -9 -1 in the member: %+v (was %+v)", p, sp)
	}
	rs, err := d.C.Restore(ctx(t), member, res.Node)
	if err != nil || !rs.FromSpare {
		t.Fatalf("restore from the spare: %v %+v", err, rs)
	}
	var p forkProc
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if p, ok = forkReadProc(t, sp.pid); !ok || p.state == "S" || time.Now().After(deadline) {
			break
		}
	}
	if !ok || p.state != "S" {
		t.Fatalf("the spare's copy after the restore: %+v, want it running as the member's (restore %+v)", p, rs)
	}
	if now := nsOfBranch(t, d, member); now != sp.pidns {
		t.Fatalf("the member's namespace after the restore %s, want the spare's %s", now, sp.pidns)
	}
}

// hostPidsWithPrefix lists the host's processes whose command line starts with prefix.
func hostPidsWithPrefix(t *testing.T, prefix string) []int {
	t.Helper()
	var out []int
	for _, pid := range hostPidsWith(t, prefix) {
		if cmd, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid)); err == nil && strings.HasPrefix(string(cmd), prefix) {
			out = append(out, pid)
		}
	}
	return out
}
