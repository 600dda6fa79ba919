package security

import (
	"strings"
	"testing"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/testutil"
)

// TestNoWayIntoOtherStates: a sandbox's processes hold no way into its other states
// (the prepared next state, warm restore states, the templates' read-only views), nor
// into its limits. The attack on f3622c9: init kept every such state's namespace as
// /proc/1/fd/N; a process that entered one (setns) and wrote a file there found the file
// again after a restore to that node. Now init holds none (the fast path hands a
// namespace over for the move alone), is not dumpable, and setns and mount are filtered.
func TestNoWayIntoOtherStates(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "sec-states"
	if _, err := d.C.Create(ctx(t), apitypes.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	if _, err := d.C.Run(ctx(t), id, "main", "cd /workspace", 30*time.Second); err != nil {
		t.Fatal(err)
	}
	one, err := d.C.Checkpoint(ctx(t), id, "one")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.C.Checkpoint(ctx(t), id, "two"); err != nil {
		t.Fatal(err)
	}
	// Prepared and warm states exist now (background work after each answer).
	time.Sleep(300 * time.Millisecond)
	out := sh(t, d, id, `python3 - <<'PY'
import os, glob, ctypes
libc = ctypes.CDLL(None, use_errno=True)
for l in glob.glob('/proc/[0-9]*/fd/*'):
    try:
        target = os.readlink(l)
    except OSError:
        continue
    if target.startswith('mnt:') or target.startswith('user:'):
        print('NSFD', l, target)
        try:
            fd = os.open(l, os.O_RDONLY)
            if libc.setns(fd, 0) != 0:
                raise OSError(ctypes.get_errno(), 'setns')
            open('/planted', 'w').write('x')
            print('ENTERED', l)
        except OSError as e:
            print('refused', l, e.errno)
for p in ('/proc/1/fd/3', '/proc/1/mem'):
    try:
        os.close(os.open(p, os.O_RDWR))
        print('OPENED', p)
    except OSError as e:
        pass
os.makedirs('/tmp/cg', exist_ok=True)
if libc.mount(b"none", b"/tmp/cg", b"cgroup", 0, b"memory") == 0:
    print('MOUNTED cgroup v1 memory')
PY`)
	for _, bad := range []string{"NSFD", "ENTERED", "OPENED", "MOUNTED"} {
		if strings.Contains(out, bad) {
			t.Errorf("a way out of the current state from inside:\n%s", out)
			break
		}
	}
	if _, err := d.C.Restore(ctx(t), id, one.Node.ID); err != nil {
		t.Fatal(err)
	}
	if got := sh(t, d, id, "cat /planted 2>/dev/null || echo absent"); got != "absent\n" {
		t.Errorf("after a restore to node one, /planted: %q, want absent", got)
	}
}
