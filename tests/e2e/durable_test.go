package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/apitypes"
	"deltabox/internal/state"
	"deltabox/internal/testutil"
)

// durWaitImage waits for node's durable image to be complete (images are written in the
// background; the daemon probes CRIU for a few seconds at its start).
func durWaitImage(t *testing.T, d *testutil.Daemon, node string) *apitypes.ImageInfo {
	t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for {
		n, err := d.C.Node(dbxCtx(t), node)
		if err != nil {
			t.Fatal(err)
		}
		im := n.ProcessImage
		if im != nil && im.State == "failed" {
			testutil.Require(t, !strings.Contains(im.Error, "CRIU is unusable"), "no durable images here: %s", im.Error)
			t.Fatalf("node %s's image failed: %s\ndaemon log:\n%s", node, im.Error, dbxTail(d.Log(), 3000))
		}
		if im != nil && im.State == "complete" {
			return im
		}
		if time.Now().After(deadline) {
			t.Fatalf("node %s's image is not complete after 90 s: %+v", node, im)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestDurableImageRestore: a node's templates are written to a durable image in the
// background; once it is complete, the node restores its processes from it after its
// templates are evicted (POST /v1/nodes/ID/evict) or killed from inside the sandbox:
// the python session's objects and PID, the bash session's cwd and variables, as from
// the templates; so does a node checkpointed after a restore from an image. A second image, of a checkpoint after 2 MB of a 24 MB heap changed,
// stores at least 5 times less than its full CRIU images.
func TestDurableImageRestore(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "dur"
	dbxCreate(t, d, id)
	if _, err := d.C.StartSession(dbxCtx(t), id, state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	pyPid := strings.TrimSpace(sessRun(t, d, id, "py", "import os, random; random.seed(1); heap = [random.randbytes(1<<20) for _ in range(24)]; x = 41; os.getpid()"))
	bashPid := strings.TrimSpace(sessRun(t, d, id, "main", "cd /tmp; export FOO=bar; echo $$"))
	// Files change before each checkpoint: each moves the sessions onto a new state,
	// while their executables stay mapped from the first (durable/extfiles.go).
	sessRun(t, d, id, "main", "echo 41 > /workspace/x")
	n1 := dbxCheckpoint(t, d, id, "x41").Node.ID
	sessRun(t, d, id, "py", "x = 42; heap[0] = random.randbytes(1<<20); heap[1] = random.randbytes(1<<20)")
	sessRun(t, d, id, "main", "echo 42 > /workspace/x")
	n2 := dbxCheckpoint(t, d, id, "x42").Node.ID
	sessRun(t, d, id, "py", "x = 43")
	im1 := durWaitImage(t, d, n1)
	im2 := durWaitImage(t, d, n2)
	t.Logf("image of %s: %d bytes stored, %d full; of %s (2 MB changed): %d stored, %d full, dump %d ms, lag %d ms",
		n1, im1.StoredBytes, im1.FullBytes, n2, im2.StoredBytes, im2.FullBytes, im2.DumpMS, im2.LagMS)
	if im2.StoredBytes*5 > im2.FullBytes {
		t.Errorf("the second image stored %d bytes of %d: not 5 times less", im2.StoredBytes, im2.FullBytes)
	}

	check := func(node string, x int, how string) {
		t.Helper()
		res := dbxRestore(t, d, id, node)
		if !res.FromImage || res.Processes != 2 {
			t.Fatalf("%s: restore to %s: from_image %v, %d processes %v\ndaemon log:\n%s", how, node, res.FromImage, res.Processes, res.ProcessErrors, dbxTail(d.Log(), 3000))
		}
		if got := sessRun(t, d, id, "py", "(x, os.getpid(), len(heap), sum(map(len, heap)))"); got != fmt.Sprintf("(%d, %s, 24, %d)\n", x, pyPid, 24<<20) {
			t.Fatalf("%s: python after the restore from the image: %q", how, got)
		}
		if got := sessRun(t, d, id, "main", "echo $(pwd) $FOO $$ $(cat /workspace/x)"); got != fmt.Sprintf("/tmp bar %s %d\n", bashPid, x) {
			t.Fatalf("%s: bash after the restore from the image: %q", how, got)
		}
		// In the commands' cgroup namespace (rooted at the sandbox's groups), not init's.
		if got, want := sessRun(t, d, id, "py", "print(open('/proc/self/cgroup').read(), end='')"), dbxSh(t, d, id, "cat /proc/self/cgroup"); got != want {
			t.Fatalf("%s: the restored python's cgroups %q, a command's %q", how, got, want)
		}
		sessRun(t, d, id, "py", "x = 99")
	}
	// Evicted by the client.
	if _, err := d.C.EvictNode(dbxCtx(t), n1); err != nil {
		t.Fatal(err)
	}
	check(n1, 41, "evicted")
	// The image's templates are the node's again: the next restore forks from them.
	if res := dbxRestore(t, d, id, n1); res.FromImage || res.Processes != 2 {
		t.Fatalf("second restore to %s: from_image %v, %d processes", n1, res.FromImage, res.Processes)
	}
	// Killed from inside the sandbox: every stopped process but the live ones' is a
	// template; n2's are killed (n1's were just forked from and are in use).
	tr, err := d.C.Tree(dbxCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	_ = tr
	if _, err := d.C.EvictNode(dbxCtx(t), n2); err != nil {
		t.Fatal(err)
	}
	check(n2, 42, "evicted, second node")
	// A process restored from an image has its memory from CRIU's fork, not from an exec
	// inside the sandbox (its mm belongs to the host's user namespace): its next
	// checkpoint's image, made from such a process, restores too (scripts/criu/0003).
	sessRun(t, d, id, "py", "x = 77")
	sessRun(t, d, id, "main", "echo 77 > /workspace/x")
	n3 := dbxCheckpoint(t, d, id, "x77").Node.ID
	durWaitImage(t, d, n3)
	if _, err := d.C.EvictNode(dbxCtx(t), n3); err != nil {
		t.Fatal(err)
	}
	check(n3, 77, "evicted, a checkpoint made after a restore from an image")
	in, err := d.C.Get(dbxCtx(t), id)
	if err != nil {
		t.Fatal(err)
	}
	if in.Stats.RestorePaths.Image != 3 {
		t.Errorf("restore_paths.image %d, want 3", in.Stats.RestorePaths.Image)
	}
}

// TestDurableImageCopyThatRanIsRefused: a node's image is dumped from a stopped copy of
// each template, which waits in a group stop (state/durable.go); a SIGCONT from inside
// the sandbox (kill -CONT -1) lets the copies that still wait run on. An image of a copy
// that ran is not the template's: it fails, and its node keeps its templates. Every image
// that completes restores the node's own state.
func TestDurableImageCopyThatRanIsRefused(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "durcont"
	dbxCreate(t, d, id)
	if _, err := d.C.StartSession(dbxCtx(t), id, state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	sessRun(t, d, id, "py", "import os, random; heap = [random.randbytes(1<<20) for _ in range(16)]; x = 0")
	var nodes []string
	for i := 1; i <= 4; i++ {
		sessRun(t, d, id, "py", fmt.Sprintf("x = %d", i))
		nodes = append(nodes, dbxCheckpoint(t, d, id, fmt.Sprintf("x%d", i)).Node.ID)
	}
	// Every process the sandbox may signal: the live ones, the templates (in a
	// ptrace-stop: SIGCONT does not end it) and the copies waiting for their dumps.
	dbxSh(t, d, id, "kill -CONT -1 2>/dev/null; true")
	failed := 0
	for i, n := range nodes {
		deadline := time.Now().Add(2 * time.Minute)
		var im *apitypes.ImageInfo
		for {
			nd, err := d.C.Node(dbxCtx(t), n)
			if err != nil {
				t.Fatal(err)
			}
			im = nd.ProcessImage
			if im != nil && im.State != "pending" {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("node %s: image still pending", n)
			}
			time.Sleep(50 * time.Millisecond)
		}
		testutil.Require(t, !strings.Contains(im.Error, "CRIU is unusable"), "no durable images here: %s", im.Error)
		if im.State == "failed" {
			failed++
			t.Logf("node %d (%s): image failed: %s", i+1, n, im.Error)
			continue
		}
		if _, err := d.C.EvictNode(dbxCtx(t), n); err != nil {
			t.Fatal(err)
		}
		res := dbxRestore(t, d, id, n)
		if !res.FromImage {
			t.Fatalf("restore to evicted %s did not come from its image", n)
		}
		if got := sessRun(t, d, id, "py", "x"); got != fmt.Sprintf("%d\n", i+1) {
			t.Fatalf("node %d restored from its image after the SIGCONT: x = %q", i+1, got)
		}
	}
	t.Logf("%d of %d images failed after the SIGCONT (the copies that still waited ran)", failed, len(nodes))
	// A node whose image failed still restores its processes from its templates.
	for i, n := range nodes {
		nd, _ := d.C.Node(dbxCtx(t), n)
		if nd.ProcessImage != nil && nd.ProcessImage.State == "failed" {
			res := dbxRestore(t, d, id, n)
			if res.FromImage || res.Processes != 1 {
				t.Fatalf("restore to %s (image failed): from_image %v, %d processes", n, res.FromImage, res.Processes)
			}
			if got := sessRun(t, d, id, "py", "x"); got != fmt.Sprintf("%d\n", i+1) {
				t.Fatalf("node %d from its templates: x = %q", i+1, got)
			}
		}
	}
}

// TestDurableImageAfterKillAll: after `kill -9 -1` inside each session (every process
// of its Landlock domain: the session and its templates, which are forks of it; an
// exec's `kill -9 -1` reaches only its own command's processes), a restore falls back
// to the node's image. The python holds a file open for
// writing: its image is restored onto the node's read-only view as a template, whose
// files are read-only there as a parked template's are (its live process reopens them
// as they were), and works; it failed with EROFS ("Can't open file workspace/w on
// restore: Read-only file system"). The killed templates leave no zombie behind, after
// the kill and after the restore.
func TestDurableImageAfterKillAll(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "durkill"
	dbxCreate(t, d, id)
	if _, err := d.C.StartSession(dbxCtx(t), id, state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	sessRun(t, d, id, "py", "f = open('/workspace/w', 'w'); f.write('a'); f.flush(); x = 41")
	sessRun(t, d, id, "main", "cd /tmp")
	n := dbxCheckpoint(t, d, id, "x41").Node.ID
	durWaitImage(t, d, n)
	sessRun(t, d, id, "py", "x = 42")
	n2 := dbxCheckpoint(t, d, id, "x42").Node.ID
	durWaitImage(t, d, n2)
	sessRun(t, d, id, "py", "x = 43")
	// Each session's call dies with its session and templates: its answer is an error.
	for sess, code := range map[string]string{"py": "import os; os.kill(-1, 9)", "main": "kill -9 -1"} {
		d.C.Run(dbxCtx(t), id, sess, code, 10*time.Second)
	}
	durNoZombies(t, d, id)
	res, err := d.C.Restore(dbxCtx(t), id, n)
	if err != nil {
		durNoZombies(t, d, id)
		t.Fatalf("restore after kill -9 -1: %v\ndaemon log:\n%s", err, dbxTail(d.Log(), 3000))
	}
	if !res.FromImage {
		t.Fatalf("restore after kill -9 -1: not from the image: %+v", res)
	}
	if got := sessRun(t, d, id, "py", "f.write('b'); f.flush(); x"); got != "41\n" {
		t.Fatalf("python restored from its image: %q", got)
	}
	if got := dbxSh(t, d, id, "cat /workspace/w"); got != "ab" {
		t.Fatalf("/workspace/w after a write through the restored python's fd: %q, want \"ab\"", got)
	}
	durNoZombies(t, d, id)
}

// durNoZombies fails if a process of the sandbox stays a zombie (2 s at most). The
// sandbox's PID namespace is searched, not its cgroup: a zombie has left its cgroup.
func durNoZombies(t *testing.T, d *testutil.Daemon, id string) {
	t.Helper()
	in, err := d.C.Get(dbxCtx(t), id)
	if err != nil {
		t.Fatal(err)
	}
	ns, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/pid_for_children", in.InitPid))
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(2 * time.Second)
	for {
		var zombies []string
		ents, _ := os.ReadDir("/proc")
		for _, e := range ents {
			if e.Name()[0] < '0' || e.Name()[0] > '9' {
				continue
			}
			if l, _ := os.Readlink("/proc/" + e.Name() + "/ns/pid"); l != ns {
				continue
			}
			if st, _ := os.ReadFile("/proc/" + e.Name() + "/stat"); strings.Contains(string(st), ") Z ") {
				zombies = append(zombies, string(st))
			}
		}
		if len(zombies) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("zombies left in the sandbox: %v", zombies)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestDurableImageAfterSandboxesEnd: when a sandbox's processes are all gone, as after a
// machine restart (here a daemon that stops its sandboxes, DELTABOX_STOP_SANDBOXES=1: init,
// sessions and templates end), the next daemon starts the sandbox afresh with its files,
// and a node with a complete image still restores its processes from it: the python
// session's objects and PID, the bash session's cwd and variables. The sandbox started
// afresh allocates PIDs above those its nodes need.
func TestDurableImageAfterSandboxesEnd(t *testing.T) {
	d := testutil.StartDaemonEnv(t, testutil.NewStore(t), "DELTABOX_STOP_SANDBOXES=1")
	const id = "durend"
	dbxCreate(t, d, id)
	if _, err := d.C.StartSession(dbxCtx(t), id, state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	pyPid := strings.TrimSpace(sessRun(t, d, id, "py", "import os; heap = bytearray(8 << 20); x = 41; os.getpid()"))
	bashPid := strings.TrimSpace(sessRun(t, d, id, "main", "cd /tmp; export FOO=bar; echo 41 > /workspace/x; echo $$"))
	n1 := dbxCheckpoint(t, d, id, "x41").Node.ID
	durWaitImage(t, d, n1)
	if err := d.C.Sync(dbxCtx(t)); err != nil {
		t.Fatal(err)
	}
	initPid := func() int {
		in, err := d.C.Get(dbxCtx(t), id)
		if err != nil {
			t.Fatal(err)
		}
		return in.InitPid
	}
	initBefore := initPid()
	d.Stop()
	d = testutil.StartDaemonOn(t, d.Root)
	if got := initPid(); got == initBefore {
		t.Fatalf("the sandbox's init %d survived a daemon that stops its sandboxes", got)
	}
	// The sandbox started afresh counts its PIDs from above those its nodes' processes
	// need (sandbox.Start's pidFloor): else a thread of its init took one of them now
	// and then, and the restore failed with EEXIST.
	pyN, _ := strconv.Atoi(pyPid)
	bashN, _ := strconv.Atoi(bashPid)
	if p, _ := strconv.Atoi(strings.TrimSpace(dbxSh(t, d, id, "echo $$"))); p <= max(pyN, bashN) {
		t.Fatalf("a command in the sandbox started afresh has PID %d, not above its node's sessions' %d and %d", p, pyN, bashN)
	}
	res := dbxRestore(t, d, id, n1)
	if !res.FromImage || res.Processes != 2 {
		t.Fatalf("restore to %s after the sandbox ended: from_image %v, %d processes %v\ndaemon log:\n%s", n1, res.FromImage, res.Processes, res.ProcessErrors, dbxTail(d.Log(), 3000))
	}
	t.Logf("restore after the sandbox ended (init %d, then %d): from_image %v, %d processes, %.1f ms", initBefore, initPid(), res.FromImage, res.Processes, res.DurationMS)
	if got := sessRun(t, d, id, "py", "(x, os.getpid(), len(heap))"); got != fmt.Sprintf("(41, %s, %d)\n", pyPid, 8<<20) {
		t.Fatalf("python after the restore from the image: %q", got)
	}
	if got := sessRun(t, d, id, "main", "echo $(pwd) $FOO $$ $(cat /workspace/x)"); got != fmt.Sprintf("/tmp bar %s 41\n", bashPid) {
		t.Fatalf("bash after the restore from the image: %q", got)
	}
}

// TestDurableImagePagesCollected: the pages only a removed node's image named are freed
// from the page store's pack (state/durable.go: collectPages), those a kept node's image
// names stay, and the kept node still restores its processes from its image.
func TestDurableImagePagesCollected(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "gc"
	dbxCreate(t, d, id)
	if _, err := d.C.StartSession(dbxCtx(t), id, state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	sessRun(t, d, id, "py", "import os; a = os.urandom(8 << 20); x = 1")
	keep := dbxCheckpoint(t, d, id, "keep").Node.ID
	sessRun(t, d, id, "py", "b = os.urandom(24 << 20); x = 2") // 24 MiB only the next node has
	sessRun(t, d, id, "main", "echo 2 > /workspace/x")
	gone := dbxCheckpoint(t, d, id, "gone").Node.ID
	durWaitImage(t, d, keep)
	durWaitImage(t, d, gone)
	pack := filepath.Join(d.Root, "durable", "pages", "pages.pack")
	blocks := func() int64 {
		var st unix.Stat_t
		if err := unix.Stat(pack, &st); err != nil {
			t.Fatal(err)
		}
		return st.Blocks * 512
	}
	before := blocks()
	dbxRestore(t, d, id, keep) // off the node to remove
	if _, err := d.C.RemoveNode(dbxCtx(t), gone); err != nil {
		t.Fatal(err)
	}
	var after int64
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if after = blocks(); before-after >= 24<<20 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the pack holds %d MiB, %d MiB before the node with 24 MiB of its own went\ndaemon log:\n%s", after>>20, before>>20, dbxTail(d.Log(), 3000))
		}
	}
	t.Logf("pack: %d MiB, %d MiB once the node went", before>>20, after>>20)
	if after < 8<<20 {
		t.Fatalf("the pack holds %d MiB: the kept node's 8 MiB went too", after>>20)
	}
	// The kept node's image still restores (its template evicted first).
	if _, err := d.C.EvictNode(dbxCtx(t), keep); err != nil {
		t.Fatal(err)
	}
	res := dbxRestore(t, d, id, keep)
	if !res.FromImage {
		t.Fatalf("restore to %s after the collection: %+v, want from its image", keep, res)
	}
	if got := sessRun(t, d, id, "py", "print(x, len(a), 'b' in globals())"); got != fmt.Sprintf("1 %d False\n", 8<<20) {
		t.Fatalf("python restored from the kept image: %q", got)
	}
}

// TestDurableImageLazyRestore: with lazy restores from images (DELTABOX_LAZY_RESTORE=1),
// a node whose templates were evicted restores its python session of 200 MiB of random
// bytes lazily (lazy_image): the first command answers with every byte as it was (its
// hash) while the image's server copies the rest; a checkpoint right after waits for the
// server and then takes exact processes (its own restore, from its templates, hashes the
// same), and the node's image restored lazily a second time, evicted again, is still
// exact; the bash session keeps its state throughout.
func TestDurableImageLazyRestore(t *testing.T) {
	d := testutil.StartDaemonEnv(t, testutil.NewStore(t), "DELTABOX_LAZY_RESTORE=1")
	const id = "lazy"
	dbxCreate(t, d, id)
	if _, err := d.C.StartSession(dbxCtx(t), id, state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	h := strings.TrimSpace(sessRun(t, d, id, "py", "import os, hashlib; x = bytearray(os.urandom(200 << 20)); print(hashlib.sha256(x).hexdigest(), os.getpid())"))
	bashPid := strings.TrimSpace(sessRun(t, d, id, "main", "cd /tmp; export FOO=bar; echo $$"))
	n1 := dbxCheckpoint(t, d, id, "big").Node.ID
	sessRun(t, d, id, "py", "x[0] ^= 1")
	durWaitImage(t, d, n1)
	check := func(what string) {
		t.Helper()
		if got := strings.TrimSpace(sessRun(t, d, id, "py", "print(hashlib.sha256(x).hexdigest(), os.getpid())")); got != h {
			t.Fatalf("%s: python answered %q, want %q (its bytes' hash and PID at the checkpoint)", what, got, h)
		}
		if got := sessRun(t, d, id, "main", "echo $(pwd) $FOO $$"); got != "/tmp bar "+bashPid+"\n" {
			t.Fatalf("%s: bash answered %q", what, got)
		}
	}
	for round := 1; round <= 2; round++ {
		if _, err := d.C.EvictNode(dbxCtx(t), n1); err != nil {
			t.Fatal(err)
		}
		t0 := time.Now()
		res := dbxRestore(t, d, id, n1)
		if !res.FromImage || !res.LazyImage || res.Processes != 2 {
			t.Fatalf("round %d: restore to %s: from_image %v, lazy_image %v, %d processes %v\ndaemon log:\n%s", round, n1, res.FromImage, res.LazyImage, res.Processes, res.ProcessErrors, dbxTail(d.Log(), 3000))
		}
		check(fmt.Sprintf("round %d, lazily restored", round))
		t.Logf("round %d: lazy restore %.1f ms, first python answer (a hash of 200 MiB) after %v", round, res.DurationMS, time.Since(t0))
		// At once: the checkpoint waits for the server, then forks exact templates.
		n2 := dbxCheckpoint(t, d, id, fmt.Sprintf("after-lazy-%d", round)).Node.ID
		sessRun(t, d, id, "py", "x[1] ^= 1")
		if res := dbxRestore(t, d, id, n2); res.FromImage || res.Processes != 2 {
			t.Fatalf("round %d: restore to %s: from_image %v, %d processes, want its templates", round, n2, res.FromImage, res.Processes)
		}
		check(fmt.Sprintf("round %d, the checkpoint after the lazy restore", round))
	}
}

// TestDurableImageLazyServerKilled: the lazy-pages server of a lazy restore is killed
// (SIGKILL from the host) while it still copies pages, so that the pages not yet in
// would read as zeros. The daemon ends what it served: the python session restarts
// afresh at its next call (session_restarted, none of its objects), no checkpoint takes
// the processes meanwhile (one right after is refused with 409 naming the lazy restore,
// or finds them already ended), and the node, its templates dropped, restores exactly
// from its image again.
func TestDurableImageLazyServerKilled(t *testing.T) {
	d := testutil.StartDaemonEnv(t, testutil.NewStore(t), "DELTABOX_LAZY_RESTORE=1")
	const id = "lazykill"
	dbxCreate(t, d, id)
	if _, err := d.C.StartSession(dbxCtx(t), id, state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	h := strings.TrimSpace(sessRun(t, d, id, "py", "import os, hashlib; x = bytearray(os.urandom(400 << 20)); print(hashlib.sha256(x).hexdigest())"))
	n1 := dbxCheckpoint(t, d, id, "big").Node.ID
	durWaitImage(t, d, n1)
	if _, err := d.C.EvictNode(dbxCtx(t), n1); err != nil {
		t.Fatal(err)
	}
	res := dbxRestore(t, d, id, n1)
	if !res.LazyImage {
		t.Fatalf("restore to %s: lazy_image false, want a lazy restore", n1)
	}
	// 400 MiB take the server about a second here: it is still at work.
	out, err := exec.Command("pkill", "-KILL", "-f", "criu lazy-pages --images-dir "+filepath.Join(d.Root, "durable")).CombinedOutput()
	if err != nil {
		t.Fatalf("no lazy-pages server to kill right after the restore (%v %s): it finished before", err, out)
	}
	if _, err := d.C.Checkpoint(dbxCtx(t), id, "after-kill"); err != nil && !strings.Contains(err.Error(), "lazy restore") {
		t.Fatalf("checkpoint after the server was killed: %v, want success (processes already ended) or a refusal naming the lazy restore", err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		r, err := d.C.Run(dbxCtx(t), id, "py", "print('x' in globals())", 30*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if r.SessionRestarted && r.Stdout == "False\n" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the python session served by the killed server still runs 30 s after: %+v", r)
		}
		time.Sleep(100 * time.Millisecond)
	}
	res = dbxRestore(t, d, id, n1)
	if !res.FromImage {
		t.Fatalf("restore to %s after its lazily restored templates were ended: from_image false, want its image again", n1)
	}
	if got := strings.TrimSpace(sessRun(t, d, id, "py", "print(hashlib.sha256(x).hexdigest())")); got != h {
		t.Fatalf("python restored from the image again hashes to %s, want %s", got, h)
	}
}
