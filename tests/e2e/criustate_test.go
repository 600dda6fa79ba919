package e2e

import (
	"strings"
	"testing"

	"deltabox/internal/api"
	"deltabox/internal/testutil"
)

// criuState is a background python with two threads (so that the fast path refuses it
// and CRIU carries it) that sets up, by its argument, a state CRIU's static tests found
// wrong after a restore through DeltaBox, and writes it to /workspace/state.out, with a
// count, every 50 ms:
//
//	sparse: an open unlinked sparse file: its first hole, size and blocks.
//	aio:    an AIO context (io_setup: a ring mapped as /[aio]): its ring's size and
//	        magic, and a read of /workspace/aio.txt through it (io_submit, io_getevents).
//	oom:    its oom_score_adj, set to 400.
//	sock:   a unix socket bound at /workspace/d/sock, listening: the mtimes of d and of
//	        the socket's file (its atime changes at each connect), and an answer
//	        through it.
const criuState = `
import os, sys, threading, time
mode = sys.argv[1]
threading.Thread(target=time.sleep, args=(100000,), daemon=True).start()
if mode == "sparse":
    fd = os.open("/workspace/sparse", os.O_RDWR | os.O_CREAT, 0o644)
    os.pwrite(fd, b"x", 0); os.pwrite(fd, b"y", 1 << 20); os.ftruncate(fd, 3 << 20)
    os.unlink("/workspace/sparse")
    def state():
        st = os.fstat(fd)
        return "hole %d size %d blocks %d data %r" % (os.lseek(fd, 0, os.SEEK_HOLE), st.st_size, st.st_blocks, os.pread(fd, 1, 1 << 20))
elif mode == "aio":
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    open("/workspace/aio.txt", "w").write("through the ring")
    ctx = ctypes.c_ulong(0)
    assert libc.syscall(206, 16, ctypes.byref(ctx)) == 0  # io_setup
    f = os.open("/workspace/aio.txt", os.O_RDONLY)
    buf = ctypes.create_string_buffer(64)
    def state():
        nr, magic = ctypes.c_uint.from_address(ctx.value + 4).value, ctypes.c_uint.from_address(ctx.value + 16).value
        # struct iocb: data, key, rw_flags, opcode (0: pread), reqprio, fildes, buf, nbytes, offset, ...
        iocb = (ctypes.c_uint64 * 8)(7, 0, f << 32, ctypes.addressof(buf), 64, 0, 0, 0)
        iocbs = (ctypes.c_void_p * 1)(ctypes.addressof(iocb))
        events = (ctypes.c_int64 * 4)()
        sub = libc.syscall(209, ctx, 1, iocbs)  # io_submit
        got = libc.syscall(208, ctx, 1, 1, events, None)  # io_getevents
        return "nr %d magic %x submit %d events %d data %d res %d %r" % (nr, magic, sub, got, events[0], events[2], buf.value)
elif mode == "oom":
    open("/proc/self/oom_score_adj", "w").write("400")
    def state():
        return "oom_score_adj " + open("/proc/self/oom_score_adj").read().strip()
elif mode == "sock":
    import socket
    os.mkdir("/workspace/d")
    s = socket.socket(socket.AF_UNIX); s.bind("/workspace/d/sock"); s.listen(8)
    s.settimeout(0)
    def state():
        c = socket.socket(socket.AF_UNIX); c.connect("/workspace/d/sock"); a, _ = s.accept(); a.sendall(b"pong"); got = c.recv(10); a.close(); c.close()
        d, k = os.stat("/workspace/d"), os.stat("/workspace/d/sock", follow_symlinks=False)
        return "dir mtime %d sock mtime %d answer %r" % (d.st_mtime_ns, k.st_mtime_ns, got)
n = 0
while True:
    n += 1
    open("/workspace/state.tmp", "w").write("%d %s\n" % (n, state()))
    os.rename("/workspace/state.tmp", "/workspace/state.out")
    if n == 1: open("/workspace/state.pid", "w").write(str(os.getpid()))
    time.sleep(0.05)
`

// criuStateOf starts criuState in mode in a new sandbox id and returns a function that
// gives its state as it writes it next (after the count it has now).
func criuStateOf(t *testing.T, d *testutil.Daemon, id, mode string) func() string {
	t.Helper()
	dbxCreate(t, d, id)
	if r := dbxExec(t, d, id, api.ExecRequest{Argv: []string{"bash", "-c", `printf %s "$1" > /tmp/state.py`, "sh", criuState}}); r.ExitCode != 0 {
		t.Fatalf("write state.py: %+v", r)
	}
	startJob(t, d, id, "python3 /tmp/state.py "+mode, "/workspace/state.pid")
	return func() string {
		t.Helper()
		out := dbxSh(t, d, id, `n=$(cut -d" " -f1 /workspace/state.out)
for i in $(seq 500); do read m rest < /workspace/state.out; [ "$m" -gt "$n" ] && { echo "$rest"; exit 0; }; sleep 0.01; done; exit 1`)
		return strings.TrimSpace(out)
	}
}

// criuStateKept checks that mode's state is the same before a checkpoint (which must
// send the process to CRIU), after it and after a restore to it.
func criuStateKept(t *testing.T, mode string) {
	d := testutil.StartDaemon(t)
	id := "st-" + mode
	state := criuStateOf(t, d, id, mode)
	before := state()
	t.Logf("before: %s", before)
	a := dbxCheckpoint(t, d, id, "a")
	if a.CRIUProcesses != 1 {
		t.Fatalf("checkpoint: %d processes through CRIU, want 1", a.CRIUProcesses)
	}
	if got := state(); got != before {
		t.Errorf("after the checkpoint: %s, want %s", got, before)
	}
	dbxRestore(t, d, id, a.Node.ID)
	if got := state(); got != before {
		t.Errorf("after the restore: %s, want %s", got, before)
	}
}

// TestCRIUTreeCarriesAIO: a process with an AIO context (CRIU's aio00, aio01) goes to
// CRIU, which dumps and restores the ring itself, and reads through it after the
// checkpoint and the restore. Before, the daemon's scan of removed files refused the
// ring's mapping, /[aio] (deleted), as "a FIFO or device whose name was removed".
func TestCRIUTreeCarriesAIO(t *testing.T) {
	criuStateKept(t, "aio")
}

// TestCRIUTreeKeepsOOMScore: a process's oom_score_adj (CRIU's oom_score_adj test) comes
// back after the checkpoint and the restore. Before, CRIU's own write of it failed in
// the sandbox's user namespace (only logged), and it came back 0.
func TestCRIUTreeKeepsOOMScore(t *testing.T) {
	criuStateKept(t, "oom")
}

// TestCRIUTreeKeepsSocketTimes: a unix socket bound to a path is bound again at the
// checkpoint and at the restore (CRIU's sk-unix-listen01, sk-unix-rel...), and its
// directory's times and its file's are put back. Before, both changed each time.
func TestCRIUTreeKeepsSocketTimes(t *testing.T) {
	criuStateKept(t, "sock")
}

// TestCRIUTreeKeepsHoles: an open unlinked sparse file (CRIU's ghost_holes tests) keeps
// its holes, size and blocks through a checkpoint and a restore. Before, the daemon's
// copy of it was dense: the first hole moved to the end and every block was allocated.
func TestCRIUTreeKeepsHoles(t *testing.T) {
	criuStateKept(t, "sparse")
}
