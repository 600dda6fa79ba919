package e2e

import (
	"strings"
	"testing"

	"deltabox/internal/api"
	"deltabox/internal/state"
	"deltabox/internal/testutil"
)

// lockProbe tries, from another process of the sandbox, every lock the python session of
// TestFastPathFileLocks may hold, without blocking, and says which are held: a flock on
// lk-a, a POSIX lock on bytes 5-14 of lk-b (byte 12 inside it, byte 20 outside), an OFD
// lock on lk-c from byte 20 to the end (byte 30 inside, byte 10 outside).
const lockProbe = `
import fcntl, struct
def fl(start, n):
    return struct.pack('hhxxxxqqixxxx', fcntl.F_WRLCK, 0, start, n, 0)
out = []
def probe(name, f):
    try:
        f()
        out.append(name + '=free')
    except OSError:
        out.append(name + '=held')
a = open('/workspace/lk-a', 'r+')
b = open('/workspace/lk-b', 'r+')
c = open('/workspace/lk-c', 'r+')
probe('a', lambda: fcntl.flock(a, fcntl.LOCK_EX | fcntl.LOCK_NB))
probe('b12', lambda: fcntl.lockf(b, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 12))
probe('b20', lambda: fcntl.lockf(b, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 20))
probe('c30', lambda: fcntl.fcntl(c, fcntl.F_OFD_SETLK, fl(30, 1)))
probe('c10', lambda: fcntl.fcntl(c, fcntl.F_OFD_SETLK, fl(10, 1)))
print(' '.join(out))
`

// TestFastPathFileLocks: a python session's flock, POSIX (lockf, a byte range) and OFD
// locks are held by the live process after a checkpoint (its files were reopened on the
// new state, which a fork and a reopen alone would have left unlocked) and by the process
// a restore makes, each node with the locks it had: another process finds exactly those
// held, with the same ranges. Once the restored process unlocks, nothing else holds them
// (no template keeps a lock on the restored state's files). Two fds that share an open
// file description (os.dup) still share it, and its offset, after a checkpoint and after
// a restore. A lease makes the checkpoint fail, naming it, and changes nothing.
func TestFastPathFileLocks(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "lk")
	if _, err := d.C.StartSession(dbxCtx(t), "lk", state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	probe := func(what, want string) {
		t.Helper()
		res := dbxExec(t, d, "lk", api.ExecRequest{Argv: []string{"python3", "-c", lockProbe}})
		if got := strings.TrimSpace(res.Stdout); res.ExitCode != 0 || got != want {
			t.Fatalf("%s: locks %q (exit %d, %s), want %q", what, got, res.ExitCode, res.Stderr, want)
		}
	}
	// shared checks that fds d1 and d2 share their offset: a write through d1 moves d2's.
	shared := func(what string) {
		t.Helper()
		if out := sessRun(t, d, "lk", "py", "os.write(d1, b'xyz'); print(os.lseek(d1, 0, 1) == os.lseek(d2, 0, 1), os.lseek(d2, 0, 1) > 0)"); out != "True True\n" {
			t.Fatalf("%s: dup'd fds share their offset: %q", what, out)
		}
	}
	sessRun(t, d, "lk", "py", `import fcntl, os, struct
for n in 'abcd':
    open('/workspace/lk-' + n, 'w').write('x' * 100)
fa = open('/workspace/lk-a', 'r+'); fcntl.flock(fa, fcntl.LOCK_EX)
fb = open('/workspace/lk-b', 'r+'); fcntl.lockf(fb, fcntl.LOCK_EX, 10, 5)
fc = open('/workspace/lk-c', 'r+'); fcntl.fcntl(fc, fcntl.F_OFD_SETLK, struct.pack('hhxxxxqqixxxx', fcntl.F_WRLCK, 0, 20, 0, 0))
d1 = os.open('/workspace/lk-d', os.O_WRONLY); d2 = os.dup(d1)`)
	all := "a=held b12=held b20=free c30=held c10=free"
	probe("before any checkpoint", all)

	locked := dbxCheckpoint(t, d, "lk", "locked")
	if locked.Processes != 1 {
		t.Fatalf("checkpoint took %d processes: %v", locked.Processes, locked.ProcessErrors)
	}
	probe("after the checkpoint", all)
	shared("after the checkpoint")

	sessRun(t, d, "lk", "py", "fcntl.flock(fa, fcntl.LOCK_UN)")
	noA := "a=free b12=held b20=free c30=held c10=free"
	probe("after unlocking lk-a", noA)
	unlockedA := dbxCheckpoint(t, d, "lk", "a-unlocked")

	dbxRestore(t, d, "lk", locked.Node.ID)
	probe("restored to the node with every lock", all)
	shared("after the restore")
	dbxRestore(t, d, "lk", unlockedA.Node.ID)
	probe("restored to the node without lk-a's lock", noA)
	dbxRestore(t, d, "lk", locked.Node.ID)
	probe("restored to the node with every lock again", all)
	sessRun(t, d, "lk", "py", `fcntl.flock(fa, fcntl.LOCK_UN)
fcntl.lockf(fb, fcntl.LOCK_UN, 10, 5)
fcntl.fcntl(fc, fcntl.F_OFD_SETLK, struct.pack('hhxxxxqqixxxx', fcntl.F_UNLCK, 0, 20, 0, 0))`)
	probe("the restored process unlocked everything", "a=free b12=free b20=free c30=free c10=free")

	// A lease: fork would share it with the template, and nothing sets it again.
	sessRun(t, d, "lk", "py", "open('/workspace/lk-e', 'w').close(); fe = open('/workspace/lk-e'); fcntl.fcntl(fe, fcntl.F_SETLEASE, fcntl.F_RDLCK)")
	fpRefused(t, d, "lk", "lease", "lk-e", "session py")
	if out := sessRun(t, d, "lk", "py", "print(fcntl.fcntl(fe, fcntl.F_GETLEASE) == fcntl.F_RDLCK)"); out != "True\n" {
		t.Fatalf("the lease after a refused checkpoint: %q", out)
	}
	sessRun(t, d, "lk", "py", "fcntl.fcntl(fe, fcntl.F_SETLEASE, fcntl.F_UNLCK)")
	dbxCheckpoint(t, d, "lk", "no-lease")
}

// TestFastPathLocksUnchangedAndShared: an exclusive flock on a file opened read-only
// survives checkpoints that change nothing (the mount is kept, so the live process
// reopens the very inode its template's description holds: the move must release the
// template's lock first). A background process that inherited a locked open file
// description from a session (a double fork) refuses the checkpoint with 409 naming it,
// and nothing changes; with end_background it is ended and the session keeps its lock.
func TestFastPathLocksUnchangedAndShared(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "lu")
	if _, err := d.C.StartSession(dbxCtx(t), "lu", state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	held := func(what string) {
		t.Helper()
		res := dbxExec(t, d, "lu", api.ExecRequest{Argv: []string{"python3", "-c", `
import fcntl
f = open('/workspace/ro')
try:
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print('free')
except OSError:
    print('held')`}})
		if got := strings.TrimSpace(res.Stdout); got != "held" {
			t.Fatalf("%s: /workspace/ro is %q (%s), want held by the session", what, got, res.Stderr)
		}
	}
	dbxSh(t, d, "lu", "echo x > /workspace/ro")
	sessRun(t, d, "lu", "py", "import fcntl, os, time\nf = open('/workspace/ro'); fcntl.flock(f, fcntl.LOCK_EX)")
	a := dbxCheckpoint(t, d, "lu", "a")
	held("after a checkpoint")
	for i := 0; i < 2; i++ {
		c := dbxCheckpoint(t, d, "lu", "unchanged")
		if c.Mounted {
			t.Fatalf("checkpoint %d after no change mounted a new state: the test needs the unchanged path", i)
		}
		held("after a checkpoint with no change")
	}
	dbxRestore(t, d, "lu", a.Node.ID)
	held("after a restore")

	// A grandchild of the session (so a child of init) with the session's locked
	// description: fds 0-2 on /dev/null, the lock's fd inherited.
	sessRun(t, d, "lu", "py", `pid = os.fork()
if pid == 0:
    if os.fork() == 0:
        os.setsid()
        n = os.open('/dev/null', os.O_RDWR)
        for i in (0, 1, 2):
            os.dup2(n, i)
        open('/workspace/gc.pid', 'w').write(str(os.getpid()))
        time.sleep(1000)
    os._exit(0)
os.waitpid(pid, 0)`)
	dbxSh(t, d, "lu", "for i in $(seq 500); do [ -s /workspace/gc.pid ] && exit 0; sleep 0.01; done; exit 1")
	gc := strings.TrimSpace(dbxSh(t, d, "lu", "cat /workspace/gc.pid"))
	fpRefused(t, d, "lu", "process "+gc, "holds a lock")
	held("after the refused checkpoint")
	c, err := d.C.CheckpointWith(dbxCtx(t), "lu", api.CheckpointRequest{Label: "ended", EndBackground: true})
	if err != nil || c.Processes != 1 || c.Killed != 1 {
		t.Fatalf("checkpoint with end_background: %v %+v", err, c)
	}
	held("after end_background ended the grandchild")
}
