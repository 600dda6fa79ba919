package e2e

import (
	"fmt"
	"strings"
	"testing"

	"deltabox/internal/testutil"
)

// ksMqueue is python code that prints how many messages the POSIX message queue /dbxq
// holds, or the errno of opening it.
const ksMqueue = `python3 -c "
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
q = libc.mq_open(b'/dbxq', 2)  # O_RDWR
if q < 0:
    print('errno', ctypes.get_errno())
else:
    a = (ctypes.c_long * 8)()
    libc.mq_getattr(q, a)
    print('messages', a[3])
"`

// ksObjects lists the sandbox's System V IPC objects (the lines of /proc/sysvipc/*, as
// the sandbox sees them: its own IPC namespace) and the state of the POSIX queue /dbxq.
func ksObjects(t *testing.T, d *testutil.Daemon, id string) string {
	t.Helper()
	return dbxSh(t, d, id, "tail -q -n +2 /proc/sysvipc/msg /proc/sysvipc/sem /proc/sysvipc/shm | awk '{print $2}' | tr '\\n' ' '; "+ksMqueue)
}

// TestKernelStateIPCRefused: System V IPC objects and POSIX message queues are not part
// of a checkpoint, so a checkpoint refuses while the sandbox holds any (409 naming each,
// and how to remove them), changing nothing; a restore removes those made after its
// node, and its processes come back; once removed, checkpoints work again. Before, the
// checkpoint was made, and its restore gave back a process beside objects (and values)
// from after it.
func TestKernelStateIPCRefused(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "ipc")
	pid := sessRun(t, d, "ipc", "main", "V=clean; echo $$")
	n0 := dbxCheckpoint(t, d, "ipc", "clean").Node.ID
	// Made after n0: by an exec, and by the session (its semaphore set is given a value).
	dbxSh(t, d, "ipc", `ipcmk -Q && ipcmk -M 4096 && python3 -c "
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
q = libc.mq_open(b'/dbxq', 0o102, 0o600, None)  # O_CREAT|O_RDWR
assert q >= 0 and libc.mq_send(q, b'hello', 5, 0) == 0
"`)
	sessRun(t, d, "ipc", "main", `V=ipc; S=$(ipcmk -S 2 | awk '{print $NF}'); python3 -c "
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
assert libc.semctl($S, 0, 16, ctypes.c_int(5)) == 0  # SETVAL 5
"`)
	objs := ksObjects(t, d, "ipc")
	if !strings.HasSuffix(objs, "messages 1\n") || len(strings.Fields(objs)) != 5 {
		t.Fatalf("objects made: %q", objs)
	}
	head := func() string {
		in, err := d.C.Get(dbxCtx(t), "ipc")
		if err != nil {
			t.Fatal(err)
		}
		return in.Head
	}
	h := head()
	fpRefused(t, d, "ipc", "IPC objects", "message queue", "semaphore set", "2 semaphores", "shared memory segment", "4096 bytes", `POSIX message queue "/dbxq"`, "ipcrm", "mq_unlink")
	// Nothing changed: the head, the session (same process, same variables), the objects.
	if head() != h {
		t.Fatalf("a refused checkpoint moved the head")
	}
	if out := sessRun(t, d, "ipc", "main", "echo $V; echo $$"); out != "ipc\n"+pid {
		t.Fatalf("session after a refused checkpoint: %q, want ipc and pid %s", out, pid)
	}
	if o := ksObjects(t, d, "ipc"); o != objs {
		t.Fatalf("objects after a refused checkpoint: %q, want %q", o, objs)
	}
	// The restore to n0 gives back n0's world: the session's process and no object.
	if op := dbxRestore(t, d, "ipc", n0); op.Processes != 1 {
		t.Fatalf("restore brought back %d processes", op.Processes)
	}
	if o := ksObjects(t, d, "ipc"); o != "errno 2\n" {
		t.Fatalf("objects made after the node survived its restore: %q", o)
	}
	if out := sessRun(t, d, "ipc", "main", "echo $V; echo $$"); out != "clean\n"+pid {
		t.Fatalf("session after the restore: %q", out)
	}
	// An object removed before the checkpoint is no obstacle.
	dbxSh(t, d, "ipc", `ipcmk -S 1 && ipcrm -a && python3 -c "
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
assert libc.mq_close(libc.mq_open(b'/dbxq', 0o102, 0o600, None)) == 0
assert libc.mq_unlink(b'/dbxq') == 0
"`)
	dbxCheckpoint(t, d, "ipc", "removed")
}

// TestKernelStateHostname: the host and domain names are recorded with each node and
// set back by a restore, as the session's process sees them; a node restored into
// another sandbox brings its files, and that sandbox keeps the name it started with.
// Before, a restore left the names set after the checkpoint.
func TestKernelStateHostname(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "uts")
	names := func(id string) string {
		return sessRun(t, d, id, "main", "echo $(hostname) $(domainname)")
	}
	start := names("uts") // the domain name is the daemon's
	dom, ok := strings.CutPrefix(start, "uts ")
	if !ok {
		t.Fatalf("names at start: %q", start)
	}
	var nodes []string
	for _, n := range []string{"alpha", "beta"} {
		sessRun(t, d, "uts", "main", fmt.Sprintf("hostname %s && domainname dom-%s", n, n))
		nodes = append(nodes, dbxCheckpoint(t, d, "uts", n).Node.ID)
	}
	sessRun(t, d, "uts", "main", "hostname gamma && domainname dom-gamma")
	for i, n := range []string{"alpha", "beta"} {
		dbxRestore(t, d, "uts", nodes[i])
		if got, want := names("uts"), n+" dom-"+n+"\n"; got != want {
			t.Fatalf("after the restore to %s: %q, want %q", n, got, want)
		}
		// An exec (a new process) sees it too.
		if got := dbxSh(t, d, "uts", "hostname"); got != n+"\n" {
			t.Fatalf("an exec after the restore to %s: %q", n, got)
		}
	}
	dbxCreate(t, d, "uts2")
	sessRun(t, d, "uts2", "main", "hostname other")
	dbxRestore(t, d, "uts2", nodes[0])
	if got := names("uts2"); got != "uts2 "+dom {
		t.Fatalf("a node restored into another sandbox: %q, want that sandbox's own names", got)
	}
}
