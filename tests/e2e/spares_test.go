package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/apitypes"
	"deltabox/internal/cgroup"
	"deltabox/internal/procfs"
	"deltabox/internal/testutil"
)

// spareSource makes a fast fork's family: sandbox id with a python session holding a
// 50 MB heap (and forkSourceLive's objects), a bash session and a background process,
// forked into 2 branches (id+"b-0", id+"b-1"). It returns the fork's node, the heap's
// hash and the PIDs.
func spareSource(t *testing.T, d *testutil.Daemon, id string) (node, heap, pyPid, bashPid, bgPid string) {
	t.Helper()
	pyPid, bashPid, bgPid = forkSourceLive(t, d, id)
	heap = sessRun(t, d, id, "py", "import hashlib\nbig = os.urandom(50 << 20)\nhashlib.sha256(big).hexdigest()")
	res, err := d.C.ForkSandbox(dbxCtx(t), id, apitypes.SandboxForkRequest{
		ForkRequest: apitypes.ForkRequest{Count: 2, CreateOptions: apitypes.CreateOptions{ID: id + "b"}},
	})
	if err != nil {
		t.Fatalf("fork: %v\ndaemon log:\n%s", err, dbxTail(d.Log(), 4000))
	}
	for _, b := range res.Branches {
		if b.Path != "fast" {
			t.Fatalf("branch %s: path %s (%s)", b.Sandbox.ID, b.Path, b.Reason)
		}
	}
	return res.Node, heap, pyPid, bashPid, bgPid
}

// spareDiverge changes sb's python, bash, files and processes from the node's, and
// returns the PID of the process it started.
func spareDiverge(t *testing.T, d *testutil.Daemon, sb string) string {
	t.Helper()
	sessRun(t, d, sb, "py", "d[1] = 'diverged'; big = b''; g2 = gen()")
	sessRun(t, d, sb, "main", "cd /; export FOO=baz")
	return strings.TrimSpace(dbxSh(t, d, sb, "echo diverged > /workspace/f; touch /workspace/new; nohup sleep 4242 </dev/null >/dev/null 2>&1 & echo $!"))
}

// spareCheck checks that sb is exactly at the node: forkCheckBranch's state, the
// heap, no file or process of the divergence.
func spareCheck(t *testing.T, d *testutil.Daemon, sb, heap, pyPid, bashPid, bgPid, divPid string) {
	t.Helper()
	forkCheckBranch(t, d, sb, pyPid, bashPid, bgPid, "source")
	if got := sessRun(t, d, sb, "py", "(hashlib.sha256(big).hexdigest(), d[1], 'g2' in globals())"); got != fmt.Sprintf("(%s, '1', False)\n", strings.TrimSpace(heap)) {
		t.Fatalf("%s: python after the restore: %q", sb, got)
	}
	if got := dbxSh(t, d, sb, "ls /workspace/new 2>&1 >/dev/null | wc -l; kill -0 "+divPid+" 2>/dev/null && echo alive || echo gone; cat /proc/[0-9]*/comm | grep -cx sleep"); got != "1\ngone\n1\n" {
		t.Fatalf("%s: the divergence's file and process (want neither; one sleep, the node's): %q", sb, got)
	}
}

// spareWait waits until sb holds a spare of node (made in the background).
func spareWait(t *testing.T, d *testutil.Daemon, node, sb string) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		n, err := d.C.Node(dbxCtx(t), node)
		if err != nil {
			t.Fatal(err)
		}
		if slices.Contains(n.Spares, sb) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("no spare of %s in %s after 60 s (spares %v); daemon log:\n%s", node, sb, n.Spares, dbxTail(d.Log(), 3000))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// spareProcs lists sb's spares' cgroups (named sb~spareN; not its runtime's, which may
// have been a spare's: the record's cgroup) and the host PIDs in them: each spare's
// branch init and its copies.
func spareProcs(t *testing.T, d *testutil.Daemon, root, sb string) (cgs []string, inits, copies []int) {
	t.Helper()
	in, err := d.C.Get(dbxCtx(t), sb)
	if err != nil {
		t.Fatal(err)
	}
	dirs, _ := filepath.Glob(filepath.Join(cgroup.RootFor(root), sb+"~spare*"))
	for _, dir := range dirs {
		if filepath.Base(dir) == in.Cgroup {
			continue
		}
		b, err := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
		if err != nil {
			continue
		}
		cgs = append(cgs, dir)
		for _, f := range strings.Fields(string(b)) {
			var p int
			fmt.Sscan(f, &p)
			ns, err := procfs.NSpid(p)
			if err != nil {
				continue
			}
			if ns[len(ns)-1] == 1 {
				inits = append(inits, p)
			} else {
				copies = append(copies, p)
			}
		}
	}
	return cgs, inits, copies
}

// TestSparesRestoreAfterFork: a branch of a fast fork prepares the fork's node (POST
// /v1/nodes/ID/prepare), diverges (python state, the 50 MB heap, bash, files, a new
// process) and restores the node: from the spare, exactly the node's state at the
// checkpoint's PIDs, the divergence gone; the next spare, made in the background, serves
// the next restore. A spare whose copy was killed from the host is not used: the
// restore forks, correctly. After a daemon crash the member, whose runtime is now a
// spare's, is adopted with its processes, and the spare it held is swept (its init and
// copies killed, its cgroup gone), never adopted.
func TestSparesRestoreAfterFork(t *testing.T) {
	root := testutil.NewStore(t)
	d := testutil.StartDaemonEnv(t, root, "DELTABOX_DURABLE=0")
	node, heap, pyPid, bashPid, bgPid := spareSource(t, d, "sps")
	const b = "spsb-1"
	n, err := d.C.PrepareNode(dbxCtx(t), node, b)
	if err != nil || !slices.Contains(n.Spares, b) {
		t.Fatalf("prepare: %v %+v", err, n)
	}
	for i := range 2 {
		div := spareDiverge(t, d, b)
		r := dbxRestore(t, d, b, node)
		t.Logf("restore %d: from_spare %v, %.2f ms, %v", i, r.FromSpare, r.DurationMS, r.PhasesUS)
		if !r.FromSpare || r.Processes != 3 || len(r.ProcessErrors) > 0 {
			t.Fatalf("restore %d: %+v", i, r)
		}
		spareCheck(t, d, b, heap, pyPid, bashPid, bgPid, div)
		spareWait(t, d, node, b)
	}
	in, err := d.C.Get(dbxCtx(t), b)
	if err != nil || in.Stats.RestorePaths.Spare != 2 || in.Stats.SpareBytes <= 0 || in.Cgroup == "" {
		t.Fatalf("stats after 2 restores from spares: %+v, cgroup %q (%v)", in.Stats, in.Cgroup, err)
	}
	t.Logf("a spare's copies hold %.1f MB pss_anon, %.1f MB alone", float64(in.Stats.SpareBytes)/(1<<20), float64(in.Stats.SparePrivateBytes)/(1<<20))
	// A copy of the spare killed from the host: the restore forks instead.
	_, _, copies := spareProcs(t, d, root, b)
	if len(copies) != 3 {
		t.Fatalf("the spare's copies: %v", copies)
	}
	if err := unix.Kill(copies[0], unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	div := spareDiverge(t, d, b)
	r := dbxRestore(t, d, b, node)
	if r.FromSpare || r.Processes != 3 {
		t.Fatalf("restore with a killed spare: %+v", r)
	}
	spareCheck(t, d, b, heap, pyPid, bashPid, bgPid, div)
	// A crash: the member is adopted by its runtime's cgroups (the record's), the spare
	// it held is swept.
	spareWait(t, d, node, b)
	cgs, inits, copies := spareProcs(t, d, root, b)
	if len(cgs) != 1 || len(inits) != 1 || len(copies) != 3 {
		t.Fatalf("before the crash: the spare's cgroup %v, init %v, copies %v", cgs, inits, copies)
	}
	if err := d.C.Sync(dbxCtx(t)); err != nil {
		t.Fatal(err)
	}
	d.Kill()
	d = testutil.StartDaemonEnv(t, root, "DELTABOX_DURABLE=0")
	// Adopted with its processes (forkCheckBranch's reads move the generator and the
	// random state: they ran once after the last restore).
	if got := sessRun(t, d, b, "py", "(len(d), d[1], os.getpid())"); got != fmt.Sprintf("(100000, '1', %s)\n", pyPid) {
		t.Fatalf("%s's python after the restart: %q", b, got)
	}
	if got := dbxSh(t, d, b, "cat /proc/"+bashPid+"/comm /proc/"+bgPid+"/comm"); got != "bash\nsleep\n" {
		t.Fatalf("%s's bash and background process after the restart: %q", b, got)
	}
	if cgs2, _, _ := spareProcs(t, d, root, b); len(cgs2) != 0 {
		t.Fatalf("after the restart: the spare's cgroups %v are still there", cgs2)
	}
	for _, p := range append(inits, copies...) {
		if st := procfs.State(p); st != 0 && st != 'Z' {
			t.Fatalf("the spare's process %d survived the restart (state %c)", p, st)
		}
	}
	if n, err := d.C.Node(dbxCtx(t), node); err != nil || len(n.Spares) != 0 {
		t.Fatalf("spares after the restart: %v (%v)", n.Spares, err)
	}
	// And it goes on: a restore forks (no spare), the next is from the spare made after.
	div = spareDiverge(t, d, b)
	if r := dbxRestore(t, d, b, node); r.FromSpare || r.Processes != 3 {
		t.Fatalf("restore after the restart: %+v", r)
	}
	spareCheck(t, d, b, heap, pyPid, bashPid, bgPid, div)
	spareWait(t, d, node, b)
	div = spareDiverge(t, d, b)
	if r := dbxRestore(t, d, b, node); !r.FromSpare || r.Processes != 3 {
		t.Fatalf("restore from a spare after the restart: %+v", r)
	}
	spareCheck(t, d, b, heap, pyPid, bashPid, bgPid, div)
	// A node of a plain sandbox is refused, with what to do.
	dbxCreate(t, d, "spplain")
	plain := dbxCheckpoint(t, d, "spplain", "plain").Node.ID
	if _, err := d.C.PrepareNode(dbxCtx(t), plain, ""); err == nil || !strings.Contains(err.Error(), "fork the sandbox first") {
		t.Fatalf("prepare of a plain sandbox's node: %v", err)
	}
}

// TestSpareCutByCrash: the daemon dies (SIGKILL, DELTABOX_CRASH_AT=restore-spare:K)
// during a restore from a spare: before its check (1), its quiesce (2), its swap (3),
// after the swap, before the answer and the index's commit (4: the old runtime frozen,
// the spare's running, its record maybe not on disk), and once its record is on disk
// (5: the old runtime frozen, not ended). The next daemon adopts
// the member with its sessions running, either as it was (the restore did not happen:
// 1-3, and 4 when the record did not reach the disk) or at the node (4, 5), never frozen
// (the adoption thaws a runtime the swap froze), its sessions kept (the spare's init
// holds their terminals from its making);
// the runtime the record does not name, and the spare's, are swept (no cgroup left).
func TestSpareCutByCrash(t *testing.T) {
	for k := 1; k <= 5; k++ {
		t.Run(fmt.Sprintf("restore-spare-%d", k), func(t *testing.T) {
			root := testutil.NewStore(t)
			d := testutil.StartDaemonEnv(t, root, "DELTABOX_DURABLE=0", fmt.Sprintf("DELTABOX_CRASH_AT=restore-spare:%d", k))
			node, heap, pyPid, bashPid, bgPid := spareSource(t, d, "spc")
			const b = "spcb-1"
			if _, err := d.C.PrepareNode(dbxCtx(t), node, b); err != nil {
				t.Fatal(err)
			}
			div := spareDiverge(t, d, b)
			if err := d.C.Sync(dbxCtx(t)); err != nil {
				t.Fatal(err)
			}
			if _, err := d.C.Restore(dbxCtx(t), b, node); err == nil {
				t.Fatalf("the restore was answered: the daemon did not die at restore-spare:%d", k)
			}
			d.Kill()
			d = testutil.StartDaemonEnv(t, root, "DELTABOX_DURABLE=0")
			got := sessRun(t, d, b, "py", "d[1]") // answers: not frozen
			switch {
			case got == "'diverged'\n" && k < 5:
				if k == 4 {
					t.Logf("the swap's record did not reach the disk: the member is as it was")
				}
				if out := dbxSh(t, d, b, "cat /workspace/f; ls /workspace/new"); out != "diverged\n/workspace/new\n" {
					t.Fatalf("the member as it was: its files %q", out)
				}
			case got == "'1'\n" && k >= 4:
				spareCheck(t, d, b, heap, pyPid, bashPid, bgPid, div)
			default:
				t.Fatalf("the member's python after the crash at restore-spare:%d: %q", k, got)
			}
			in, err := d.C.Get(dbxCtx(t), b)
			if err != nil {
				t.Fatal(err)
			}
			own := b
			if in.Cgroup != "" {
				own = in.Cgroup
			}
			dirs, _ := filepath.Glob(filepath.Join(cgroup.RootFor(root), b+"*"))
			for _, dir := range dirs {
				if filepath.Base(dir) != own {
					t.Fatalf("cgroup %s left after the restart (the member's runtime is %s)", dir, own)
				}
			}
			// And it goes on: the next restore of the node is the node's.
			div = spareDiverge(t, d, b)
			if r := dbxRestore(t, d, b, node); r.Processes != 3 {
				t.Fatalf("restore after the repair: %+v", r)
			}
			spareCheck(t, d, b, heap, pyPid, bashPid, bgPid, div)
		})
	}
}
