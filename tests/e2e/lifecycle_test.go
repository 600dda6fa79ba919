package e2e

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"deltabox/internal/api"
	"deltabox/internal/cgroup"
	"deltabox/internal/errdefs"
	"deltabox/internal/sandbox"
	"deltabox/internal/state"
	"deltabox/internal/store"
	"deltabox/internal/testutil"
)

// ---- errors ----

// TestLifecycleAPIErrors: every refusal has the right status, the documented body
// shape, and a message that says what to do.
func TestLifecycleAPIErrors(t *testing.T) {
	d := testutil.StartDaemon(t)
	id := dbxCreate(t, d, "errs").ID
	n0 := dbxCheckpoint(t, d, id, "n0").Node.ID
	ctx := dbxCtx(t)

	t.Run("NotFoundViaClient", func(t *testing.T) {
		check := func(what string, err error, mention ...string) {
			t.Helper()
			if !errors.Is(err, errdefs.ErrNotFound) {
				t.Errorf("%s: err %v, want errdefs.ErrNotFound (404)", what, err)
				return
			}
			for _, m := range mention {
				if !strings.Contains(err.Error(), m) {
					t.Errorf("%s: message %q does not mention %q", what, err, m)
				}
			}
		}
		_, err := d.C.Get(ctx, "nosuch")
		check("get unknown sandbox", err, "nosuch", "deltabox ls")
		_, err = d.C.Exec(ctx, "nosuch", api.ExecRequest{Argv: []string{"true"}})
		check("exec in unknown sandbox", err, "nosuch")
		_, err = d.C.Checkpoint(ctx, "nosuch", "")
		check("checkpoint unknown sandbox", err, "nosuch")
		_, err = d.C.Restore(ctx, "nosuch", n0)
		check("restore unknown sandbox", err, "nosuch")
		check("rm unknown sandbox", d.C.Remove(ctx, "nosuch"), "nosuch")
		_, err = d.C.Node(ctx, "nnosuch")
		check("get unknown node", err, "nnosuch", "deltabox tree")
		_, err = d.C.RemoveNode(ctx, "nnosuch")
		check("remove unknown node", err, "nnosuch")
		_, err = d.C.Restore(ctx, id, "nnosuch")
		check("restore to unknown node", err, "nnosuch", "deltabox tree")
		_, err = d.C.Create(ctx, state.CreateOptions{Image: "no-such-image"})
		check("create on unknown image", err, "no-such-image", "image")
	})

	t.Run("NotFoundBody", func(t *testing.T) {
		for _, c := range []struct{ method, path, mention string }{
			{"GET", "/sandboxes/nosuch", "nosuch"},
			{"POST", "/sandboxes/nosuch/exec", "nosuch"},
			{"GET", "/nodes/nnosuch", "nnosuch"},
			{"DELETE", "/nodes/nnosuch", "nnosuch"},
			{"GET", "/no/such/route", "/no/such/route"},
		} {
			body := ""
			if c.method == "POST" {
				body = `{"argv":["true"]}`
			}
			status, b := dbxRaw(t, d, c.method, c.path, body)
			if status != 404 {
				t.Errorf("%s %s: status %d, want 404: %s", c.method, c.path, status, b)
				continue
			}
			code, msg := dbxErrorBody(t, b)
			if code != "not_found" || !strings.Contains(msg, c.mention) {
				t.Errorf("%s %s: code %q message %q, want not_found and a message naming %q", c.method, c.path, code, msg, c.mention)
			}
		}
	})

	t.Run("BadRequest", func(t *testing.T) {
		exec := "/sandboxes/" + id + "/exec"
		for _, c := range []struct{ method, path, body, mention string }{
			{"POST", exec, `{`, "JSON"},
			{"POST", exec, `{"argv":"true"}`, "JSON"},
			{"POST", exec, `{"argv":["true"],"bogus":1}`, "bogus"},
			{"POST", exec, `{}`, "command"},
			{"POST", exec, `{"argv":[]}`, "command"},
			{"POST", exec, `{"argv":["true"],"timeout_ms":-2}`, "timeout_ms"}, // -1 is "no timeout" (docs/API.md)
			{"POST", "/sandboxes", `{"idd":"x"}`, "idd"},
			{"POST", "/sandboxes", `{"id":"Bad Id!"}`, "Bad Id!"},
			{"POST", "/sandboxes/" + id + "/restore", `{}`, "node"},
			{"POST", "/sandboxes/" + id + "/restore", `{"node":""}`, "node"},
			{"POST", "/sandboxes/" + id + "/checkpoint", `{"label":1}`, "JSON"},
		} {
			status, b := dbxRaw(t, d, c.method, c.path, c.body)
			if status != 400 {
				t.Errorf("%s %s %s: status %d, want 400: %s", c.method, c.path, c.body, status, b)
				continue
			}
			code, msg := dbxErrorBody(t, b)
			if code != "invalid" || !strings.Contains(msg, c.mention) {
				t.Errorf("%s %s %s: code %q message %q, want invalid and a message mentioning %q", c.method, c.path, c.body, code, msg, c.mention)
			}
		}
		if _, err := d.C.Restore(ctx, id, ""); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("restore with empty node via the client: err %v, want 400", err)
		}
		// None of these changed anything.
		if in, err := d.C.Get(ctx, id); err != nil || in.Head != n0 || in.Stats.Execs != 0 {
			t.Errorf("after refused requests: %+v %v, want head %s and no exec counted", in, err, n0)
		}
	})

	t.Run("Conflict", func(t *testing.T) {
		_, err := d.C.Create(ctx, state.CreateOptions{ID: id})
		if !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "already exists") {
			t.Errorf("create existing id %s: err %v, want 409 saying it already exists", id, err)
		}
		_, err = d.C.Create(ctx, state.CreateOptions{ID: n0})
		if !errors.Is(err, errdefs.ErrConflict) {
			t.Errorf("create with a node's id %s: err %v, want 409", n0, err)
		}
		status, b := dbxRaw(t, d, "POST", "/sandboxes", fmt.Sprintf(`{"id":%q}`, id))
		if code, _ := dbxErrorBody(t, b); status != 409 || code != "conflict" {
			t.Errorf("raw create existing id: %d %s", status, b)
		}

		dbxSh(t, d, id, "echo keep > /workspace/keep")
		done := make(chan *sandbox.ExecResult, 1)
		go func() {
			r, err := d.C.Exec(ctx, id, api.ExecRequest{Argv: []string{"bash", "-c", "sleep 1.5; cat /workspace/keep"}})
			if err != nil {
				t.Errorf("long exec: %v", err)
			}
			done <- r
		}()
		dbxWaitProcs(t, d, id, 2)
		wait := regexp.MustCompile(`(?i)\b(wait|finish)`)
		_, err = d.C.Checkpoint(ctx, id, "during exec")
		if !errors.Is(err, errdefs.ErrConflict) || !wait.MatchString(err.Error()) {
			t.Errorf("checkpoint while an exec runs: err %v, want 409 telling to wait for it", err)
		}
		_, err = d.C.Restore(ctx, id, n0)
		if !errors.Is(err, errdefs.ErrConflict) || !wait.MatchString(err.Error()) {
			t.Errorf("restore while an exec runs: err %v, want 409 telling to wait for it", err)
		}
		select {
		case <-done:
			t.Fatalf("the long exec ended before the checks were done (the test is too slow to prove anything)")
		default:
		}
		status, b = dbxRaw(t, d, "POST", "/sandboxes/"+id+"/checkpoint", `{}`)
		if code, _ := dbxErrorBody(t, b); status != 409 || code != "conflict" {
			t.Errorf("raw checkpoint during exec: %d %s", status, b)
		}
		r := <-done
		if r == nil || r.ExitCode != 0 || r.Stdout != "keep\n" {
			t.Errorf("the exec that a refused checkpoint/restore ran beside: %+v, want it untouched", r)
		}
		// Once it is done, both work.
		dbxCheckpoint(t, d, id, "after exec")
		dbxRestore(t, d, id, n0)
	})
}

// ---- teardown leaks ----

type dbxCounts struct {
	Procs     int // processes in this store's sandbox cgroups
	Overlays  int // overlay mounts naming the store, host-wide
	Cgroups   int // sandbox cgroup directories
	Layers    int // <root>/layers/*
	Sandboxes int // <root>/sandboxes/*
	FDs       int // open fds of the daemon
	fdList    []string
	mounts    []string
}

func (c dbxCounts) same(o dbxCounts) bool {
	return c.Procs == o.Procs && c.Overlays == o.Overlays && c.Cgroups == o.Cgroups &&
		c.Layers == o.Layers && c.Sandboxes == o.Sandboxes && c.FDs == o.FDs
}

// dbxSettledCount counts once two counts 100ms apart agree.
func dbxSettledCount(t *testing.T, d *testutil.Daemon, cgRoot string) dbxCounts {
	t.Helper()
	prev := dbxCount(t, d, cgRoot)
	for i := 0; i < 30; i++ {
		time.Sleep(100 * time.Millisecond)
		c := dbxCount(t, d, cgRoot)
		if c.same(prev) {
			return c
		}
		prev = c
	}
	t.Fatalf("the daemon's resources do not settle while idle: last count %+v", prev)
	return prev
}

// dbxCgroupRoot is the cgroup directory the daemon on root uses for its sandboxes
// (one of /sys/fs/cgroup/unified/deltabox*).
func dbxCgroupRoot(root string) string {
	cgroup.SetRootFor(root, store.DefaultRoot) // only sets a variable of this test process
	return cgroup.Root
}

func dbxCount(t *testing.T, d *testutil.Daemon, cgRoot string) dbxCounts {
	t.Helper()
	var c dbxCounts
	filepath.WalkDir(cgRoot, func(p string, e fs.DirEntry, err error) error {
		if err != nil || !e.IsDir() {
			return nil
		}
		if p != cgRoot {
			c.Cgroups++
		}
		c.Procs += len(dbxReadPids(filepath.Join(p, "cgroup.procs")))
		return nil
	})
	c.mounts = dbxOverlayMounts(d.Root)
	c.Overlays = len(c.mounts)
	ents, _ := os.ReadDir(filepath.Join(d.Root, "layers"))
	c.Layers = len(ents)
	ents, _ = os.ReadDir(filepath.Join(d.Root, "sandboxes"))
	c.Sandboxes = len(ents)
	fdDir := fmt.Sprintf("/proc/%d/fd", d.Pid())
	ents, err := os.ReadDir(fdDir)
	if err != nil || d.Pid() == 0 {
		t.Fatalf("daemon fds: %v (pid %d)", err, d.Pid())
	}
	for _, e := range ents {
		l, _ := os.Readlink(filepath.Join(fdDir, e.Name()))
		if l == "anon_inode:[pidfd]" {
			l += " " + dbxPidfdTarget(d.Pid(), e.Name())
		}
		c.fdList = append(c.fdList, l)
	}
	c.FDs = len(c.fdList)
	return c
}

// dbxPidfdTarget names the process the daemon's pidfd fd refers to, "(pid N: COMM)",
// so that a leaked pidfd says whose; its fdinfo's Pid is -1 once that process is reaped.
func dbxPidfdTarget(daemon int, fd string) string {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/fdinfo/%s", daemon, fd))
	for _, ln := range strings.Split(string(b), "\n") {
		if pid, ok := strings.CutPrefix(ln, "Pid:"); ok {
			pid = strings.TrimSpace(pid)
			if pid == "-1" {
				return "(a reaped process)"
			}
			comm, _ := os.ReadFile("/proc/" + pid + "/comm")
			return fmt.Sprintf("(pid %s: %s)", pid, strings.TrimSpace(string(comm)))
		}
	}
	return "(pid unknown)"
}

// dbxOverlayMounts lists the overlay mounts, in every mount namespace that some thread
// is in, whose options name root (or its directory under the store's mount: with
// isolation on, layers are named through the sandbox's idmapped clone of the mount,
// /proc/self/fd/N/...); deduplicated by (namespace, mount id).
func dbxOverlayMounts(root string) []string {
	seen := map[string]string{}
	// Every thread: a daemon thread that entered a sandbox's namespace counts too.
	procs, _ := filepath.Glob("/proc/[0-9]*/task/[0-9]*")
	for _, p := range procs {
		ns, err := os.Readlink(p + "/ns/mnt")
		if err != nil {
			continue
		}
		f, err := os.Open(p + "/mountinfo")
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			_, after, ok := strings.Cut(line, " - ")
			if !ok || !strings.HasPrefix(after, "overlay ") ||
				!(strings.Contains(line, root) || strings.Contains(line, "/"+filepath.Base(root)+"/")) {
				continue
			}
			id, _, _ := strings.Cut(line, " ")
			seen[ns+"/"+id] = fmt.Sprintf("%s mount %s (seen in task %s): %.200s", ns, id, filepath.Base(p), line)
		}
		f.Close()
	}
	var out []string
	for _, v := range seen {
		out = append(out, v)
	}
	slices.Sort(out)
	return out
}

// dbxDiff lists what is in b but not in a (as multisets).
func dbxDiff(a, b []string) []string {
	n := map[string]int{}
	for _, x := range a {
		n[x]++
	}
	var out []string
	for _, x := range b {
		if n[x] > 0 {
			n[x]--
		} else {
			out = append(out, x)
		}
	}
	return out
}

// TestLifecycleTeardownLeaks: a sandbox's whole life, then rm and node removal, leave
// no process, mount, cgroup, directory or daemon fd behind.
func TestLifecycleTeardownLeaks(t *testing.T) {
	d := testutil.StartDaemon(t)
	cgRoot := dbxCgroupRoot(d.Root)
	// The daemon keeps a few empty upper layers ready (a pool it refills in the
	// background): count once that has settled.
	base := dbxSettledCount(t, d, cgRoot)

	id := dbxCreate(t, d, "leaky").ID
	initPid, _ := dbxSandboxPids(t, d, id)
	if dir := dbxCgroupDir(t, initPid); filepath.Dir(dir) != cgRoot {
		t.Fatalf("the sandbox's cgroup %s is not under %s, where this test counts", dir, cgRoot)
	}
	dbxSh(t, d, id, "echo a > /workspace/a; mkdir -p /workspace/d && echo x > /dev/shm/x")
	n1 := dbxCheckpoint(t, d, id, "one").Node
	dbxSh(t, d, id, "echo b > /workspace/b; rm /workspace/a")
	n2 := dbxCheckpoint(t, d, id, "two").Node
	dbxRestore(t, d, id, n1.ID)
	if got := dbxSh(t, d, id, "cat /workspace/a; echo c > /workspace/c"); got != "a\n" {
		t.Fatalf("after restore: %q", got)
	}
	// A process left running, holding the state's overlay: rm must end it, and it makes
	// the mount visible in /proc/*/mountinfo, proving that the mount count sees mounts.
	dbxSh(t, d, id, "setsid sleep 600 </dev/null >/dev/null 2>&1 &")

	mid := dbxCount(t, d, cgRoot)
	if mid.Procs < base.Procs+2 || mid.Overlays <= base.Overlays || mid.Cgroups <= base.Cgroups ||
		mid.Layers <= base.Layers || mid.Sandboxes <= base.Sandboxes || mid.FDs <= base.FDs {
		t.Fatalf("with a sandbox running, the counts did not grow (the counters are blind):\nbase %+v\nmid  %+v",
			base, mid)
	}

	if err := d.C.Remove(dbxCtx(t), id); err != nil {
		t.Fatalf("rm: %v", err)
	}
	removed, err := d.C.RemoveNode(dbxCtx(t), n1.ID)
	if err != nil || !slices.Contains(removed, n2.ID) {
		t.Fatalf("remove nodes from %s: %v %v (want %s removed with it)", n1.ID, removed, err, n2.ID)
	}
	if err := d.C.Sync(dbxCtx(t)); err != nil {
		t.Fatal(err)
	}
	if _, err := d.C.Get(dbxCtx(t), id); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("removed sandbox still answers: %v", err)
	}

	// The old states are torn down after the answers, in the background: give that
	// (and the layer pool's refill) a moment.
	var end dbxCounts
	deadline := time.Now().Add(3 * time.Second)
	for {
		end = dbxCount(t, d, cgRoot)
		if end.same(base) || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("counts (procs overlays cgroups layers sandboxes fds): base %d %d %d %d %d %d, with the sandbox %d %d %d %d %d %d, after teardown %d %d %d %d %d %d",
		base.Procs, base.Overlays, base.Cgroups, base.Layers, base.Sandboxes, base.FDs,
		mid.Procs, mid.Overlays, mid.Cgroups, mid.Layers, mid.Sandboxes, mid.FDs,
		end.Procs, end.Overlays, end.Cgroups, end.Layers, end.Sandboxes, end.FDs)
	check := func(what string, b, e int) {
		if b != e {
			t.Errorf("%s: %d before the sandbox, %d after its teardown", what, b, e)
		}
	}
	check("processes in the store's sandbox cgroups", base.Procs, end.Procs)
	check("overlay mounts naming the store", base.Overlays, end.Overlays)
	check("sandbox cgroup directories", base.Cgroups, end.Cgroups)
	check("layer directories", base.Layers, end.Layers)
	check("sandbox directories", base.Sandboxes, end.Sandboxes)
	check("daemon fds", base.FDs, end.FDs)
	if extra := dbxDiff(base.mounts, end.mounts); len(extra) > 0 {
		t.Errorf("leaked mounts:\n%s", strings.Join(extra, "\n"))
	}
	if extra := dbxDiff(base.fdList, end.fdList); len(extra) > 0 {
		t.Errorf("leaked daemon fds: %v", extra)
	}
	// The id can be reused at once.
	dbxCreate(t, d, id)
}

// ---- daemon restart ----

// dbxRestartCase prepares a sandbox with a checkpoint and uncommitted changes and a
// running process; it returns the node and the host pids that must not survive.
func dbxRestartCase(t *testing.T, d *testutil.Daemon, id string) (n1 string, pids []int) {
	t.Helper()
	dbxCreate(t, d, id)
	dbxSh(t, d, id, "echo committed > /workspace/committed; echo etc > /etc/committed")
	n1 = dbxCheckpoint(t, d, id, "n1").Node.ID
	dbxSh(t, d, id, "echo uncommitted > /workspace/uncommitted; echo tmp > /tmp/uncommitted; rm /etc/motd; echo more >> /workspace/committed")
	dbxSh(t, d, id, "setsid sleep 600 </dev/null >/dev/null 2>&1 &")
	_, pids = dbxSandboxPids(t, d, id)
	if len(pids) < 2 {
		t.Fatalf("the background process is not running: pids %v", pids)
	}
	return n1, pids
}

// dbxCheckAdopted checks a sandbox the new daemon adopted: the same init, every process
// alive, the files and the tree as before, and checkpoints and restores go on.
func dbxCheckAdopted(t *testing.T, d *testutil.Daemon, id, n1 string, oldPids []int) {
	t.Helper()
	in, err := d.C.Get(dbxCtx(t), id)
	if err != nil {
		t.Fatalf("after the restart: get %s: %v\ndaemon log:\n%s", id, err, d.Log())
	}
	if in.Status != "running" || in.Head != n1 || !slices.Contains(oldPids, in.InitPid) {
		t.Fatalf("after the restart: sandbox %+v, want running on %s with its init among %v\ndaemon log:\n%s", in, n1, oldPids, d.Log())
	}
	for _, p := range oldPids {
		if _, err := os.Stat(fmt.Sprintf("/proc/%d", p)); err != nil {
			t.Errorf("process %d of the sandbox did not survive the restart", p)
		}
	}
	want := "committed\nmore\netc\nuncommitted\ntmp\nno-motd\n"
	if got := dbxSh(t, d, id, dbxRestartFiles); got != want {
		t.Errorf("files after the restart:\n%s\nwant\n%s", got, want)
	}
	n2 := dbxCheckpoint(t, d, id, "after restart").Node
	if n2.Parent != n1 || !n2.Own {
		t.Errorf("checkpoint after the restart: parent %q own %v, want %s and a layer of its own", n2.Parent, n2.Own, n1)
	}
	dbxRestore(t, d, id, n1)
	if got := dbxSh(t, d, id, dbxRestartFiles); got != "committed\netc\nno-uncommitted\nmotd\n" {
		t.Errorf("restore to %s after the restart: files\n%s", n1, got)
	}
	dbxRestore(t, d, id, n2.ID)
	if got := dbxSh(t, d, id, dbxRestartFiles); got != want {
		t.Errorf("restore to %s after the restart: files\n%s\nwant\n%s", n2.ID, got, want)
	}
}

const dbxRestartFiles = `cat /workspace/committed /etc/committed; cat /workspace/uncommitted /tmp/uncommitted 2>/dev/null || echo no-uncommitted
[ -e /etc/motd ] && echo motd || echo no-motd`

// dbxCheckRestarted checks the sandbox after its daemon restarted: kept, adopted with its
// processes (oldPids alive, init the same); else started afresh, files only.
func dbxCheckRestarted(t *testing.T, d *testutil.Daemon, id, n1 string, oldPids []int, kept bool) {
	t.Helper()
	if kept {
		dbxCheckAdopted(t, d, id, n1, oldPids)
		return
	}
	in, err := d.C.Get(dbxCtx(t), id)
	if err != nil {
		t.Fatalf("after the restart: get %s: %v\ndaemon log:\n%s", id, err, d.Log())
	}
	if in.Status != "running" || in.InitPid == 0 || in.Head != n1 {
		t.Fatalf("after the restart: sandbox %+v, want running on %s\ndaemon log:\n%s", in, n1, d.Log())
	}
	for _, p := range oldPids {
		if p == in.InitPid {
			continue
		}
		if _, err := os.Stat(fmt.Sprintf("/proc/%d", p)); err == nil {
			cmd, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", p))
			if strings.Contains(string(cmd), "sleep") || strings.Contains(string(cmd), "deltabox-init") {
				t.Errorf("process %d (%q) of the sandbox before the restart is still alive", p, cmd)
			}
		}
	}
	// Files survive, processes do not.
	want := "committed\nmore\netc\nuncommitted\ntmp\nno-motd\n"
	res := dbxExec(t, d, id, api.ExecRequest{Argv: []string{"bash", "-c", dbxRestartFiles}})
	if res.Stdout != want {
		t.Errorf("files after the restart:\n%s(stderr %s)\nwant\n%s", res.Stdout, res.Stderr, want)
	}
	dbxWaitOnlyInit(t, d, id, 0)
	tr, err := d.C.Tree(dbxCtx(t))
	if err != nil || dbxTreeNode(tr, n1) == nil {
		t.Fatalf("tree after the restart has no %s: %+v %v", n1, tr, err)
	}
	// The upper that came back can be checkpointed, and the tree goes on from n1.
	n2 := dbxCheckpoint(t, d, id, "after restart").Node
	if n2.Parent != n1 || !n2.Own {
		t.Errorf("checkpoint after the restart: parent %q own %v, want %s and a layer of its own", n2.Parent, n2.Own, n1)
	}
	dbxRestore(t, d, id, n1)
	want2 := "committed\netc\nno-uncommitted\nmotd\n"
	if got := dbxSh(t, d, id, dbxRestartFiles); got != want2 {
		t.Errorf("restore to %s after the restart: files\n%s\nwant\n%s", n1, got, want2)
	}
	dbxRestore(t, d, id, n2.ID)
	if got := dbxSh(t, d, id, dbxRestartFiles); got != want {
		t.Errorf("restore to %s (checkpoint of the upper that survived the restart): files\n%s\nwant\n%s", n2.ID, got, want)
	}
}

// TestLifecycleDaemonRestart: after a graceful stop and start the sandboxes are still
// running, with their processes and files (committed and not).
func TestLifecycleDaemonRestart(t *testing.T) {
	d := testutil.StartDaemon(t)
	n1, pids := dbxRestartCase(t, d, "restart")
	d.Stop()
	d = testutil.StartDaemonOn(t, d.Root)
	dbxCheckRestarted(t, d, "restart", n1, pids, true)
}

// TestLifecycleDaemonStopSandboxes: a daemon told to stop its sandboxes
// (DELTABOX_STOP_SANDBOXES=1) ends their processes; the next one starts them afresh with
// their files (committed and not).
func TestLifecycleDaemonStopSandboxes(t *testing.T) {
	d := testutil.StartDaemonEnv(t, testutil.NewStore(t), "DELTABOX_STOP_SANDBOXES=1")
	n1, pids := dbxRestartCase(t, d, "stop")
	d.Stop()
	d = testutil.StartDaemonOn(t, d.Root)
	dbxCheckRestarted(t, d, "stop", n1, pids, false)
}

// TestLifecycleDaemonCrash: the same after SIGKILL of the daemon, and the startup sweep
// removes what the index does not name (and nothing the adopted sandbox uses).
func TestLifecycleDaemonCrash(t *testing.T) {
	d := testutil.StartDaemon(t)
	n1, pids := dbxRestartCase(t, d, "crash")
	if err := d.C.Sync(dbxCtx(t)); err != nil {
		t.Fatal(err)
	}
	d.Kill()
	orphans := []string{
		filepath.Join(d.Root, "layers", "99999"),
		filepath.Join(d.Root, "sandboxes", "ghost"),
	}
	for _, o := range orphans {
		if err := os.MkdirAll(o, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	os.MkdirAll(filepath.Join(d.Root, "layers", "99999", "diff", "junk"), 0o755)
	d = testutil.StartDaemonOn(t, d.Root)
	dbxCheckRestarted(t, d, "crash", n1, pids, true)
	for _, o := range orphans {
		if _, err := os.Stat(o); err == nil {
			t.Errorf("orphan %s survived the startup sweep", o)
		}
	}
	// The sweep kept what the index names: every node's layer, the sandbox's upper.
	tr, _ := d.C.Tree(dbxCtx(t))
	in, _ := d.C.Get(dbxCtx(t), "crash")
	layers := []uint64{in.Upper}
	for _, n := range tr.Nodes {
		if n.Own {
			layers = append(layers, n.Layer)
		}
	}
	for _, l := range layers {
		if _, err := os.Stat(filepath.Join(d.Root, "layers", fmt.Sprint(l))); err != nil {
			t.Errorf("layer %d, named by the index, is gone after the sweep: %v", l, err)
		}
	}
}

// ---- parallelism ----

// TestLifecycleParallelSandboxes: a long exec in one sandbox blocks neither the
// checkpoints and restores nor the execs of another.
func TestLifecycleParallelSandboxes(t *testing.T) {
	d := testutil.StartDaemon(t)
	a := dbxCreate(t, d, "par-a").ID
	b := dbxCreate(t, d, "par-b").ID
	nb0 := dbxCheckpoint(t, d, b, "b0").Node.ID

	var wg sync.WaitGroup
	done := make(chan struct{})
	var ares *sandbox.ExecResult
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer close(done)
		r, err := d.C.Exec(dbxCtx(t), a, api.ExecRequest{Argv: []string{"sleep", "2"}})
		if err != nil {
			t.Errorf("exec in a: %v", err)
		}
		ares = r
	}()
	dbxWaitProcs(t, d, a, 2)
	start := time.Now()
	dbxSh(t, d, b, "echo b1 > /workspace/b1")
	cp := dbxCheckpoint(t, d, b, "b1")
	dbxRestore(t, d, b, nb0)
	got := dbxSh(t, d, b, "ls /workspace")
	elapsed := time.Since(start)
	select {
	case <-done:
		t.Fatalf("checkpoint and restore of b only completed after a's sleep 2 ended (%v): they were blocked by it", elapsed)
	default:
	}
	t.Logf("exec+checkpoint+restore+exec in b: %v while a ran sleep 2", elapsed)
	if !cp.Node.Own || got != "" {
		t.Errorf("b's checkpoint %+v, ls after restore %q", cp.Node, got)
	}
	// a itself refuses, it is busy.
	if _, err := d.C.Checkpoint(dbxCtx(t), a, ""); !errors.Is(err, errdefs.ErrConflict) {
		t.Errorf("checkpoint of a during its exec: %v, want 409", err)
	}
	wg.Wait()
	if ares == nil || ares.ExitCode != 0 || ares.Duration < 2*time.Second {
		t.Errorf("a's exec: %+v", ares)
	}
	dbxCheckpoint(t, d, a, "a after")
}
