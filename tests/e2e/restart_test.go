package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"deltabox/internal/api"
	"deltabox/internal/sbinit"
	"deltabox/internal/state"
	"deltabox/internal/testutil"
)

// Sandboxes outlive their daemon (internal/state/restart.go): these kill the daemon with
// SIGKILL, or stop it, and check what the next daemon on the store gives back.

// restartSetup makes sandbox id with a python session (x = 41) and a bash session (cd
// /tmp, FOO=bar), checkpoints it (the node's templates hold x = 41), sets x = 42, and
// returns the node and the sessions' PIDs.
func restartSetup(t *testing.T, d *testutil.Daemon, id string) (node, pyPid, bashPid string) {
	t.Helper()
	dbxCreate(t, d, id)
	if _, err := d.C.StartSession(dbxCtx(t), id, state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	pyPid = strings.TrimSpace(sessRun(t, d, id, "py", "import os; x = 41; os.getpid()"))
	bashPid = strings.TrimSpace(sessRun(t, d, id, "main", "cd /tmp; export FOO=bar; echo $$"))
	op := dbxCheckpoint(t, d, id, "x41")
	if op.Processes != 2 {
		t.Fatalf("checkpoint took %d processes, want 2: %v", op.Processes, op.ProcessErrors)
	}
	sessRun(t, d, id, "py", "x = 42")
	if err := d.C.Sync(dbxCtx(t)); err != nil {
		t.Fatal(err)
	}
	// The templates are recorded after they are parked, in the background.
	time.Sleep(300 * time.Millisecond)
	return op.Node.ID, pyPid, bashPid
}

// restartCheckSessions checks that the sessions answer with their state and PIDs, and
// that node still restores their processes (x back to 41), then sets x = 42 again.
func restartCheckSessions(t *testing.T, d *testutil.Daemon, id, node, pyPid, bashPid, when string) {
	t.Helper()
	r, err := d.C.Run(dbxCtx(t), id, "py", "(x, os.getpid())", 30*time.Second)
	if err != nil || r.SessionRestarted || r.Stdout != fmt.Sprintf("(42, %s)\n", pyPid) {
		t.Fatalf("%s: python session: %+v %v, want (42, %s) from the same process\ndaemon log:\n%s", when, r, err, pyPid, d.Log())
	}
	if got := sessRun(t, d, id, "main", "echo $(pwd) $FOO $$"); got != "/tmp bar "+bashPid+"\n" {
		t.Fatalf("%s: bash session: %q, want \"/tmp bar %s\"", when, got, bashPid)
	}
	res := dbxRestore(t, d, id, node)
	if res.Processes != 2 {
		t.Fatalf("%s: restore to %s brought back %d processes, want 2 (its templates taken back): %v\ndaemon log:\n%s", when, node, res.Processes, res.ProcessErrors, d.Log())
	}
	if got := sessRun(t, d, id, "py", "(x, os.getpid())"); got != fmt.Sprintf("(41, %s)\n", pyPid) {
		t.Fatalf("%s: after the restore: python %q, want (41, %s)", when, got, pyPid)
	}
	sessRun(t, d, id, "py", "x = 42")
	if err := d.C.Sync(dbxCtx(t)); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond) // the node's records are taken again after a restore
}

// TestRestartKeepsSessionsAndTemplates: after a SIGKILL of the daemon, then another after
// a restore from a template the first restart took back, then a graceful stop, the
// sessions answer with their state from the same processes, and the node restores its
// processes each time.
func TestRestartKeepsSessionsAndTemplates(t *testing.T) {
	d := testutil.StartDaemon(t)
	node, pyPid, bashPid := restartSetup(t, d, "rs")
	d.Kill()
	d = testutil.StartDaemonOn(t, d.Root)
	restartCheckSessions(t, d, "rs", node, pyPid, bashPid, "after a kill -9")
	d.Kill()
	d = testutil.StartDaemonOn(t, d.Root)
	restartCheckSessions(t, d, "rs", node, pyPid, bashPid, "after a second kill -9")
	d.Stop()
	d = testutil.StartDaemonOn(t, d.Root)
	restartCheckSessions(t, d, "rs", node, pyPid, bashPid, "after a stop")
	// Templates: one per session at the node, nothing else stopped.
	if st := fpStoppedPids(t, d, "rs"); len(st) != 2 {
		t.Errorf("%d stopped processes after three restarts, want the node's 2 templates: %v", len(st), st)
	}
}

// TestRestartAfterCutAtEveryStep: the daemon dies (SIGKILL, DELTABOX_CRASH_AT) before
// each step of a checkpoint and of a restore, and after the last (a checkpoint's steps
// 2-8 after its early answer); the next daemon gives
// back a sandbox whose files and processes agree (files and processes are one atomic
// pair: x in the python session equals the file's content, unless the session was
// started afresh), whose tree holds every node recorded before, and that checkpoints
// and restores with its processes again; nothing is left behind once it is removed.
func TestRestartAfterCutAtEveryStep(t *testing.T) {
	cases := []string{}
	for k := 1; k <= 9; k++ {
		cases = append(cases, fmt.Sprintf("checkpoint:%d", k))
	}
	for k := 1; k <= 8; k++ {
		cases = append(cases, fmt.Sprintf("restore:%d", k))
	}
	for _, at := range cases {
		t.Run(strings.ReplaceAll(at, ":", "-"), func(t *testing.T) {
			root := testutil.NewStore(t)
			d := testutil.StartDaemonEnv(t, root, "DELTABOX_CRASH_AT="+at)
			id := "cut"
			dbxCreate(t, d, id)
			if _, err := d.C.StartSession(dbxCtx(t), id, state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
				t.Fatal(err)
			}
			set := func(v int) {
				sessRun(t, d, id, "py", fmt.Sprintf("x = %d; open('/workspace/x', 'w').write('%d')", v, v))
			}
			set(1)
			var n1 string
			if strings.HasPrefix(at, "restore") {
				n1 = dbxCheckpoint(t, d, id, "x1").Node.ID
				set(2)
				// A node the client was told is durable (and its templates, recorded in
				// the background once parked) must survive the cut.
				if err := d.C.Sync(dbxCtx(t)); err != nil {
					t.Fatal(err)
				}
				time.Sleep(300 * time.Millisecond)
				if _, err := d.C.Restore(dbxCtx(t), id, n1); err == nil {
					t.Fatalf("the restore answered: the daemon did not die at %s", at)
				}
			} else if res, err := d.C.Checkpoint(dbxCtx(t), id, "x1"); at == "checkpoint:1" && err == nil {
				t.Fatalf("the checkpoint answered: the daemon did not die at %s", at)
			} else if at != "checkpoint:1" && err == nil && !res.Node.Pending {
				// Steps 2-8 run after the early answer (the session's process is seized):
				// the daemon dies after it, its node pending (or before the answer has
				// reached the client, which then sees the connection end).
				t.Fatalf("the checkpoint cut at %s answered %+v: want its early answer, the node pending", at, res)
			}
			d.Kill()
			d = testutil.StartDaemonOn(t, root)
			in, err := d.C.Get(dbxCtx(t), id)
			if err != nil || in.Status != "running" {
				t.Fatalf("after the restart: %+v %v\ndaemon log:\n%s", in, err, d.Log())
			}
			file := sessRunSh(t, d, id, "cat /workspace/x")
			how := "adopted"
			r, err := d.C.Run(dbxCtx(t), id, "py", "x", 30*time.Second)
			if err != nil {
				t.Fatalf("the python session after the restart: %v\ndaemon log:\n%s", err, d.Log())
			} else if r.SessionRestarted || r.ExitCode != 0 {
				how = "restarted"
			} else if strings.TrimSpace(r.Stdout) != file {
				t.Fatalf("files and processes disagree after a cut at %s: x = %q, the file %q\ndaemon log:\n%s", at, r.Stdout, file, d.Log())
			}
			t.Logf("cut at %s: sandbox on %q, file %s, python session %s", at, in.Head, file, how)
			tr, err := d.C.Tree(dbxCtx(t))
			if err != nil {
				t.Fatal(err)
			}
			if n1 != "" && dbxTreeNode(tr, n1) == nil {
				t.Fatalf("node %s, recorded before the cut, is gone", n1)
			}
			if in.Head != "" && dbxTreeNode(tr, in.Head) == nil {
				t.Fatalf("the sandbox stands on %s, which the tree lacks", in.Head)
			}
			// It works on: a checkpoint with its processes, a change, a restore.
			set(7)
			op := dbxCheckpoint(t, d, id, "x7")
			if op.Processes < 1 {
				t.Fatalf("checkpoint after the restart took no process: %v", op.ProcessErrors)
			}
			set(8)
			res := dbxRestore(t, d, id, op.Node.ID)
			if res.Processes < 1 {
				t.Fatalf("restore after the restart brought back no process: %v", res.ProcessErrors)
			}
			if got := sessRun(t, d, id, "py", "x"); got != "7\n" || sessRunSh(t, d, id, "cat /workspace/x") != "7" {
				t.Fatalf("after the restart, restore to %s: x %q", op.Node.ID, got)
			}
			// Nothing is left behind: the sandbox removed and its daemon stopped, no
			// process, cgroup or overlay of the store remains.
			if err := d.C.Remove(dbxCtx(t), id); err != nil {
				t.Fatal(err)
			}
			d.Stop()
			restartNoLeftovers(t, root, dbxCgroupRoot(root))
		})
	}
}

// sessRunSh runs a command by exec (not in a session) and returns its output, trimmed.
func sessRunSh(t *testing.T, d *testutil.Daemon, id, script string) string {
	t.Helper()
	return strings.TrimSpace(dbxSh(t, d, id, script))
}

// restartNoLeftovers checks that no process is in the store's sandbox cgroups and no
// overlay mount names the store.
func restartNoLeftovers(t *testing.T, root, cg string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		procs := 0
		filepath.WalkDir(cg, func(p string, e os.DirEntry, err error) error {
			if err == nil && e.IsDir() {
				procs += len(dbxReadPids(filepath.Join(p, "cgroup.procs")))
			}
			return nil
		})
		mounts := dbxOverlayMounts(root)
		if procs == 0 && len(mounts) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("left behind: %d processes in %s, overlay mounts %v", procs, cg, mounts)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestRestartAfterImageCut: the daemon dies (kill -9, DELTABOX_CRASH_AT=image:K) while it
// writes a node's durable image in the background: before the template's CRIU dump, before
// its pages' ingest, after it, and after the complete mark. The next daemon adopts the
// sandbox: the session answers from the same process with its state, the node restores
// its processes (from its template), its image is complete only if the mark was written
// (else the node has none: a half image is removed), no copy made for the dump is left
// running in the sandbox, the page store still works (a later node's image completes and
// restores after an eviction; so does the first node's where complete), and nothing is
// left once the sandbox is removed.
func TestRestartAfterImageCut(t *testing.T) {
	for k := 1; k <= 4; k++ {
		at := fmt.Sprintf("image:%d", k)
		t.Run(strings.ReplaceAll(at, ":", "-"), func(t *testing.T) {
			root := testutil.NewStore(t)
			d := testutil.StartDaemonEnv(t, root, "DELTABOX_CRASH_AT="+at)
			const id = "imgcut"
			dbxCreate(t, d, id)
			if _, err := d.C.StartSession(dbxCtx(t), id, state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
				t.Fatal(err)
			}
			pid := strings.TrimSpace(sessRun(t, d, id, "py", "import os; heap = bytearray(os.urandom(8 << 20)); x = 1; print(os.getpid())"))
			n1 := dbxCheckpoint(t, d, id, "x1").Node.ID
			if err := d.C.Sync(dbxCtx(t)); err != nil {
				t.Fatal(err)
			}
			// The image is written in the background: the daemon dies there.
			deadline := time.Now().Add(90 * time.Second)
			for d.C.Health(dbxCtx(t)) == nil {
				if time.Now().After(deadline) {
					t.Fatalf("the daemon did not die at %s within 90 s\ndaemon log:\n%s", at, dbxTail(d.Log(), 3000))
				}
				time.Sleep(50 * time.Millisecond)
			}
			d.Kill()
			d = testutil.StartDaemonOn(t, root)
			r, err := d.C.Run(dbxCtx(t), id, "py", "print(x, os.getpid())", 30*time.Second)
			if err != nil || r.SessionRestarted || r.Stdout != "1 "+pid+"\n" {
				t.Fatalf("the python session after a cut at %s: %v %+v, want x=1 from pid %s\ndaemon log:\n%s", at, err, r, pid, dbxTail(d.Log(), 3000))
			}
			n, err := d.C.Node(dbxCtx(t), n1)
			if err != nil {
				t.Fatal(err)
			}
			complete := n.ProcessImage != nil && n.ProcessImage.State == "complete"
			if complete != (k == 4) {
				t.Fatalf("cut at %s: node %s's image %+v, complete %v, want %v", at, n1, n.ProcessImage, complete, k == 4)
			}
			tpl := 0
			if n.Templates != nil {
				tpl = n.Templates.Processes
			}
			if got := sessRunSh(t, d, id, "grep -l python3 /proc/[0-9]*/comm 2>/dev/null | wc -l"); got != strconv.Itoa(1+tpl) {
				t.Fatalf("cut at %s: %s python3 processes in the sandbox, want the session's and node %s's %d template(s): a copy for the image was left", at, got, n1, tpl)
			}
			res := dbxRestore(t, d, id, n1)
			if res.Processes != 1 || strings.TrimSpace(sessRun(t, d, id, "py", "print(x, os.getpid())")) != "1 "+pid {
				t.Fatalf("cut at %s: restore to %s: %d processes %v", at, n1, res.Processes, res.ProcessErrors)
			}
			sessRun(t, d, id, "py", "x = 2")
			n2 := dbxCheckpoint(t, d, id, "x2").Node.ID
			durWaitImage(t, d, n2)
			evictRestore := func(node, want string) {
				t.Helper()
				if _, err := d.C.EvictNode(dbxCtx(t), node); err != nil {
					t.Fatal(err)
				}
				res := dbxRestore(t, d, id, node)
				if !res.FromImage || res.Processes != 1 {
					t.Fatalf("cut at %s: restore of evicted %s: from_image %v, %d processes %v", at, node, res.FromImage, res.Processes, res.ProcessErrors)
				}
				if got := strings.TrimSpace(sessRun(t, d, id, "py", "print(x, os.getpid(), len(heap))")); got != want+" "+pid+" "+strconv.Itoa(8<<20) {
					t.Fatalf("cut at %s: %s from its image: %q", at, node, got)
				}
			}
			evictRestore(n2, "2")
			if complete {
				evictRestore(n1, "1")
			}
			if err := d.C.Remove(dbxCtx(t), id); err != nil {
				t.Fatal(err)
			}
			d.Stop()
			restartNoLeftovers(t, root, dbxCgroupRoot(root))
		})
	}
}

// TestRestartRefusesOlderInit: a sandbox whose recorded init was started by a daemon
// below this one's feature level (its index record rewritten as an older daemon wrote
// it: no level) is not adopted across the restart: its init spawns commands with the old
// daemon's code, without a Landlock domain per command, the disk quota's limits or a
// user namespace owned by its uid base. It restarts afresh with a new init, whose
// commands cannot signal each other (kill -0 answers EPERM).
func TestRestartRefusesOlderInit(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "oldinit"
	dbxCreate(t, d, id)
	dbxSh(t, d, id, "echo kept > /workspace/f")
	before, err := d.C.Get(dbxCtx(t), id)
	if err != nil || before.Init == nil || before.Init.Level != sbinit.FeatureLevel {
		t.Fatalf("before: %+v %v, want its init recorded at level %d", before, err, sbinit.FeatureLevel)
	}
	d.Stop() // the sandbox keeps running for the next daemon
	db, err := bolt.Open(filepath.Join(d.Root, "index.db"), 0o600, &bolt.Options{Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if err := db.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket([]byte("sandboxes"))
		var rec map[string]any
		if err := json.Unmarshal(b.Get([]byte(id)), &rec); err != nil {
			return fmt.Errorf("record of %s: %w", id, err)
		}
		init, ok := rec["init"].(map[string]any)
		if !ok {
			return fmt.Errorf("record of %s names no init: %v", id, rec)
		}
		delete(init, "level")
		v, err := json.Marshal(rec)
		if err != nil {
			return err
		}
		return b.Put([]byte(id), v)
	}); err != nil {
		t.Fatal(err)
	}
	db.Close()
	d = testutil.StartDaemonOn(t, d.Root)
	in, err := d.C.Get(dbxCtx(t), id)
	if err != nil || in.Status != "running" || in.Init == nil {
		t.Fatalf("after the restart: %+v %v\ndaemon log:\n%s", in, err, d.Log())
	}
	if in.Init.Pid == before.Init.Pid && in.Init.Start == before.Init.Start {
		t.Fatalf("the init of an older daemon was adopted (pid %d): want the sandbox restarted afresh\ndaemon log:\n%s", in.Init.Pid, d.Log())
	}
	if in.Init.Level != sbinit.FeatureLevel {
		t.Errorf("the new init is recorded at level %d, want %d", in.Init.Level, sbinit.FeatureLevel)
	}
	if !strings.Contains(d.Log(), "init predates Landlock domains") {
		t.Errorf("the daemon log does not say why the sandbox restarted:\n%s", d.Log())
	}
	if got := dbxSh(t, d, id, "cat /workspace/f"); got != "kept\n" {
		t.Errorf("its files after the restart: %q, want kept", got)
	}
	// The wall: a later command cannot signal what an earlier one left running.
	pid := strings.TrimSpace(dbxSh(t, d, id, "nohup sleep 1000 </dev/null >/dev/null 2>&1 & echo $!"))
	r := dbxExec(t, d, id, api.ExecRequest{Argv: []string{"bash", "-c", "kill -0 " + pid}})
	if r.ExitCode == 0 || !strings.Contains(r.Stderr, "Operation not permitted") {
		t.Fatalf("kill -0 %s from a later command after the restart: %+v, want EPERM", pid, r)
	}
}
