package security

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/testutil"
)

// enterInitThreads tries, for every thread of init (PID 1), to read and open its mount
// namespace, enter it (setns) and list its root: the branch-making thread's namespace
// holds an unmasked proc of the PID namespace. It prints "REACHED" for each success.
const enterInitThreads = `
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
tasks = os.listdir('/proc/1/task')
print('threads', len(tasks))
for t in tasks:
    base = '/proc/1/task/%s/' % t
    for what in ('ns/mnt', 'root', 'cwd'):
        try:
            os.readlink(base + what)
            print('REACHED readlink', base + what)
        except OSError:
            pass
    try:
        os.listdir(base + 'root/')
        print('REACHED listdir', base + 'root/')
    except OSError:
        pass
    try:
        fd = os.open(base + 'ns/mnt', os.O_RDONLY)
        print('REACHED open', base + 'ns/mnt')
        if libc.setns(fd, 0x00020000) == 0:
            print('REACHED setns', base + 'ns/mnt', os.listdir('/'))
    except OSError:
        pass
print('done')
`

// TestBranchExecRootUnreachable: a family init keeps its branch-making thread, whose
// private mount namespace has the branch inits' exec root (an unmasked proc of the
// sandbox's PID namespace: sbinit's branchMaker), for its next branches. A fast fork
// cut by a daemon crash after its branches were made (forkfast:1) leaves the source
// running beside that thread, adopted by the next daemon. From the source's live code,
// as its user and as root: no thread of init has its mount namespace, root or cwd read,
// opened, entered or listed (init is not dumpable and has capabilities the sandbox's
// bounded set lacks; the sandbox has no CAP_SYS_PTRACE: the guards of
// TestInitSpareUnreachable). The thread is checked to be there first.
func TestBranchExecRootUnreachable(t *testing.T) {
	root := testutil.NewStore(t)
	d := testutil.StartDaemonEnv(t, root, "DELTABOX_DURABLE=0", "DELTABOX_CRASH_AT=forkfast:1")
	const src = "sec-execroot"
	if _, err := d.C.Create(ctx(t), apitypes.CreateOptions{ID: src}); err != nil {
		t.Fatal(err)
	}
	if _, err := d.C.StartSession(ctx(t), src, apitypes.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	if r, err := d.C.Run(ctx(t), src, "py", "x = 1", 30*time.Second); err != nil || r.ExitCode != 0 {
		t.Fatalf("session: %v %+v", err, r)
	}
	_, err := d.C.ForkSandbox(ctx(t), src, apitypes.SandboxForkRequest{ForkRequest: apitypes.ForkRequest{Count: 2}})
	if err == nil {
		t.Fatal("the fork was answered: the daemon did not die at forkfast:1")
	}
	d.Kill()
	d = testutil.StartDaemonOn(t, root)
	in, err := d.C.Get(ctx(t), src)
	if err != nil || in.InitPid == 0 {
		t.Fatalf("the source after the repair: %v %+v", err, in)
	}
	own, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/mnt", in.InitPid))
	if err != nil {
		t.Fatal(err)
	}
	tasks, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", in.InitPid))
	maker := 0
	for _, tk := range tasks {
		if ns, err := os.Readlink(fmt.Sprintf("/proc/%d/task/%s/ns/mnt", in.InitPid, tk.Name())); err == nil && ns != own {
			maker++
		}
	}
	if maker != 1 {
		t.Fatalf("the source's init has %d threads in a mount namespace of their own, want 1 (the branch maker): the test would check nothing", maker)
	}
	for _, user := range []string{"", "root"} {
		res, err := d.C.Exec(ctx(t), src, apitypes.ExecRequest{Argv: []string{"python3", "-c", enterInitThreads}, User: user, TimeoutMS: 30_000})
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("attacker (user %q): exit %d\n%s%s", user, res.ExitCode, res.Stdout, res.Stderr)
		if strings.Contains(res.Stdout, "REACHED") || !strings.Contains(res.Stdout, "done") {
			t.Fatalf("a process of the sandbox reached the init's threads:\n%s%s", res.Stdout, res.Stderr)
		}
	}
}
