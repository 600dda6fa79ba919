package security

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/apitypes"
	"deltabox/internal/errdefs"
	"deltabox/internal/testutil"
)

// smallStore loop-mounts a fresh reflink XFS of mib MiB as a daemon's store, with the
// main store's images linked in (testutil.NewStore does the same on the main store).
func smallStore(t *testing.T, mib int) string {
	t.Helper()
	testutil.RequireStore(t)
	_, err := exec.LookPath("mkfs.xfs")
	testutil.Require(t, err == nil, "no mkfs.xfs: %v", err)
	dir := t.TempDir()
	img, root := filepath.Join(dir, "store.img"), filepath.Join(dir, "root")
	run := func(name string, args ...string) {
		t.Helper()
		if out, err := testutil.Command(t, time.Minute, name, args...).CombinedOutput(); err != nil {
			t.Fatalf("%s %v: %v\n%s", name, args, err, out)
		}
	}
	f, err := os.Create(img)
	if err != nil {
		t.Fatal(err)
	}
	f.Truncate(int64(mib) << 20)
	f.Close()
	run("mkfs.xfs", "-q", "-m", "reflink=1", img)
	os.Mkdir(root, 0o700)
	run("mount", "-o", "loop", img, root)
	t.Cleanup(func() { unix.Unmount(root, unix.MNT_DETACH) })
	// Run before the unmount (cleanups run last first): the sandboxes outlive their daemon.
	t.Cleanup(func() { testutil.EndSandboxes(root) })
	os.Mkdir(filepath.Join(root, "images"), 0o700)
	ims, _ := os.ReadDir(filepath.Join(testutil.MainRoot(), "images"))
	for _, im := range ims {
		if im.Name()[0] != '.' {
			os.Symlink(filepath.Join(testutil.MainRoot(), "images", im.Name()), filepath.Join(root, "images", im.Name()))
		}
	}
	return root
}

// fillScript writes 1 MiB at a time until a write fails or it is killed.
const fillScript = `while head -c 1M /dev/zero >> /workspace/fill; do :; done 2>/dev/null; echo stopped`

// TestDiskQuotaStopsFiller: a sandbox created with disk_mb 64 writes without end. Its
// writer is killed soon after its upper passes 64 MiB (not when the store is full), its
// next exec, file write and checkpoint answer 507 naming the quota, a delete through
// the files API lets it run again, and a second sandbox on the same store is untouched.
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

	r, err := d.C.Exec(c, "hog", apitypes.ExecRequest{Argv: []string{"bash", "-c", fillScript}, TimeoutMS: 60_000})
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
	var size int64
	if fi, err := d.C.StatFile(c, "hog", "/workspace/fill"); err == nil {
		size = fi.Size
	}
	t.Logf("filler: exit %d signal %d %q; wrote %d MiB; disk %+v; store free %d MiB", r.ExitCode, r.Signal, r.Stdout, size>>20, in.Disk, free>>20)
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
	// Deleting the file brings the sandbox back.
	if err := d.C.RemoveFile(c, "hog", "/workspace/fill", false); err != nil {
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
// daemon restart: nothing reported durable is lost.
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
