package security

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/apitypes"
	"deltabox/internal/client"
	"deltabox/internal/errdefs"
	"deltabox/internal/testutil"
)

// smallStore is a store on a fresh XFS of mib MiB (testutil.NewSmallStore).
func smallStore(t *testing.T, mib int) string { return testutil.NewSmallStore(t, mib) }

// fillScript writes 1 MiB at a time until a write fails or it is killed.
const fillScript = `while head -c 1M /dev/zero >> /workspace/fill; do :; done 2>/dev/null; echo stopped`

// multiFillScript writes a new 1 MiB file at a time, under /workspace/fills, until a
// write fails or it is killed: no one file reaches the quota (RLIMIT_FSIZE), so only
// the watcher stops it.
const multiFillScript = `mkdir -p /workspace/fills; i=0; while head -c 1M /dev/zero > /workspace/fills/$i; do i=$((i+1)); done 2>/dev/null; echo stopped`

// TestDiskQuotaStopsFiller: a sandbox created with disk_mb 64 writes new files without
// end. Its writer is killed soon after its upper passes 64 MiB (not when the store is
// full), its next exec, file write and checkpoint answer 507 naming the quota, a delete
// through the files API lets it run again, and a second sandbox on the same store is
// untouched.
func TestDiskQuotaStopsFiller(t *testing.T) {
	root := smallStore(t, 1024)
	d := testutil.StartDaemonOn(t, root)
	c := ctx(t)
	if _, err := d.C.Create(c, apitypes.CreateOptions{ID: "hog", DiskMB: 64}); err != nil {
		t.Fatal(err)
	}
	if _, err := d.C.Create(c, apitypes.CreateOptions{ID: "victim"}); err != nil {
		t.Fatal(err)
	}
	sh(t, d, "victim", "echo kept > /workspace/kept")

	r, err := d.C.Exec(c, "hog", apitypes.ExecRequest{Argv: []string{"bash", "-c", multiFillScript}, TimeoutMS: 60_000})
	if err != nil {
		t.Fatalf("filler: %v", err)
	}
	var st unix.Statfs_t
	unix.Statfs(root, &st)
	free := int64(st.Bavail) * st.Bsize
	in, err := d.C.Get(c, "hog")
	if err != nil {
		t.Fatal(err)
	}
	var wrote int
	if l, err := d.C.ListFiles(c, "hog", "/workspace/fills", client.ListFilesOptions{}); err == nil {
		wrote = len(l.Entries)
	}
	t.Logf("filler: exit %d signal %d %q; wrote %d MiB; disk %+v; store free %d MiB", r.ExitCode, r.Signal, r.Stdout, wrote, in.Disk, free>>20)
	if in.Disk == nil || in.Disk.Exceeded == "" {
		t.Fatalf("the filler was not stopped by its quota: disk %+v, the store has %d MiB free", in.Disk, free>>20)
	}
	if r.Signal != int(unix.SIGKILL) {
		t.Errorf("the filler ended with exit %d signal %d, want SIGKILL", r.ExitCode, r.Signal)
	}
	if free < 256<<20 {
		t.Errorf("only %d MiB free: the filler ran until the store was nearly full", free>>20)
	}
	_, err = d.C.Exec(c, "hog", apitypes.ExecRequest{Argv: []string{"true"}})
	if !errors.Is(err, errdefs.ErrQuota) || !strings.Contains(err.Error(), "disk quota exceeded") {
		t.Errorf("exec over quota: %v, want 507 disk quota exceeded", err)
	}
	if _, err := d.C.Checkpoint(c, "hog", ""); !errors.Is(err, errdefs.ErrQuota) {
		t.Errorf("checkpoint over quota: %v, want 507", err)
	}
	// Deleting the files brings the sandbox back.
	if err := d.C.RemoveFile(c, "hog", "/workspace/fills", true); err != nil {
		t.Fatalf("delete over quota: %v", err)
	}
	if out := sh(t, d, "hog", "echo back"); out != "back\n" {
		t.Errorf("after the delete: %q", out)
	}
	// The other sandbox never noticed.
	if out := sh(t, d, "victim", "cat /workspace/kept"); out != "kept\n" {
		t.Errorf("victim: %q", out)
	}
	if _, err := d.C.Checkpoint(c, "victim", ""); err != nil {
		t.Errorf("victim checkpoint: %v", err)
	}
	// The quota is in the sandbox's record: a restarted daemon keeps it.
	d.Stop()
	d = testutil.StartDaemonOn(t, root)
	if in, err := d.C.Get(c, "hog"); err != nil || in.DiskMB != 64 || in.Disk == nil || in.Disk.LimitMB != 64 {
		t.Errorf("after a restart: %+v, %v; want disk_mb 64", in, err)
	}
}

// TestDiskFillerKeepsOthersCommitting: a sandbox under its quota fills the whole store
// (its quota is larger than the store). A second sandbox keeps checkpointing and every
// checkpoint commits (POST /v1/sync answers), and all of them are there after a
// daemon restart: nothing reported durable is lost. The filler, which never
// checkpointed, is removed to give its space back.
func TestDiskFillerKeepsOthersCommitting(t *testing.T) {
	root := smallStore(t, 512)
	d := testutil.StartDaemonOn(t, root)
	c := ctx(t)
	for _, id := range []string{"filler", "victim"} {
		if _, err := d.C.Create(c, apitypes.CreateOptions{ID: id}); err != nil {
			t.Fatal(err)
		}
	}
	sh(t, d, "victim", "echo kept > /workspace/kept")
	r, err := d.C.Exec(c, "filler", apitypes.ExecRequest{Argv: []string{"bash", "-c", fillScript}, TimeoutMS: 60_000})
	if err != nil {
		t.Fatalf("filler: %v", err)
	}
	var st unix.Statfs_t
	unix.Statfs(root, &st)
	t.Logf("filler: exit %d signal %d %q; store free %d MiB", r.ExitCode, r.Signal, r.Stdout, int64(st.Bavail)*st.Bsize>>20)

	// Enough checkpoints that the index has to grow (each one is a new node).
	const n = 300
	var last string
	for i := range n {
		res, err := d.C.CheckpointWith(c, "victim", apitypes.CheckpointRequest{Label: fmt.Sprintf("c%03d-%s", i, strings.Repeat("x", 200))})
		if err != nil {
			t.Fatalf("victim checkpoint %d on a full store: %v", i, err)
		}
		last = res.Node.ID
	}
	sc, cancel := context.WithTimeout(c, 30*time.Second)
	defer cancel()
	if err := d.C.Sync(sc); err != nil {
		t.Fatalf("sync after %d checkpoints on a full store: %v", n, err)
	}
	if out := sh(t, d, "victim", "cat /workspace/kept"); out != "kept\n" {
		t.Errorf("victim: %q", out)
	}
	for t0 := time.Now(); ; time.Sleep(100 * time.Millisecond) {
		_, err := d.C.Get(c, "filler")
		if errors.Is(err, errdefs.ErrNotFound) {
			break
		}
		if time.Since(t0) > 30*time.Second {
			unix.Statfs(root, &st)
			t.Fatalf("the filler is still there (%v) with %d MiB free: its space was not given back", err, int64(st.Bavail)*st.Bsize>>20)
		}
	}
	d.Stop()
	d = testutil.StartDaemonOn(t, root)
	tr, err := d.C.Tree(c)
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, nd := range tr.Nodes {
		found = found || nd.ID == last
	}
	if len(tr.Nodes) < n || !found {
		t.Fatalf("after a restart: %d nodes (want %d), last checkpoint %s found: %v", len(tr.Nodes), n, last, found)
	}
}

// TestDiskFallocateRefusedInCall: one fallocate longer than the sandbox's disk_mb fails
// in the call with EDQUOT ("Disk quota exceeded"), whether it would grow the file or
// keep its size, and the store lost nothing; punching a hole of any length still works.
// Before, a 512 MiB fallocate passed a 64 MiB quota, and its blocks stayed until the
// watcher stopped the sandbox a pass later.
func TestDiskFallocateRefusedInCall(t *testing.T) {
	root := smallStore(t, 1024)
	d := testutil.StartDaemonOn(t, root)
	c := ctx(t)
	if _, err := d.C.Create(c, apitypes.CreateOptions{ID: "fa", DiskMB: 64}); err != nil {
		t.Fatal(err)
	}
	var st unix.Statfs_t
	unix.Statfs(root, &st)
	before := int64(st.Bavail) * st.Bsize
	out := sh(t, d, "fa", `cd /workspace
fallocate -l 512M big 2>&1; echo "grow=$?"
touch big2; fallocate -n -l 512M big2 2>&1; echo "keep=$?"
fallocate -l 8M small && echo small=ok
fallocate -p -o 0 -l 1G small && echo punch=ok
du -k big big2 2>/dev/null | awk '{s+=$1} END {print "kib=" s+0}'`)
	t.Logf("inside:\n%s", out)
	for _, want := range []string{"grow=1", "keep=1", "small=ok", "punch=ok", "kib=0"} {
		if !strings.Contains(out, want) {
			t.Errorf("want %q in:\n%s", want, out)
		}
	}
	if n := strings.Count(out, "Disk quota exceeded"); n != 2 {
		t.Errorf("%d of the 2 long fallocates failed with EDQUOT:\n%s", n, out)
	}
	unix.Statfs(root, &st)
	if lost := before - int64(st.Bavail)*st.Bsize; lost > 32<<20 {
		t.Errorf("the store lost %d MiB to a refused fallocate", lost>>20)
	}
	in, err := d.C.Get(c, "fa")
	if err != nil {
		t.Fatal(err)
	}
	if in.Disk != nil && in.Disk.Exceeded != "" {
		t.Errorf("the sandbox was stopped (%s): the refusal should have kept it under its quota", in.Disk.Exceeded)
	}
}

// TestDiskInodesCounted: empty files count against disk_mb by their inodes (512 B
// each), so that 300,000 of them cannot take 160 MB of the store under a 50 MB quota
// (they measured 13.8 MB, their directories' blocks). The writer is stopped near the
// quota, long before its 300,000th file.
func TestDiskInodesCounted(t *testing.T) {
	root := smallStore(t, 1024)
	d := testutil.StartDaemonOn(t, root)
	c := ctx(t)
	if _, err := d.C.Create(c, apitypes.CreateOptions{ID: "inodes", DiskMB: 50}); err != nil {
		t.Fatal(err)
	}
	var st unix.Statfs_t
	unix.Statfs(root, &st)
	before := int64(st.Bfree) * st.Bsize
	r, err := d.C.Exec(c, "inodes", apitypes.ExecRequest{Argv: []string{"python3", "-c", `
import os
os.makedirs('/workspace/e', exist_ok=True)
for i in range(300000):
    if i % 1000 == 0:
        d = '/workspace/e/%d' % (i // 1000)
        os.mkdir(d)
    os.close(os.open('%s/%d' % (d, i), os.O_CREAT | os.O_WRONLY, 0o644))
print('made them all')
`}, TimeoutMS: 120_000})
	if err != nil {
		t.Fatal(err)
	}
	unix.Statfs(root, &st)
	took := before - int64(st.Bfree)*st.Bsize
	in, err := d.C.Get(c, "inodes")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("exit %d signal %d %q; the store lost %d MiB; disk %+v", r.ExitCode, r.Signal, r.Stdout, took>>20, in.Disk)
	if in.Disk == nil || in.Disk.Exceeded == "" || strings.Contains(r.Stdout, "made them all") {
		t.Fatalf("300,000 empty files passed a 50 MB quota (the store lost %d MiB): disk %+v", took>>20, in.Disk)
	}
	if took > 100<<20 {
		t.Errorf("the store lost %d MiB to a 50 MB quota", took>>20)
	}
}

// imgHog is a process the fast path refuses (two threads: CRIU takes it at a
// checkpoint), holding 40 MiB of random memory more at each SIGUSR1. It takes SIGUSR1
// with sigwait, blocked in both threads, not with a handler and pause(): signalled
// right after a checkpoint, the handler version lost the signal in 1 run of 4 to 6
// (nothing pending, the process at 40 MiB, its main thread in pause()). The likely
// cause: the checkpoint moves the tree by CRIU (ended, restored from its images onto
// the new state), a restored thread re-enters pause() from before its syscall
// instruction, and a handler that ran in between leaves it waiting. A blocked signal
// stays pending until sigwait takes it.
const imgHog = `
import os, signal, threading, time
held = []
def grow():
    held.append(os.urandom(40 << 20))
    open('/workspace/hog.n', 'w').write(str(len(held)))
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
threading.Thread(target=lambda: time.sleep(1e6), daemon=True).start()
grow()
open('/workspace/hog.pid', 'w').write(str(os.getpid()))
while True:
    signal.sigwait({signal.SIGUSR1})
    grow()
`

// TestDiskCheckpointImagesCounted: the process images a sandbox's checkpoints add to the
// store count against its disk_mb. A sandbox of disk_mb 100 whose process holds 40 MiB
// checkpoints once (about 40 MiB of images); with 80 MiB its next checkpoint would take
// the sandbox past 100 MB: it is refused with 507 at the checkpoint, its process runs on
// as before, and nothing of the refused images stays. Before, three such checkpoints
// took about 2 GB of a disk_mb 100 sandbox.
func TestDiskCheckpointImagesCounted(t *testing.T) {
	root := smallStore(t, 2048)
	d := testutil.StartDaemonOn(t, root)
	c := ctx(t)
	if _, err := d.C.Create(c, apitypes.CreateOptions{ID: "img", DiskMB: 100}); err != nil {
		t.Fatal(err)
	}
	r, err := d.C.Exec(c, "img", apitypes.ExecRequest{Argv: []string{"bash", "-c", `printf %s "$1" > /workspace/hog.py
cd /workspace; nohup python3 hog.py </dev/null >/dev/null 2>&1 &
for i in $(seq 1000); do [ -s hog.pid ] && exit 0; sleep 0.01; done; exit 1`, "sh", imgHog}, TimeoutMS: 30_000})
	if err != nil || r.ExitCode != 0 {
		t.Fatalf("start the hog: %+v %v", r, err)
	}
	pid := strings.TrimSpace(sh(t, d, "img", "cat /workspace/hog.pid"))
	if _, err := d.C.Checkpoint(c, "img", "one"); err != nil {
		t.Fatalf("first checkpoint (40 MiB of images, disk_mb 100): %v", err)
	}
	// Signalled through the daemon: a command cannot signal another command's process
	// (Landlock domains; `kill -USR1` from an exec got EPERM, the hog stayed at 40 MiB
	// and the second checkpoint fit).
	pidN, err := strconv.Atoi(pid)
	if err != nil {
		t.Fatalf("the hog's pid: %q", pid)
	}
	if _, err := d.C.Signal(c, "img", pidN, int(unix.SIGUSR1)); err != nil {
		t.Fatalf("signal the hog to grow: %v", err)
	}
	if r, err := d.C.Exec(c, "img", apitypes.ExecRequest{Argv: []string{"bash", "-c", `for i in $(seq 1000); do [ "$(cat /workspace/hog.n)" = 2 ] && exit 0; sleep 0.01; done; exit 1`}, TimeoutMS: 30_000}); err != nil || r.ExitCode != 0 {
		t.Fatalf("the hog did not grow to 80 MiB: %+v %v\n%s", r, err, sh(t, d, "img", "cat /proc/"+pid+"/status"))
	}
	// The watcher's next pass counts the first checkpoint's images.
	deadline := time.Now().Add(10 * time.Second)
	var in *apitypes.SandboxInfo
	for {
		if in, err = d.C.Get(c, "img"); err != nil {
			t.Fatal(err)
		}
		if in.Disk != nil && in.Disk.ImageBytes > 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("after the first checkpoint: disk %+v", in.Disk)
	if in.Disk == nil || in.Disk.ImageBytes < 30<<20 {
		t.Errorf("the first checkpoint's images are not counted: disk %+v", in.Disk)
	}
	var st unix.Statfs_t
	unix.Statfs(root, &st)
	before := int64(st.Bfree) * st.Bsize
	_, err = d.C.Checkpoint(c, "img", "two")
	if !errors.Is(err, errdefs.ErrQuota) || !strings.Contains(err.Error(), "disk quota exceeded") {
		t.Fatalf("a checkpoint whose images take the sandbox past disk_mb 100: %v, want 507 disk quota exceeded", err)
	}
	t.Logf("refused: %v", err)
	// XFS frees an unlinked file's blocks in the background (inodegc): a moment later.
	var kept int64
	for i := 0; i < 50; i++ {
		unix.Statfs(root, &st)
		if kept = before - int64(st.Bfree)*st.Bsize; kept <= 16<<20 {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if kept > 16<<20 {
		out, _ := exec.Command("du", "-sm", filepath.Join(root, "durable", "bg")).CombinedOutput()
		t.Errorf("the refused checkpoint left %d MiB in the store (durable/bg: %s)", kept>>20, out)
	}
	// By /proc: `kill -0` of another command's process is refused (Landlock domains).
	if out := sh(t, d, "img", "[ -e /proc/"+pid+" ] && ! grep -q '^State:.*Z' /proc/"+pid+"/status && echo alive"); out != "alive\n" {
		t.Errorf("the process after a refused checkpoint: %q", out)
	}
}

// TestDiskFullStopsGuiltyGivesBack: a sandbox whose quota is larger than the store fills
// it. It is the one stopped, not a sandbox that wrote nothing, and the space is given
// back: its upper is dropped (it is restored to its last checkpoint, whose file is
// still there), so the store does not stay full; the other sandbox runs and
// checkpoints throughout.
func TestDiskFullStopsGuiltyGivesBack(t *testing.T) {
	root := smallStore(t, 512)
	d := testutil.StartDaemonOn(t, root)
	c := ctx(t)
	for _, id := range []string{"guilty", "idle"} {
		if _, err := d.C.Create(c, apitypes.CreateOptions{ID: id}); err != nil {
			t.Fatal(err)
		}
	}
	sh(t, d, "guilty", "echo mine > /workspace/kept")
	if _, err := d.C.Checkpoint(c, "guilty", "before"); err != nil {
		t.Fatal(err)
	}
	r, err := d.C.Exec(c, "guilty", apitypes.ExecRequest{Argv: []string{"bash", "-c", fillScript}, TimeoutMS: 60_000})
	if err != nil {
		t.Fatalf("filler: %v", err)
	}
	t.Logf("filler: exit %d signal %d %q", r.ExitCode, r.Signal, r.Stdout)
	free := func() int64 {
		var st unix.Statfs_t
		unix.Statfs(root, &st)
		return int64(st.Bavail) * st.Bsize
	}
	t0 := time.Now()
	for free() < 256<<20 && time.Since(t0) < 30*time.Second {
		time.Sleep(100 * time.Millisecond)
	}
	if f := free(); f < 256<<20 {
		t.Fatalf("the store stays full: %d MiB free 30 s after the filler was stopped", f>>20)
	}
	t.Logf("%d MiB free %v after the filler's exec answered", free()>>20, time.Since(t0).Round(100*time.Millisecond))
	idle, err := d.C.Get(c, "idle")
	if err != nil {
		t.Fatal(err)
	}
	if idle.Disk != nil && idle.Disk.Exceeded != "" {
		t.Errorf("the sandbox that wrote nothing was stopped: %s", idle.Disk.Exceeded)
	}
	if out := sh(t, d, "idle", "echo ok"); out != "ok\n" {
		t.Errorf("idle: %q", out)
	}
	if _, err := d.C.Checkpoint(c, "idle", ""); err != nil {
		t.Errorf("idle checkpoint: %v", err)
	}
	// The guilty one is back on its checkpoint: its earlier file is there, the filler's not.
	out := sh(t, d, "guilty", "cat /workspace/kept; ls /workspace/fill 2>&1 | head -1")
	if !strings.HasPrefix(out, "mine\n") || !strings.Contains(out, "No such file") {
		t.Errorf("guilty after the store was given back: %q", out)
	}
}

// TestDiskDurableImagesCounted: the durable process images of a sandbox's nodes count
// against its disk_mb. With disk_mb 100, the image of a checkpoint holding 40 MiB is
// kept; the next one adds 64 MiB of new pages (the first 40 are the page store's
// already), which would take the sandbox past 100 MB: the checkpoint answers (its
// processes are in its templates), but its image fails naming the quota and the store
// does not keep it.
func TestDiskDurableImagesCounted(t *testing.T) {
	root := smallStore(t, 2048)
	d := testutil.StartDaemonOn(t, root)
	c := ctx(t)
	if _, err := d.C.Create(c, apitypes.CreateOptions{ID: "dimg", DiskMB: 100}); err != nil {
		t.Fatal(err)
	}
	// A python session (one thread: the fast path makes it a template, whose durable
	// image is written after the checkpoint) holding 40 MiB of random memory.
	if _, err := d.C.StartSession(c, "dimg", apitypes.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	run := func(code string) {
		t.Helper()
		if r, err := d.C.Run(c, "dimg", "py", code, 30*time.Second); err != nil || r.ExitCode != 0 {
			t.Fatalf("%s: %+v %v", code, r, err)
		}
	}
	run("import os; held = [os.urandom(40 << 20)]")
	image := func(node string) *apitypes.ImageInfo {
		t.Helper()
		deadline := time.Now().Add(60 * time.Second)
		for {
			n, err := d.C.Node(c, node)
			if err != nil {
				t.Fatal(err)
			}
			// nil until the node's templates are parked and its image queued.
			if p := n.ProcessImage; p != nil && p.State != "pending" || time.Now().After(deadline) {
				return p
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	one, err := d.C.Checkpoint(c, "dimg", "one")
	if err != nil {
		t.Fatal(err)
	}
	if p := image(one.Node.ID); p == nil || p.State != "complete" {
		t.Fatalf("the first image (40 MiB, disk_mb 100): %+v", p)
	}
	run("held.append(os.urandom(64 << 20))")
	var st unix.Statfs_t
	unix.Statfs(root, &st)
	before := int64(st.Bfree) * st.Bsize
	two, err := d.C.Checkpoint(c, "dimg", "two")
	if err != nil {
		t.Fatalf("the second checkpoint: %v", err)
	}
	p := image(two.Node.ID)
	t.Logf("second image: %+v", p)
	if p == nil || p.State != "failed" || !strings.Contains(p.Error, "disk quota exceeded") {
		t.Fatalf("the image that takes the sandbox past disk_mb 100: %+v, want failed, disk quota exceeded", p)
	}
	var kept int64
	for i := 0; i < 50; i++ {
		unix.Statfs(root, &st)
		if kept = before - int64(st.Bfree)*st.Bsize; kept <= 16<<20 {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if kept > 16<<20 {
		t.Errorf("the refused image left %d MiB in the store", kept>>20)
	}
	in, err := d.C.Get(c, "dimg")
	if err != nil {
		t.Fatal(err)
	}
	if in.Disk == nil || in.Disk.ImageBytes < 30<<20 || in.Disk.ImageBytes > 60<<20 {
		t.Errorf("image_bytes: disk %+v, want the first image's (about 40 MiB)", in.Disk)
	}
}

// TestDiskFullInnocentWriterKept: a sandbox fills the store with fallocates, each under
// its disk_mb (so none is refused in the call), faster than any pass. It is stopped and
// its upper given back (it never checkpointed: it is removed); a second sandbox writing
// a little all along is never stopped
// (before, the hog was stopped for its quota, the store stayed full, and the next pass
// stopped the sandbox that wrote most since: the innocent one).
func TestDiskFullInnocentWriterKept(t *testing.T) {
	root := smallStore(t, 512)
	d := testutil.StartDaemonOn(t, root)
	c := ctx(t)
	// A quota the store cannot hold: the store fills before the hog reaches it.
	if _, err := d.C.Create(c, apitypes.CreateOptions{ID: "hog", DiskMB: 400}); err != nil {
		t.Fatal(err)
	}
	if _, err := d.C.Create(c, apitypes.CreateOptions{ID: "writer"}); err != nil {
		t.Fatal(err)
	}
	// 2 MiB every 100 ms, new files (a failed write, ENOSPC while the store is full,
	// does not end it), until 20 s have passed.
	wr := make(chan *apitypes.ExecResult, 1)
	go func() {
		r, _ := d.C.Exec(context.WithoutCancel(c), "writer", apitypes.ExecRequest{Argv: []string{"bash", "-c",
			`for i in $(seq 200); do head -c 2M /dev/urandom > /workspace/w$((i % 20)) 2>/dev/null; sleep 0.1; done; echo done`}, TimeoutMS: 60_000})
		wr <- r
	}()
	time.Sleep(time.Second)
	r, err := d.C.Exec(c, "hog", apitypes.ExecRequest{Argv: []string{"bash", "-c",
		`cd /workspace; i=0; while [ $i -lt 100 ]; do fallocate -l 128M f$i 2>/dev/null; i=$((i+1)); done; echo end`}, TimeoutMS: 60_000})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("hog: exit %d signal %d %q", r.ExitCode, r.Signal, r.Stdout)
	w := <-wr
	in, err := d.C.Get(c, "writer")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("writer: %+v; disk %+v", w, in.Disk)
	if w == nil || w.Stdout != "done\n" || (in.Disk != nil && in.Disk.Exceeded != "") {
		t.Errorf("the writer, which wrote 2 MiB at a time, was stopped: %+v, disk %+v", w, in.Disk)
	}
	var st unix.Statfs_t
	unix.Statfs(root, &st)
	if free := int64(st.Bavail) * st.Bsize; free < 256<<20 {
		t.Errorf("the store stays full: %d MiB free", free>>20)
	}
	// It never checkpointed: giving its upper back removes it.
	if _, err := d.C.Get(c, "hog"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("the hog is still there (%v): its space was not given back", err)
	}
}

// TestDiskFileBoundInWrite: no file of a sandbox grows past its disk_mb: the write that
// would fails (SIGXFSZ ends the writer, or EFBIG, "File too large", where it is
// ignored) and the file stops at the quota, with no pass of the watcher involved; a
// truncate past it fails likewise, and the sandbox cannot raise the limit. Before, a
// `>>` loop wrote 71 MiB at disk_mb 64 before the watcher killed it.
//
// The checks that allocate nothing run first, in a command of their own: a file at
// the quota puts the sandbox over it by its inodes, and the watcher then stops the
// sandbox (507 for its next commands), which CI once saw end the command before it
// printed anything. The file's size is then read through the files API.
func TestDiskFileBoundInWrite(t *testing.T) {
	root := smallStore(t, 1024)
	d := testutil.StartDaemonOn(t, root)
	c := ctx(t)
	if _, err := d.C.Create(c, apitypes.CreateOptions{ID: "big", DiskMB: 64}); err != nil {
		t.Fatal(err)
	}
	// 153: ended by SIGXFSZ (128+25), the default action of the write past the limit.
	out := sh(t, d, "big", `cd /workspace
truncate -s 1G sparse 2>&1; echo "truncate=$?"
python3 -c '
import os, resource, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
print("limit=%d" % resource.getrlimit(resource.RLIMIT_FSIZE)[1])
fd = os.open("p", os.O_CREAT | os.O_WRONLY)
try:
    os.pwrite(fd, b"x", 64 << 20)
except OSError as e:
    print("pwrite:", e.strerror)
try:
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
except (ValueError, OSError) as e:
    print("raise:", e)
'`)
	t.Logf("inside:\n%s", out)
	for _, want := range []string{"truncate=153", fmt.Sprintf("limit=%d", 64<<20), "pwrite: File too large", "raise:"} {
		if !strings.Contains(out, want) {
			t.Errorf("want %q in:\n%s", want, out)
		}
	}
	r, err := d.C.Exec(c, "big", apitypes.ExecRequest{Argv: []string{"bash", "-c", `head -c 100M /dev/zero > /workspace/big; echo "write=$?"`}, TimeoutMS: 30_000})
	if err != nil {
		t.Fatal(err)
	}
	// The writer ends by SIGXFSZ at the limit (153); the watcher may have stopped the
	// sandbox, over its quota by its inodes, before the echo (signal 9).
	if !strings.Contains(r.Stdout, "write=153") && r.Signal != int(unix.SIGKILL) {
		t.Errorf("the 100 MiB write: %+v, want write=153 (SIGXFSZ), or the watcher's SIGKILL", r)
	}
	fi, err := d.C.StatFile(c, "big", "/workspace/big")
	if err != nil {
		t.Fatal(err)
	}
	if fi.Size != 64<<20 {
		t.Errorf("/workspace/big is %d bytes, want %d: the write stops at disk_mb", fi.Size, 64<<20)
	}
}

// TestDiskProjectFixedInside: a sandbox cannot take its files out of the XFS project its
// quota is counted by (FS_IOC_FSSETXATTR with another project id, or without
// PROJINHERIT on a directory): the kernel refuses a project change from a user
// namespace other than the initial one (EINVAL), through overlayfs as well. This held
// before the quota counted inodes and images; it guards the accounting.
func TestDiskProjectFixedInside(t *testing.T) {
	d := testutil.StartDaemon(t)
	c := ctx(t)
	if _, err := d.C.Create(c, apitypes.CreateOptions{ID: "proj", DiskMB: 64}); err != nil {
		t.Fatal(err)
	}
	out := sh(t, d, "proj", `exec 2>&1; cd /workspace; head -c 1M /dev/zero > f; mkdir dd; python3 - <<'PY'
import fcntl, struct, os
GET, SET = 0x801c581f, 0x401c5820
for p in ["f", "dd", "/workspace"]:
    fd = os.open(p, os.O_RDONLY)
    b = bytearray(28)
    fcntl.ioctl(fd, GET, b)
    x = list(struct.unpack("IIIII8s", bytes(b)))
    for what, y in (("project 0", x[:3] + [0] + x[4:]), ("no inherit", [x[0] & ~0x200] + x[1:])):
        try:
            fcntl.ioctl(fd, SET, struct.pack("IIIII8s", *y))
            fcntl.ioctl(fd, GET, b)
            print(p, what, "changed:", struct.unpack("IIIII8s", bytes(b))[:4])
        except OSError as e:
            print(p, what, "refused:", e.strerror)
PY`)
	t.Logf("inside:\n%s", out)
	if strings.Contains(out, "changed") {
		// "no inherit" on a file is no change (files have no PROJINHERIT).
		for _, l := range strings.Split(out, "\n") {
			if strings.Contains(l, "changed") && !strings.HasPrefix(l, "f no inherit") {
				t.Errorf("a sandbox changed its files' project: %s", l)
			}
		}
	}
	if n := strings.Count(out, "refused: Invalid argument"); n < 5 {
		t.Errorf("%d of the 5 project changes refused:\n%s", n, out)
	}
}
