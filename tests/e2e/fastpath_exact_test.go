package e2e

import (
	"fmt"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"deltabox/internal/api"
	"deltabox/internal/fastpath"
	"deltabox/internal/state"
	"deltabox/internal/testutil"
)

// Exact restores (issue 14): what a checkpoint cannot keep exactly is refused with 409
// naming it, and changes nothing; what it keeps reads back as it was.

// exPython starts a python session "py" in sandbox id and runs setup in it.
func exPython(t *testing.T, d *testutil.Daemon, id, setup string) {
	t.Helper()
	if _, err := d.C.StartSession(dbxCtx(t), id, state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	sessRun(t, d, id, "py", setup)
}

// exOut runs code in session sess and requires its output to be want.
func exOut(t *testing.T, d *testutil.Daemon, id, sess, code, want string) {
	t.Helper()
	if got := sessRun(t, d, id, sess, code); got != want {
		t.Fatalf("%s: %q: %q, want %q", sess, code, got, want)
	}
}

// exDeep is python that opens a file under /workspace whose path is longer than
// PATH_MAX (45 directories of 100 bytes), through a chain of directory fds so that the
// working directory stays short, and keeps only the file's fd (deep).
const exDeep = `import os
d = os.open('/workspace', os.O_RDONLY)
for i in range(45):
    os.mkdir('d' * 100, dir_fd=d)
    n = os.open('d' * 100, os.O_RDONLY, dir_fd=d)
    os.close(d)
    d = n
deep = os.open('deep.txt', os.O_RDWR | os.O_CREAT, 0o644, dir_fd=d)
os.close(d)
os.write(deep, b'before')
`

// TestFastPathLongPathRefused: a process holding an fd whose path is longer than the
// kernel reports (over PATH_MAX) is refused with 409 naming the fd, not moved with that fd
// left on the frozen layer; a working directory that deep is refused too. Nothing
// changes: the process writes on through its fd into its own file.
func TestFastPathLongPathRefused(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "lp")
	exPython(t, d, "lp", exDeep)
	fd := strings.TrimSpace(sessRun(t, d, "lp", "py", "print(deep)"))
	fpRefused(t, d, "lp", "session py", "fd "+fd+":", "PATH_MAX")
	sessRun(t, d, "lp", "py", "os.write(deep, b' after'); os.lseek(deep, 0, 0)")
	exOut(t, d, "lp", "py", "print(os.read(deep, 100))", "b'before after'\n")
	sessRun(t, d, "lp", "py", "os.close(deep)")
	// A working directory that deep (its own fd closed).
	sessRun(t, d, "lp", "py", "os.chdir('/workspace')\nfor i in range(45): os.chdir('d' * 100)")
	fpRefused(t, d, "lp", "session py", "working directory", "PATH_MAX")
	sessRun(t, d, "lp", "py", "os.chdir('/')")
	if op := dbxCheckpoint(t, d, "lp", "ok"); op.Processes != 1 {
		t.Fatalf("checkpoint once the deep fd is closed: %d processes: %v", op.Processes, op.ProcessErrors)
	}
}

// TestFastPathMountInsideRefused: a tmpfs cannot be mounted inside the sandbox (an fd, a
// working directory or a writable shared mapping on one was refused with 409 naming it:
// reopened by path on the new state it would become the overlay's file under the mount
// point). Files on the state's own mounts (/proc, /dev) are taken.
func TestFastPathMountInsideRefused(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "mi")
	// Nothing can be mounted inside any more (the sandbox's seccomp filter refuses mount
	// and the new mount API: internal/sbinit/seccomp.go), so no fd, working directory or
	// mapping can be on such a mount; the fast path's refusal of one stays, unreachable.
	sessRun(t, d, "mi", "main", "mkdir -p /mnt/t && echo under > /mnt/t/f")
	exOut(t, d, "mi", "main", "mount -t tmpfs none /mnt/t 2>/dev/null; echo $?", "32\n")
	// The state's own mounts are taken: /proc and /dev (clones of the base's).
	// (/dev/shm, a bind of the overlay, is taken too, but its files do not survive a
	// checkpoint yet: the /dev/shm work's.)
	sessRun(t, d, "mi", "main", "cd /dev/pts")
	exPython(t, d, "mi", "import os\nst = open('/proc/self/status')\npts = os.open('/dev/pts', os.O_RDONLY)")
	op := dbxCheckpoint(t, d, "mi", "ok")
	if op.Processes != 2 {
		t.Fatalf("checkpoint: %d processes: %v", op.Processes, op.ProcessErrors)
	}
	exOut(t, d, "mi", "main", "pwd; cat /mnt/t/f", "/dev/pts\nunder\n")
	probe := "print(st.readline().split()[0], os.readlink('/proc/self/fd/%d' % pts))"
	exOut(t, d, "mi", "py", probe, "Name: /dev/pts\n")
	dbxRestore(t, d, "mi", op.Node.ID)
	exOut(t, d, "mi", "py", "st.seek(0)\n"+probe, "Name: /dev/pts\n")
}

// TestFastPathFileNamedDeleted: a live file whose name ends in " (deleted)", held open, is
// checkpointed and restored like any other file (its fd reopened at its offset). Files
// that are deleted are still refused: one unlinked while open, and a name unlinked from a
// file that keeps another link, even beside a file that has the name its fd's link reads.
func TestFastPathFileNamedDeleted(t *testing.T) {
	// Durable images off: with them, CRIU carries a deleted file instead
	// (TestCRIUCarriesWhatTheFastPathRefuses); the refusal is the fast path's own.
	d := testutil.StartDaemonEnv(t, testutil.NewStore(t), "DELTABOX_DURABLE=0")
	dbxCreate(t, d, "fd")
	exPython(t, d, "fd", "import os\nf = open('/workspace/x (deleted)', 'w+')\nf.write('abc'); f.flush()")
	op := dbxCheckpoint(t, d, "fd", "named")
	if op.Processes != 1 {
		t.Fatalf("checkpoint: %d processes: %v", op.Processes, op.ProcessErrors)
	}
	sessRun(t, d, "fd", "py", "f.write('def'); f.flush()")
	if b, _ := d.C.ReadFile(dbxCtx(t), "fd", "/workspace/x (deleted)"); string(b) != "abcdef" {
		t.Fatalf("a write through the moved fd: the file holds %q", b)
	}
	dbxRestore(t, d, "fd", op.Node.ID)
	exOut(t, d, "fd", "py", "print(f.tell()); f.write('ghi'); f.flush(); f.seek(0); print(f.read())", "3\nabcghi\n")
	sessRun(t, d, "fd", "py", "f.close()")

	sessRun(t, d, "fd", "py", "g = open('/workspace/gone', 'w')\nos.unlink('/workspace/gone')")
	fpRefused(t, d, "fd", "session py", "deleted file", "/workspace/gone (deleted)")
	sessRun(t, d, "fd", "py", "g.close()")
	sessRun(t, d, "fd", "py", "open('/workspace/a', 'w').write('a')\nos.link('/workspace/a', '/workspace/b')\nk = open('/workspace/a')\nos.unlink('/workspace/a')\nopen('/workspace/a (deleted)', 'w').write('decoy')")
	fpRefused(t, d, "fd", "session py", "deleted file", "/workspace/a (deleted)")
	exOut(t, d, "fd", "py", "print(k.read())", "a\n")
}

// TestFastPathDirNamedDeleted: directories too are deleted by their link count: a
// working directory named "z (deleted)" is kept, while a removed working directory and
// an fd on a removed directory are refused.
func TestFastPathDirNamedDeleted(t *testing.T) {
	// Durable images off: with them, CRIU carries a removed directory instead.
	d := testutil.StartDaemonEnv(t, testutil.NewStore(t), "DELTABOX_DURABLE=0")
	dbxCreate(t, d, "dd")
	sessRun(t, d, "dd", "main", "mkdir -p /workspace/x && cd /workspace/x && rmdir /workspace/x")
	fpRefused(t, d, "dd", "session main", "working directory was deleted")
	sessRun(t, d, "dd", "main", "cd /; mkdir -p /tmp/y; exec 5</tmp/y; rmdir /tmp/y")
	fpRefused(t, d, "dd", "session main", "fd 5 is a deleted file")
	sessRun(t, d, "dd", "main", "exec 5<&-; mkdir -p '/tmp/z (deleted)'; cd '/tmp/z (deleted)'")
	op := dbxCheckpoint(t, d, "dd", "ok")
	sessRun(t, d, "dd", "main", "cd /")
	dbxRestore(t, d, "dd", op.Node.ID)
	exOut(t, d, "dd", "main", "pwd", "/tmp/z (deleted)\n")
}

// TestFastPathDontforkRefused: memory marked MADV_DONTFORK (which fork does not copy: a
// restored python touching it died of SIGSEGV) or MADV_WIPEONFORK (which fork gives back
// zero-filled) is refused at the checkpoint with 409 naming the mapping, and nothing
// changes. Unmarked again, the same memory is checkpointed and restored with its bytes.
func TestFastPathDontforkRefused(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "df")
	exPython(t, d, "df", "import mmap\nm = mmap.mmap(-1, 8192, flags=mmap.MAP_PRIVATE)\nm[:3] = b'abc'\nm.madvise(mmap.MADV_DONTFORK)")
	fpRefused(t, d, "df", "session py", "MADV_DONTFORK")
	exOut(t, d, "df", "py", "print(bytes(m[:3]))", "b'abc'\n")
	// MADV_WIPEONFORK (18) and MADV_KEEPONFORK (19): not in python 3.11's mmap module.
	sessRun(t, d, "df", "py", "m.madvise(mmap.MADV_DOFORK)\nm.madvise(18)")
	fpRefused(t, d, "df", "session py", "MADV_WIPEONFORK")
	sessRun(t, d, "df", "py", "m.madvise(19)")
	op := dbxCheckpoint(t, d, "df", "kept")
	if op.Processes != 1 {
		t.Fatalf("checkpoint: %d processes: %v", op.Processes, op.ProcessErrors)
	}
	sessRun(t, d, "df", "py", "m[:3] = b'xyz'")
	dbxRestore(t, d, "df", op.Node.ID)
	exOut(t, d, "df", "py", "print(bytes(m[:3]))", "b'abc'\n")
}

// TestFastPathDevNullReadsDevNull: a background job's /dev/null fds read /dev/null after
// a checkpoint and after a restore (they read "/null" once the state they were opened on
// was torn down), and two fds that shared one open file description (>/dev/null 2>&1)
// still do.
func TestFastPathDevNullReadsDevNull(t *testing.T) {
	d := testutil.StartDaemon(t)
	info := dbxCreate(t, d, "dn")
	r := dbxExec(t, d, "dn", api.ExecRequest{Argv: []string{"bash", "-c", "sleep 1000 </dev/null >/dev/null 2>&1 & echo $!"}})
	pid := strings.TrimSpace(r.Stdout)
	// What fds 0-2 lead to, looked at from the host: the session cannot read another
	// command's /proc/PID/fd (each command runs in a Landlock domain of its own).
	devNull := func(what string) {
		t.Helper()
		n, _ := strconv.Atoi(pid)
		h, err := fastpath.HostPid(dbxReadPids(dbxCgroupDir(t, info.InitPid)+"/cgroup.procs"), n)
		if err != nil {
			t.Fatal(err)
		}
		for i := 0; i < 3; i++ {
			var st unix.Stat_t
			if err := unix.Stat(fmt.Sprintf("/proc/%d/fd/%d", h, i), &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFCHR || st.Rdev != unix.Mkdev(1, 3) {
				t.Fatalf("%s: fd %d of the job: %v, mode %o rdev %d:%d, want /dev/null (1:3)", what, i, err, st.Mode, unix.Major(st.Rdev), unix.Minor(st.Rdev))
			}
		}
	}
	devNull("before any checkpoint")
	shared := func(what string) {
		t.Helper()
		n, _ := strconv.Atoi(pid)
		h, err := fastpath.HostPid(dbxReadPids(dbxCgroupDir(t, info.InitPid)+"/cgroup.procs"), n)
		if err != nil {
			t.Fatal(err)
		}
		if !kcmpFile(t, h, h, 1, 2) || kcmpFile(t, h, h, 0, 1) {
			t.Errorf("%s: fds 1 and 2 share a description %v (want true), 0 and 1 %v (want false)", what, kcmpFile(t, h, h, 1, 2), kcmpFile(t, h, h, 0, 1))
		}
	}
	sessRun(t, d, "dn", "main", "echo x > /workspace/x") // a change: the checkpoint mounts a new state
	op := dbxCheckpoint(t, d, "dn", "one")
	if op.Processes != 2 {
		t.Fatalf("checkpoint: %d processes: %v", op.Processes, op.ProcessErrors)
	}
	sessRun(t, d, "dn", "main", "echo y > /workspace/y")
	dbxCheckpoint(t, d, "dn", "two") // and the first one's namespace is gone
	devNull("after checkpoints")
	shared("after checkpoints")
	dbxRestore(t, d, "dn", op.Node.ID)
	devNull("after a restore")
	shared("after a restore")
}

// TestFastPathRefusalNamesSandboxPids: a refusal names a session's child by its PID in
// the sandbox (what $! said), not the daemon's.
func TestFastPathRefusalNamesSandboxPids(t *testing.T) {
	// Durable images off: with them, CRIU takes the session instead (state/criutrees.go,
	// TestCRIUSessionTreesRoundTrip), and the refusal is what is left without it.
	d := testutil.StartDaemonEnv(t, testutil.NewStore(t), "DELTABOX_DURABLE=0")
	dbxCreate(t, d, "np")
	out := strings.Fields(sessRun(t, d, "np", "main", "sleep 1000 & echo $!")) // "[1] PID", then PID
	child := out[len(out)-1]
	fpRefused(t, d, "np", "session main", "it has child processes ("+child+")")
}
