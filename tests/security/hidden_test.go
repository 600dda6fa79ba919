package security

import (
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/testutil"
)

// TestHiddenProcessIsNotLeftBehind: a process that moves out of the sandbox's cgroup2
// directory (a cgroup2 mount of its own, then its PID written into another group's
// cgroup.procs) was neither taken nor killed by a checkpoint, which read the sandbox's
// processes from that directory; kept on the old state, it wrote through an fd held
// across the checkpoint into the file's inode, now in the node's frozen layer, and
// survived every restore. The daemon now finds a sandbox's processes by its PID
// namespace: the checkpoint (end_background) ends it, the frozen file stays as it was
// frozen, and nothing of it survives a restore.
func TestHiddenProcessIsNotLeftBehind(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "sec-hidden"
	if _, err := d.C.Create(ctx(t), apitypes.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	marker := "hidden-" + strconv.Itoa(os.Getpid())
	// The hidden writer: fd 3 on /root/hid.log, out of the cgroup, then a line every
	// 20 ms for ever. It tries the root of a cgroup2 mount (the host's, before the
	// cgroup namespace) and else a child group of its own.
	// It holds a pipe (fd 4), which the fast path never carries: the checkpoint with
	// end_background always ends it. (Without it, caught between two sleeps it could be
	// checkpointed, and a restore then rightly brought it back: the test's race under load.)
	script := `mkdir -p /tmp/cg; mount -t cgroup2 none /tmp/cg 2>/dev/null
exec 3>>/root/hid.log
exec 4< <(true)
echo $BASHPID > /tmp/cg/cgroup.procs 2>/dev/null
grep -q "^0::/$" /proc/self/cgroup && { mkdir -p /tmp/cg/hide; echo $BASHPID > /tmp/cg/hide/cgroup.procs; }
echo "cgroup: $(cat /proc/self/cgroup | grep ^0::)"
while :; do echo line >&3; sleep 0.02; done`
	r, err := d.C.Exec(ctx(t), id, apitypes.ExecRequest{Argv: []string{"bash", "-c",
		`setsid bash -c '` + strings.ReplaceAll(script, "'", `'\''`) + `' ` + marker + ` >/root/hid.out 2>&1 </dev/null & sleep 0.5; cat /root/hid.out`}, TimeoutMS: 30_000})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("the hidden process says: %s", strings.TrimSpace(r.Stdout))
	t.Cleanup(func() {
		for _, p := range hostPidsWith(t, marker) {
			syscall.Kill(p, syscall.SIGKILL)
		}
		// Where the attack went before the cgroup namespace: a group at the host's root.
		time.Sleep(100 * time.Millisecond)
		syscall.Rmdir("/sys/fs/cgroup/unified/hide")
	})
	if len(hostPidsWith(t, marker)) == 0 {
		t.Fatal("the hidden process did not start")
	}
	op, err := d.C.CheckpointWith(ctx(t), id, apitypes.CheckpointRequest{EndBackground: true})
	if err != nil {
		t.Fatalf("checkpoint: %v", err)
	}
	node := op.Node.ID
	time.Sleep(300 * time.Millisecond)
	if _, err := d.C.Restore(ctx(t), id, node); err != nil {
		t.Fatalf("restore: %v", err)
	}
	size := func() string {
		return strings.TrimSpace(sh(t, d, id, `stat -c %s /root/hid.log`))
	}
	s1 := size()
	time.Sleep(300 * time.Millisecond)
	if _, err := d.C.Restore(ctx(t), id, node); err != nil {
		t.Fatalf("restore: %v", err)
	}
	s2 := size()
	if s1 != s2 {
		t.Errorf("the frozen layer changed after the checkpoint: /root/hid.log at node %s was %s bytes, then %s bytes", node, s1, s2)
	}
	if p := hostPidsWith(t, marker); len(p) > 0 {
		t.Errorf("the hidden process survived a checkpoint and two restores (host PIDs %v)", p)
	}
}
