package e2e

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"deltabox/internal/api"
	"deltabox/internal/errdefs"
	"deltabox/internal/state"
	"deltabox/internal/testutil"
)

// removedThings is a background python with two threads (so that the fast path refuses
// it and CRIU carries it) that holds what CRIU writes files to carry, by its argument:
//
//	ghost: /workspace/g, written "hello" and unlinked while open; each SIGUSR1 appends
//	       the count to it and copies its whole content to /workspace/ghost.out.
//	sock:  a unix socket bound at /workspace/sock, listening; each connection is answered
//	       "pong" and the count of connections.
//	lower: /workspace/lw, a file of a frozen layer, open read-only, its name removed
//	       (whited out: the file keeps its link in the layer); each SIGUSR1 copies it
//	       to /workspace/lower.out.
//	cwd:   its working directory /workspace/d, removed; each SIGUSR1 writes to
//	       /workspace/cwd.out the link count of "." and what it lists (0 and nothing).
//
// It writes its PID to /workspace/MODE.pid when ready. It takes SIGUSR1 by sigwait in
// its main thread, the signal blocked in every thread, with no handler: a handler that
// set a threading.Event, polled by Event.wait, could run inside that wait while it held
// the Event's lock and wait for it forever (internal/state's twin, removedThings in
// criutrees_test.go, says how that was found); a handler with pause() loses a signal
// that comes just before the pause. A blocked signal stays pending until sigwait takes
// it. The model's holders (model_test.go) take it the same way.
const removedThings = `
import os, sys, signal, socket, threading, time
mode = sys.argv[1]
n = [0]
# Blocked before any thread starts: every thread inherits the mask.
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
threading.Thread(target=time.sleep, args=(100000,), daemon=True).start()
if mode == "ghost":
    f = open("/workspace/g", "w+"); f.write("hello\n"); f.flush(); os.unlink("/workspace/g")
    def on():
        n[0] += 1; f.write("%d\n" % n[0]); f.flush(); f.seek(0)
        data = f.read()
        open("/workspace/ghost.out", "w").write(data)
elif mode == "lower":
    f = open("/workspace/lw"); os.unlink("/workspace/lw")
    def on():
        n[0] += 1; f.seek(0); open("/workspace/lower.out", "w").write(f.read())
elif mode == "sock":
    s = socket.socket(socket.AF_UNIX); s.bind("/workspace/sock"); s.listen(8)
    def serve():
        while True:
            c, _ = s.accept(); n[0] += 1; c.sendall(b"pong %d\n" % n[0]); c.close()
    threading.Thread(target=serve, daemon=True).start()
    def on(): pass
elif mode == "cwd":
    os.mkdir("/workspace/d"); os.chdir("/workspace/d"); os.rmdir("/workspace/d")
    def on():
        n[0] += 1
        open("/workspace/cwd.out", "w").write("%d %d %r\n" % (n[0], os.stat(".").st_nlink, os.listdir(".")))
open("/workspace/%s.pid" % mode, "w").write(str(os.getpid()))
while True:
    signal.sigwait([signal.SIGUSR1])
    on()
    open("/workspace/%s.done" % mode, "w").write(str(n[0]))
`

// startRemoved starts removedThings in mode and returns its PID.
func startRemoved(t *testing.T, d *testutil.Daemon, id, mode string) string {
	t.Helper()
	if r := dbxExec(t, d, id, api.ExecRequest{Argv: []string{"bash", "-c", `printf %s "$1" > /tmp/removed.py`, "sh", removedThings}}); r.ExitCode != 0 {
		t.Fatalf("write removed.py: %+v", r)
	}
	return startJob(t, d, id, "python3 /tmp/removed.py "+mode, "/workspace/"+mode+".pid")
}

// poke signals the removedThings in mode (PID pid) and waits for its answer.
func poke(t *testing.T, d *testutil.Daemon, id, mode, pid string, n int) {
	t.Helper()
	dbxSignal(t, d, id, "USR1", pid) // a command cannot signal another's process (landlock)
	dbxSh(t, d, id, fmt.Sprintf(`for i in $(seq 500); do [ "$(cat /workspace/%s.done 2>/dev/null)" = %d ] && exit 0; sleep 0.01; done; exit 1`, mode, n))
}

// TestCRIUTreeCarriesRemovedFiles is issue 24's reproducer, and its siblings: processes
// the fast path refuses (two threads) holding an unlinked open file, a frozen layer's
// file whose name was removed, a unix socket bound under /workspace, a removed working
// directory are carried by CRIU through a checkpoint
// and a restore, and nothing CRIU writes to carry them (ghost files) lands in /workspace.
func TestCRIUTreeCarriesRemovedFiles(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "g"
	dbxCreate(t, d, id)
	dbxSh(t, d, id, "echo lower > /workspace/lw")
	dbxCheckpoint(t, d, id, "lower") // lw is in a frozen layer now
	ghost := startRemoved(t, d, id, "ghost")
	lower := startRemoved(t, d, id, "lower")
	sock := startRemoved(t, d, id, "sock")
	cwd := startRemoved(t, d, id, "cwd")
	pids := ghost + " " + lower + " " + sock + " " + cwd
	listing := func() string {
		// A bound socket's file is bound again (a new inode): its inode is not compared.
		return dbxSh(t, d, id, `cd /workspace && for f in $(ls -A | sort); do if [ -S $f ]; then stat -c '%n %F %a %U' $f; else stat -c '%n %F %s %i %a %U %y' $f; fi; done`)
	}
	check := func(what string, n int) {
		t.Helper()
		dbxSh(t, d, id, "for p in "+pids+"; do [ -e /proc/$p ] && [ $(ls /proc/$p/task | wc -l) -ge 2 ] || { echo \"process $p: $(ls /proc/$p/task 2>&1 | tr \"\\\\n\" \" \")\" >&2; exit 1; }; done")
		poke(t, d, id, "ghost", ghost, n)
		want := "hello\n"
		for i := 1; i <= n; i++ {
			want += fmt.Sprintf("%d\n", i)
		}
		if got := dbxSh(t, d, id, "cat /workspace/ghost.out"); got != want {
			t.Fatalf("%s: the unlinked file holds %q, want %q", what, got, want)
		}
		if got := dbxSh(t, d, id, `python3 -c 'import socket; s = socket.socket(socket.AF_UNIX); s.connect("/workspace/sock"); print(s.recv(100).decode(), end="")'`); !strings.HasPrefix(got, "pong ") {
			t.Fatalf("%s: the socket answered %q", what, got)
		}
		poke(t, d, id, "lower", lower, n)
		if got := dbxSh(t, d, id, "cat /workspace/lower.out"); got != "lower\n" {
			t.Fatalf("%s: the frozen layer's file whose name was removed holds %q", what, got)
		}
		poke(t, d, id, "cwd", cwd, n)
		if got, want := dbxSh(t, d, id, "cat /workspace/cwd.out"), fmt.Sprintf("%d 0 []\n", n); got != want {
			t.Fatalf("%s: the removed cwd: %q, want %q", what, got, want)
		}
	}
	check("before", 1)
	before := listing()
	a, err := d.C.Checkpoint(dbxCtx(t), id, "a")
	if err != nil {
		t.Logf("ps: %s", dbxSh(t, d, id, "ps -e"))
		t.Logf("files: %s", listing())
		t.Fatalf("checkpoint: %v", err)
	}
	if a.CRIUProcesses != 4 {
		t.Fatalf("checkpoint: %d processes through CRIU, want 4: %+v", a.CRIUProcesses, a)
	}
	t.Logf("checkpoint: %.1f ms, phases %v", a.DurationMS, a.PhasesUS)
	if after := listing(); after != before {
		t.Fatalf("the checkpoint changed /workspace:\nbefore:\n%s\nafter:\n%s", before, after)
	}
	check("after the checkpoint", 2)
	dbxSh(t, d, id, "echo later > /workspace/later")
	r := dbxRestore(t, d, id, a.Node.ID)
	t.Logf("restore: %.1f ms, phases %v", r.DurationMS, r.PhasesUS)
	if after := listing(); after != before {
		t.Fatalf("the restore did not give back /workspace as checkpointed:\nat the checkpoint:\n%s\nrestored:\n%s", before, after)
	}
	check("after the restore", 2)
}

// TestCRIUCarriesWhatTheFastPathRefuses: a python session with one thread that the fast
// path refuses for what CRIU can carry (shared anonymous memory, a memfd, an unlinked
// open file, a lock on a device: /dev/null) is checkpointed through CRIU instead of
// refused, and a restore gives back the memory and file contents of the checkpoint; its
// flock on a file is held all along (CRIU's --file-locks, at the dump and the restore). Before, each was a 409 ("shared anonymous memory ... no file
// holds"), and CRIU's own path misnamed /dev/zero (deleted) "a deleted file on a mount
// the process no longer has".
func TestCRIUCarriesWhatTheFastPathRefuses(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "cf"
	dbxCreate(t, d, id)
	if _, err := d.C.StartSession(dbxCtx(t), id, state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	sessRun(t, d, id, "py", `import mmap, os, fcntl
anon = mmap.mmap(-1, 4096); anon[:5] = b"anon1"
mfd = os.memfd_create("m"); os.write(mfd, b"memfd1")
g = open("/workspace/g", "w+"); g.write("ghost1"); g.flush(); os.unlink("/workspace/g")
dn = open("/dev/null"); fcntl.flock(dn, fcntl.LOCK_EX)
lk = open("/workspace/lockf", "w"); fcntl.flock(lk, fcntl.LOCK_EX)`)
	held := func(what string) {
		t.Helper()
		if out := dbxSh(t, d, id, "flock -n /workspace/lockf true && echo free || echo held"); out != "held\n" {
			t.Fatalf("%s: the session's flock on /workspace/lockf is %s", what, out)
		}
	}
	held("before")
	a, err := d.C.Checkpoint(dbxCtx(t), id, "a")
	if err != nil {
		t.Fatalf("checkpoint: %v", err)
	}
	if a.CRIUProcesses != 1 {
		t.Fatalf("checkpoint: %d processes through CRIU, want the session's: %+v", a.CRIUProcesses, a)
	}
	if ls := dbxSh(t, d, id, "ls -A /workspace"); ls != "lockf\n" {
		t.Fatalf("the checkpoint left %q in /workspace", ls)
	}
	held("after the checkpoint")
	probe := `print(bytes(anon[:5]), os.pread(mfd, 6, 0), (g.seek(0), g.read())[1])`
	sessRun(t, d, id, "py", `anon[:5] = b"anon2"; os.pwrite(mfd, b"memfd2", 0); g.seek(0); g.write("ghost2"); g.flush()`)
	dbxRestore(t, d, id, a.Node.ID)
	if out := sessRun(t, d, id, "py", probe); out != "b'anon1' b'memfd1' ghost1\n" {
		t.Fatalf("restored: %q", out)
	}
	if ls := dbxSh(t, d, id, "ls -A /workspace"); ls != "lockf\n" {
		t.Fatalf("the restore left %q in /workspace", ls)
	}
	held("after the restore")
}

// TestCRIUTreeInAnotherTreesSessionRefused: a process that its session leader left to
// init (zdtm's session00) would be restored by CRIU in a session of its own, apart from
// its leader's tree: the checkpoint refuses it (409, naming both), and nothing changes.
func TestCRIUTreeInAnotherTreesSessionRefused(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "ss"
	dbxCreate(t, d, id)
	// The leader (setsid) leaves a two-thread python to init, then waits with a thread of
	// its own: both go through CRIU, as two trees.
	dbxSh(t, d, id, `nohup setsid python3 -c '
import os, threading, time
threading.Thread(target=time.sleep, args=(1000,), daemon=True).start()
if os.fork() == 0:
    if os.fork() == 0:
        threading.Thread(target=time.sleep, args=(1000,), daemon=True).start()
        open("/workspace/child.pid", "w").write(str(os.getpid()))
        time.sleep(1000)
    os._exit(0)
os.wait()
open("/workspace/leader.pid", "w").write(str(os.getpid()))
time.sleep(1000)
' </dev/null >/dev/null 2>&1 &
for i in $(seq 1000); do [ -s /workspace/leader.pid ] && [ -s /workspace/child.pid ] && exit 0; sleep 0.01; done; exit 1`)
	child := strings.TrimSpace(dbxSh(t, d, id, "cat /workspace/child.pid"))
	leader := strings.TrimSpace(dbxSh(t, d, id, "cat /workspace/leader.pid"))
	if sid := strings.Fields(dbxSh(t, d, id, "ps -o sid= -p "+child)); len(sid) != 1 || sid[0] != leader {
		t.Fatalf("the child's session: %v, want the leader's %s", sid, leader)
	}
	_, err := d.C.Checkpoint(dbxCtx(t), id, "x")
	if !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "in the session of process "+leader) {
		t.Fatalf("checkpoint: %v, want a conflict naming the leader's session", err)
	}
	if sid := strings.Fields(dbxSh(t, d, id, "ps -o sid= -p "+child+" -p "+leader)); len(sid) != 2 || sid[0] != leader || sid[1] != leader {
		t.Fatalf("after the refusal: sessions %v, want both %s", sid, leader)
	}
}

// A process the fast path carries, in the session and process group of a process CRIU
// takes (a child its session leader left to init), would keep the leader's PID taken
// when step 7 moves the leader's tree onto the new state by a CRIU restore (the kernel
// keeps a session's or group's id while a member lives: clone3 set_tid fails with
// EEXIST), and the undo could not put the tree back either. The checkpoint refuses with
// 409 before the tree is ended, and every process runs on as it was.
func TestCRIUTreeLeadingAHeldProcessRefused(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "sh"
	dbxCreate(t, d, id)
	// The leader (setsid, two threads: CRIU) leaves a one-thread python to init: the
	// fast path carries it, in the leader's session and group.
	dbxSh(t, d, id, `nohup setsid python3 -c '
import os, threading, time
threading.Thread(target=time.sleep, args=(1000,), daemon=True).start()
if os.fork() == 0:
    if os.fork() == 0:
        open("/workspace/child.pid", "w").write(str(os.getpid()))
        time.sleep(1000)
    os._exit(0)
os.wait()
open("/workspace/leader.pid", "w").write(str(os.getpid()))
time.sleep(1000)
' </dev/null >/dev/null 2>&1 &
for i in $(seq 1000); do [ -s /workspace/leader.pid ] && [ -s /workspace/child.pid ] && exit 0; sleep 0.01; done; exit 1`)
	child := strings.TrimSpace(dbxSh(t, d, id, "cat /workspace/child.pid"))
	leader := strings.TrimSpace(dbxSh(t, d, id, "cat /workspace/leader.pid"))
	ids := func() []string { return strings.Fields(dbxSh(t, d, id, "ps -o sid=,pgid= -p "+child)) }
	if got := ids(); len(got) != 2 || got[0] != leader || got[1] != leader {
		t.Fatalf("the child's session and group: %v, want the leader's %s", got, leader)
	}
	dbxSh(t, d, id, "echo changed > /workspace/x") // a new state: step 7 moves the trees
	_, err := d.C.Checkpoint(dbxCtx(t), id, "x")
	if !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "process "+child) || !strings.Contains(err.Error(), "process "+leader) {
		t.Fatalf("checkpoint: %v, want a conflict naming process %s and process %s", err, child, leader)
	}
	if got := ids(); len(got) != 2 || got[0] != leader || got[1] != leader {
		t.Fatalf("after the refusal: the child's session and group %v, want %s", got, leader)
	}
	if st := strings.Fields(dbxSh(t, d, id, "ps -o stat= -p "+leader+" -p "+child)); len(st) != 2 || st[0][0] != 'S' || st[1][0] != 'S' {
		t.Fatalf("after the refusal: states %v, want both sleeping (running on)", st)
	}
}

// criuLossCases are what CRIU's zdtm static tests found a failed checkpoint to lose
// (docs/research/criu-static/): a background python with a second thread (so that the
// fast path refuses it and CRIU takes it) holding, after SETUP, what CRIU dumped but its
// restore into the sandbox failed on, or what DeltaBox's own removed-file step took for
// a removed file. The checkpoint ended the process to restore it onto the new state, the
// restore failed, and the undo failed the same way. Each SIGUSR1 writes STATE to
// /tmp/loss.state.
var criuLossCases = []struct {
	name, setup, state string
	refused            string // "": carried; else what the 409 names
}{
	// zdtm del_standalone_un: a listening socket whose bound path names another
	// socket's file (a CRIU "ghost" socket).
	{"ghost unix socket", `os.makedirs("/workspace/d", exist_ok=True)
a = socket.socket(socket.AF_UNIX); a.bind("/workspace/d/sock"); a.listen()
os.rename("/workspace/d/sock", "/workspace/d/tmp")
b = socket.socket(socket.AF_UNIX); b.bind("/workspace/d/sock"); b.listen()
os.rename("/workspace/d/tmp", "/workspace/d/sock")`,
		`"%s %s" % (a.getsockname(), b.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))`,
		"unix socket bound to /workspace/d/sock, a name that was removed"},
	// zdtm file_fown, as the sandbox's root.
	{"fd owner", `r, w = os.pipe(); fcntl.fcntl(r, fcntl.F_SETOWN, os.getpid())`,
		`fcntl.fcntl(r, fcntl.F_GETOWN) == os.getpid()`, "a signal owner"},
	// zdtm file_lease00, as the sandbox's root.
	{"lease", `fd = os.open("/workspace/leased", os.O_RDONLY | os.O_CREAT, 0o666); fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)`,
		`fcntl.fcntl(fd, fcntl.F_GETLEASE)`, "a signal owner"},
	// zdtm proc-self: an fd on its own network namespace (nsfs, "net:[N]").
	{"namespace fd", `ns = os.open("/proc/self/ns/net", os.O_RDONLY)`,
		`os.readlink("/proc/self/fd/%d" % ns) == os.readlink("/proc/self/ns/net")`, ""},
	// zdtm unhashed_proc: a cwd in /proc/PID of a child since reaped.
	{"cwd in a reaped child's /proc", `pid = os.fork()
if pid == 0:
    signal.pause(); os._exit(0)
os.chdir("/proc/%d" % pid); os.kill(pid, signal.SIGKILL); os.waitpid(pid, 0)`,
		`"%s %s" % (os.readlink("/proc/self/cwd"), os.path.exists("status"))`, ""},
	// zdtm socket-tcp-close2: a loopback TCP connection, both ends shut down. Its dump
	// left it in repair mode for the process that ran on (recv: EPERM).
	{"closed TCP connection", `s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
c = socket.create_connection(s.getsockname()); a, _ = s.accept(); s.close()
c.shutdown(socket.SHUT_WR); a.shutdown(socket.SHUT_WR)`,
		`"%r %r" % (c.recv(10), a.recv(10))`, ""},
	// A loopback connection with bytes its reader has not read, and one more each way
	// at every look (a restore must give both the queue and a working connection back;
	// a peek in repair mode fails with EINVAL).
	{"TCP connection", `s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
c = socket.create_connection(s.getsockname()); a, _ = s.accept(); s.close()
c.sendall(b"unread")`,
		`"%r %r" % (a.recv(100, socket.MSG_PEEK), (a.sendall(b"ping"), c.recv(4))[1])`, ""},
	// zdtm socket-tcp6-close-wait: an IPv6 connection its peer has shut down
	// (CLOSE_WAIT), with a full send queue its peer does not read, beside its listener.
	// (The restore of zdtm's, whose two ends are in two trees, failed on the address
	// its ended end still held, "Can't connect inet socket back: Cannot assign
	// requested address", until durable.Restore destroyed such orphans: that case is
	// zdtm's, docs/research/criu-static/; this one passes either way.)
	{"TCP connection in CLOSE_WAIT", `s = socket.socket(socket.AF_INET6); s.bind(("::1", 0)); s.listen()
c = socket.create_connection(s.getsockname()[:2]); a, _ = s.accept()
c.shutdown(socket.SHUT_WR); a.setblocking(False)
try:
    while True: a.send(b"x" * 4096)
except BlockingIOError: pass
a.setblocking(True)`,
		`"%r %r %d" % (a.recv(4), c.recv(4, socket.MSG_PEEK), a.getsockopt(socket.SOL_TCP, socket.TCP_INFO, 1)[0])`, ""},
	// zdtm pty02, tty02: a pseudo-terminal the process opened itself (it holds both
	// ends): CRIU takes the pair, and its restore gets the same number again.
	{"pty of its own", `m, sl = os.openpty()`,
		`"%s %r" % (os.ttyname(sl), (os.write(m, b"typed\n"), os.read(sl, 100))[1])`, ""},
	// zdtm pty00: a child that made its own pty its controlling terminal and opened
	// /dev/tty, which lives on the sandbox's read-only /dev: CRIU's restore chowned it
	// to its owner as dumped (-1, the host's root) and failed with EROFS
	// (scripts/criu/0008).
	{"controlling terminal of its own", `pid = os.fork()
if pid == 0:
    os.setsid(); m, sl = os.openpty(); fd = os.open(os.ttyname(sl), os.O_RDWR)
    tty = os.open("/dev/tty", os.O_RDWR)
    while True: time.sleep(100)
time.sleep(0.5)`,
		`"%s %s" % (open("/proc/%d/stat" % pid).read().rsplit(")", 1)[1].split()[4], sorted(os.readlink("/proc/%d/fd/%s" % (pid, f)) for f in os.listdir("/proc/%d/fd" % pid)))`, ""},
	// zdtm socket-tcp-skip-in-flight: a connection its listener has not accepted yet,
	// which CRIU refuses (it would drop it with --skip-in-flight: not passed). The
	// client's end works on, out of repair mode (TCP_REPAIR, 19, reads 0).
	{"TCP connection not yet accepted", `s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
c = socket.create_connection(s.getsockname()); c.sendall(b"early")`,
		`"%d %d %d" % (c.getsockopt(socket.SOL_TCP, socket.TCP_INFO, 1)[0], c.getsockopt(socket.SOL_TCP, 19), c.send(b"."))`,
		"connections not yet accepted"},
	// zdtm socket-tcpbuf: a send queue filled up; a restore in the sandbox cannot make
	// a socket's buffer as large as the process had it (SO_SNDBUF's cap, where CRIU's
	// SO_SNDBUFFORCE needs the host's CAP_NET_ADMIN), and failed at the move.
	{"TCP send queue past a restore's buffer", testutil.FullSendQueue, testutil.FullSendQueueState,
		"more than a restore in the sandbox can queue again"},
}

// TestCRIUFailedCheckpointKeepsProcess: for each of criuLossCases, the checkpoint either
// carries the process (and a restore gives its state back) or refuses it with a 409
// naming the cause, before anything is ended; in every case the process runs on with its
// state and /workspace is unchanged (issue 24 item 0: a failed checkpoint changes
// nothing).
func TestCRIUFailedCheckpointKeepsProcess(t *testing.T) {
	d := testutil.StartDaemon(t)
	for i, c := range criuLossCases {
		t.Run(strings.ReplaceAll(c.name, " ", "_"), func(t *testing.T) {
			id := fmt.Sprintf("loss%d", i)
			dbxCreate(t, d, id)
			// SIGUSR1 blocked in both threads and taken by sigwait: as
			// removedThings, and for the same reasons.
			prog := "import os, fcntl, signal, socket, threading, time\n" +
				"signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])\n" +
				"threading.Thread(target=time.sleep, args=(100000,), daemon=True).start()\n" +
				c.setup + "\n" + `n = [0]
open("/tmp/loss.pid", "w").write(str(os.getpid()))
while True:
    signal.sigwait([signal.SIGUSR1])
    n[0] += 1
    try: st = str(` + c.state + `)
    except Exception as e: st = repr(e)
    open("/tmp/loss.state", "w").write(st)
    open("/tmp/loss.done", "w").write(str(n[0]))
`
			pid := startPython(t, d, id, "/tmp/loss", prog)
			// A restore takes the process's count back: the answer is waited for by
			// its file, removed before each signal.
			state := func(what string) string {
				t.Helper()
				dbxSh(t, d, id, "rm -f /tmp/loss.done")
				dbxSignal(t, d, id, "USR1", pid)
				if r := dbxExec(t, d, id, api.ExecRequest{Argv: []string{"bash", "-c", `for i in $(seq 500); do [ -e /tmp/loss.done ] && exit 0; sleep 0.01; done; exit 1`}}); r.ExitCode != 0 {
					t.Fatalf("%s: process %s did not answer: ps: %s", what, pid, dbxSh(t, d, id, "ps -e -o pid,stat,comm"))
				}
				return dbxSh(t, d, id, "cat /tmp/loss.state")
			}
			listing := func() string {
				return dbxSh(t, d, id, `find /workspace -printf '%p %y %s %i %T@\n' | sort`)
			}
			before, files := state("before"), listing()
			a, err := d.C.Checkpoint(dbxCtx(t), id, "a")
			switch {
			case c.refused == "" && err != nil:
				t.Fatalf("checkpoint: %v, want it carried", err)
			case c.refused != "" && (!errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), c.refused)):
				t.Fatalf("checkpoint: %v, want a conflict naming %q", err, c.refused)
			}
			if got := state("after the checkpoint"); got != before {
				t.Fatalf("after the checkpoint (%v): state %q, want %q", err, got, before)
			}
			if got := listing(); got != files {
				t.Fatalf("the checkpoint (%v) changed /workspace:\nbefore:\n%s\nafter:\n%s", err, files, got)
			}
			if err != nil {
				return
			}
			dbxSh(t, d, id, "echo later > /workspace/later")
			dbxRestore(t, d, id, a.Node.ID)
			if got := state("after the restore"); got != before {
				t.Fatalf("after the restore: state %q, want %q", got, before)
			}
			if got := listing(); got != files {
				t.Fatalf("the restore did not give back /workspace:\nat the checkpoint:\n%s\nrestored:\n%s", files, got)
			}
		})
	}
}

// ownPty is a process with two threads (the fast path refuses it) holding a pty it
// opened itself: SIGUSR1 closes both ends, SIGUSR2 writes to /tmp/pty.state its pty's
// name and a line typed through it. It takes both by sigwait, blocked in both threads,
// as removedThings does and for its reasons (with handlers and the main thread in
// time.sleep(100), a signal that came just before the sleep, or that the kernel gave
// the other thread, would be answered 100 s later).
const ownPty = `import os, signal, threading, time
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1, signal.SIGUSR2])
threading.Thread(target=time.sleep, args=(100000,), daemon=True).start()
m, sl = os.openpty()
open("/tmp/pty.pid", "w").write(str(os.getpid()))
while True:
    if signal.sigwait([signal.SIGUSR1, signal.SIGUSR2]) == signal.SIGUSR1:
        os.close(m); os.close(sl); open("/tmp/pty.closed", "w").close()
    else:
        os.write(m, b"typed\n")
        open("/tmp/pty.state", "w").write("%s %r" % (os.ttyname(sl), os.read(sl, 100)))
`

// TestCRIUTreeOwnPtyTakenBySessionSince: a tree's own pty comes back at its number at a
// restore (criu-trees.md). The tree closes that pty after the checkpoint, and a session
// started since gets a terminal of the same number (the kernel hands out the lowest
// free). A restore to the node ends that session, which the node lacks, before it
// restores the tree: the tree comes back with its pty, and the session is reported
// ended. Restored while that session's terminal still held the number, the tree was
// left out with a warning.
func TestCRIUTreeOwnPtyTakenBySessionSince(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "ctpty"
	dbxCreate(t, d, id)
	pid := startPython(t, d, id, "/tmp/pty", ownPty)
	look := func(what string) string {
		t.Helper()
		dbxSh(t, d, id, "rm -f /tmp/pty.state")
		dbxSignal(t, d, id, "USR2", pid)
		dbxSh(t, d, id, fmt.Sprintf("for i in $(seq 500); do [ -s /tmp/pty.state ] && exit 0; sleep 0.01; done; echo %s: no answer; exit 1", what))
		return dbxSh(t, d, id, "cat /tmp/pty.state")
	}
	before := look("before")
	pts, _, _ := strings.Cut(before, " ")
	cp := dbxCheckpoint(t, d, id, "own pty")
	if cp.CRIUProcesses != 1 {
		t.Fatalf("checkpoint: %+v, want the process through CRIU", cp)
	}
	dbxSignal(t, d, id, "USR1", pid)
	dbxSh(t, d, id, "for i in $(seq 500); do [ -e /tmp/pty.closed ] && exit 0; sleep 0.01; done; exit 1")
	if _, err := d.C.StartSession(dbxCtx(t), id, state.SessionOptions{Name: "since", Kind: "bash"}); err != nil {
		t.Fatal(err)
	}
	if got := strings.TrimSpace(sessRun(t, d, id, "since", "tty")); got != pts {
		t.Fatalf("the session started since has terminal %s, want the tree's closed %s (the case needs that number taken)", got, pts)
	}
	res := dbxRestore(t, d, id, cp.Node.ID)
	if res.CRIUProcesses != 1 || len(res.Warnings) > 0 {
		t.Fatalf("restore to the node: %d processes through CRIU, warnings %q; want the tree back with its pty", res.CRIUProcesses, res.Warnings)
	}
	if !slices.Contains(res.SessionsEnded, "since") {
		t.Fatalf("restore to the node: sessions ended %v, want the one started since", res.SessionsEnded)
	}
	if got := look("after the restore"); got != before {
		t.Fatalf("the tree after the restore: %q, want %q", got, before)
	}
}
