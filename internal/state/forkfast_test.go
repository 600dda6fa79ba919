package state_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/apitypes"
	"deltabox/internal/cgroup"
	"deltabox/internal/procfs"
	"deltabox/internal/sandbox"
	"deltabox/internal/state"
	"deltabox/internal/testutil"
)

// fastCounter is a process outside the sessions whose memory the test checks: a 20 MB
// heap and a dict made before the checkpoint, and a counter. Every 20 ms it writes
// "PID HASH N HOSTNAME" to /tmp/fast.out of whatever state it stands on (opened anew
// each time, so in a branch it lands in the branch's own upper).
const fastCounter = `cd /; nohup python3 -c '
import os, time, hashlib, random
buf = bytearray(random.Random(7).randbytes(20 << 20))
d = {i: str(i) for i in range(100000)}
h = hashlib.sha256(bytes(buf) + repr(sorted(d.items())[:1000]).encode()).hexdigest()[:16]
n = 0
while True:
    n += 1
    with open("/tmp/fast.tmp", "w") as f:
        f.write("%d %s %d %s\n" % (os.getpid(), h, n, os.uname().nodename))
    os.rename("/tmp/fast.tmp", "/tmp/fast.out")
    time.sleep(0.02)
' </dev/null >/dev/null 2>&1 & echo $!`

// readState reads /tmp/fast.out in rt's current state, confined to it.
func readState(t *testing.T, rt *sandbox.Sandbox) string {
	t.Helper()
	root, err := rt.RootFD()
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(root)
	fd, err := unix.Openat2(root, "tmp/fast.out", &unix.OpenHow{Flags: unix.O_RDONLY | unix.O_CLOEXEC, Resolve: unix.RESOLVE_IN_ROOT})
	if err != nil {
		return ""
	}
	f := os.NewFile(uintptr(fd), "fast.out")
	defer f.Close()
	b := make([]byte, 256)
	n, _ := f.Read(b)
	return strings.TrimSpace(string(b[:n]))
}

// waitCount waits until rt's counter line shows pid and hash with a count past after.
func waitCount(t *testing.T, rt *sandbox.Sandbox, pid, hash string, after int) string {
	t.Helper()
	var last string
	for t0 := time.Now(); time.Since(t0) < 10*time.Second; time.Sleep(20 * time.Millisecond) {
		last = readState(t, rt)
		f := strings.Fields(last)
		if len(f) == 4 && f[0] == pid && (hash == "" || f[1] == hash) {
			if n, _ := strconv.Atoi(f[2]); n > after {
				return last
			}
		}
	}
	t.Fatalf("sandbox %s: counter %q, want pid %s hash %s past %d", rt.ID, last, pid, hash, after)
	return ""
}

// waitHost waits until rt's counter line is written by pid with hash in rt (its
// hostname).
func waitHost(t *testing.T, rt *sandbox.Sandbox, pid, hash string) {
	t.Helper()
	var last string
	for t0 := time.Now(); time.Since(t0) < 10*time.Second; time.Sleep(20 * time.Millisecond) {
		last = readState(t, rt)
		if f := strings.Fields(last); len(f) == 4 && f[0] == pid && f[1] == hash && f[3] == rt.Hostname {
			return
		}
	}
	t.Fatalf("sandbox %s: counter %q, want pid %s hash %s host %s", rt.ID, last, pid, hash, rt.Hostname)
}

func statusField(t *testing.T, hostPid int, key string) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", hostPid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, key+":"); ok {
			return strings.TrimSpace(v)
		}
	}
	t.Fatalf("no %s in /proc/%d/status", key, hostPid)
	return ""
}

// TestForkFastPlacesCopies: the fast path's mechanism (docs/design/fork.md). A process of
// sandbox src (20 MB heap, a dict) is checkpointed (its template in the family's PID
// namespace P_S); three branches are made by src's init in sibling namespaces, and the
// template is forked into each at its checkpoint PID. Each copy: alive at that PID in
// its branch, whose /proc lists init and it alone; in a PID and user namespace of its
// own, children of src's; its memory intact (the heap's hash); writing into its branch's
// own upper, named by its branch's hostname; in its branch's UTS, network and IPC
// namespaces; with its capabilities, ids and seccomp as they were (a user namespace's
// setns gives a full set). A command of branch 0 lists only its branch in /proc and its
// kill -9 -1 spares the others and src; branch 0's init's kill-all ends its copy and
// nothing else. Removing the branches leaves src running.
func TestForkFastPlacesCopies(t *testing.T) {
	testutil.Require(t, os.Geteuid() == 0, "needs root")
	root := testutil.NewStore(t)
	m := open(t, root)
	defer m.Close()
	ctx := context.Background()
	const id = "ffsrc"
	if _, err := m.Create(ctx, state.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	pid := strings.TrimSpace(sh(t, m, id, fastCounter))
	src := rtOf(t, m, id)
	first := waitCount(t, src, pid, "", -1)
	hash := strings.Fields(first)[1]
	cp, err := m.Checkpoint(ctx, id, "")
	if err != nil || cp.Processes != 1 {
		t.Fatalf("checkpoint: %v %+v", err, cp)
	}
	const n = 3
	t0 := time.Now()
	bs, _, remove, err := state.ForkFastBranches(m, id, cp.Node.ID, n)
	if err != nil {
		t.Fatal(err)
	}
	rts := runtimes(bs)
	t.Logf("%d branches (branch inits, states, copies placed) in %v", n, time.Since(t0))
	removed := false
	defer func() {
		if !removed {
			remove()
		}
	}()
	srcInit := src.InitPid()
	want, _ := strconv.Atoi(pid)
	srcHost := 0
	hosts := map[int]bool{}
	for i, rt := range rts {
		// The node's own /tmp/fast.out (the source's, at the checkpoint) is there until
		// the copy writes its own, which names the branch's host.
		waitHost(t, rt, pid, hash)
		procs, err := rt.Procs()
		if err != nil || fmt.Sprint(procs) != fmt.Sprintf("[1 %d]", want) {
			t.Fatalf("branch %d's /proc lists %v (%v), want [1 %d]", i, procs, err, want)
		}
		host, err := fastpath(rt, want)
		if err != nil {
			t.Fatalf("branch %d: %v", i, err)
		}
		hosts[host] = true
		ns, err := procfs.NSpid(host)
		if err != nil || len(ns) != 3 || ns[2] != want {
			t.Fatalf("branch %d's copy %d: NSpid %v (%v), want 3 levels ending in %d", i, host, ns, err, want)
		}
		if a, b := nsOf(t, host, "pid"), nsOf(t, rt.InitPid(), "pid"); a != b {
			t.Fatalf("branch %d's copy is in PID namespace %s, its init in %s", i, a, b)
		}
		for _, k := range []string{"uts", "net", "ipc"} {
			if a, b := nsOf(t, host, k), nsOf(t, rt.InitPid(), k); a != b {
				t.Fatalf("branch %d's copy is in %s namespace %s, its init in %s", i, k, a, b)
			}
		}
		if a, b := nsOf(t, host, "user"), nsOf(t, rt.InitPid(), "user"); a != b || a == nsOf(t, srcInit, "user") {
			t.Fatalf("branch %d's copy is in user namespace %s, its init in %s, the source's %s", i, a, b, nsOf(t, srcInit, "user"))
		}
		if srcHost == 0 {
			for _, p := range mustPids(t, src) {
				if fastpathInner(p) == want && statusField(t, p, "State")[0] != 'T' {
					srcHost = p
				}
			}
		}
		for _, k := range []string{"CapBnd", "CapEff", "CapPrm", "CapInh", "CapAmb", "Uid", "Gid", "Seccomp"} {
			if a, b := statusField(t, host, k), statusField(t, srcHost, k); a != b {
				t.Fatalf("branch %d's copy: %s %s, the source's process %s", i, k, a, b)
			}
		}
		// Seen from the host: the same ids as the source's (U_i maps U_S's one to one).
		a, _ := os.ReadFile(fmt.Sprintf("/proc/%d/uid_map", host))
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/uid_map", srcHost))
		if len(a) == 0 || string(a) != string(b) {
			t.Fatalf("branch %d's copy's uid_map %q, the source's %q", i, a, b)
		}
	}
	if len(hosts) != n {
		t.Fatalf("copies' host PIDs %v: not one per branch", hosts)
	}
	// The source goes on, on its own files.
	c := strings.Fields(readState(t, src))
	k, _ := strconv.Atoi(c[2])
	waitCount(t, src, pid, hash, k)
	if got := strings.Fields(readState(t, src))[3]; got != id {
		t.Fatalf("the source's counter names %q", got)
	}
	// A command of branch 0 sees its own PID namespace (init, the copy, itself) and its
	// kill -9 -1 reaches nothing outside it (nor the copy: a command's Landlock domain
	// scopes its signals to what it started).
	r, err := rts[0].Exec(ctx, sandbox.ExecRequest{Argv: []string{"sh", "-c", "cd /proc; echo [0-9]*; kill -9 -1"}, Timeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if f := strings.Fields(r.Stdout); len(f) != 3 || f[0] != "1" || f[1] != pid {
		t.Fatalf("a command of branch 0 lists /proc %q, want 1, %s and itself", r.Stdout, pid)
	}
	// Branch 0's init's kill-all (kill(-1) from PID 1 of P_0): its copy, nothing else.
	if _, err := rts[0].KillAll(); err != nil {
		t.Fatal(err)
	}
	// KillAll returns once the family init has reaped it (sandbox.Sandbox.waitGone).
	if procs, _ := rts[0].Procs(); fmt.Sprint(procs) != "[1]" {
		t.Fatalf("branch 0's copy survived its init's kill-all: %v", procs)
	}
	for _, rt := range rts[1:] {
		c := strings.Fields(readState(t, rt))
		k, _ := strconv.Atoi(c[2])
		waitCount(t, rt, pid, hash, k)
	}
	c = strings.Fields(readState(t, src))
	k, _ = strconv.Atoi(c[2])
	waitCount(t, src, pid, hash, k)
	if err := remove(); err != nil {
		t.Fatalf("remove the branches: %v", err)
	}
	removed = true
	c = strings.Fields(readState(t, src))
	k, _ = strconv.Atoi(c[2])
	waitCount(t, src, pid, hash, k)
}

func rtOf(t *testing.T, m *state.Manager, id string) *sandbox.Sandbox {
	t.Helper()
	rt, err := state.Runtime(m, id)
	if err != nil {
		t.Fatal(err)
	}
	return rt
}

func mustPids(t *testing.T, rt *sandbox.Sandbox) []int {
	t.Helper()
	p, err := rt.Pids()
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// fastpathInner is host's PID in its innermost namespace, or 0.
func fastpathInner(host int) int {
	p, err := procfs.InnerPid(host)
	if err != nil {
		return 0
	}
	return p
}

// fastpath finds the host PID of rt's process pid (through its cgroup).
func fastpath(rt *sandbox.Sandbox, pid int) (int, error) {
	hosts, err := rt.Pids()
	if err != nil {
		return 0, err
	}
	for _, h := range hosts {
		if fastpathInner(h) == pid && statusNSDepth(h) == 3 {
			return h, nil
		}
	}
	return 0, fmt.Errorf("no process %d in %s's cgroup %v", pid, rt.ID, hosts)
}

func statusNSDepth(host int) int {
	ns, err := procfs.NSpid(host)
	if err != nil {
		return 0
	}
	return len(ns)
}

func nsOf(t *testing.T, host int, kind string) string {
	t.Helper()
	l, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/%s", host, kind))
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// TestForkFastFanout measures the fast path's mechanism on the fan-out bench's process:
// a 50 MB python forked into N branches (8; DELTABOX_FORKFAST_N sets another), until
// every copy has written its first line in its own branch; and the memory each copy
// adds (Pss, Private_Dirty after its first write). It checks each copy's PID and heap.
func TestForkFastFanout(t *testing.T) {
	testutil.Require(t, os.Geteuid() == 0, "needs root")
	n := 8
	if v := os.Getenv("DELTABOX_FORKFAST_N"); v != "" {
		n, _ = strconv.Atoi(v)
	}
	root := testutil.NewStore(t)
	m := open(t, root)
	defer m.Close()
	ctx := context.Background()
	const id = "fffan"
	if _, err := m.Create(ctx, state.CreateOptions{ID: id, MemoryMB: 2048}); err != nil {
		t.Fatal(err)
	}
	pid := strings.TrimSpace(sh(t, m, id, strings.Replace(fastCounter, "20 << 20", "50 << 20", 1)))
	src := rtOf(t, m, id)
	hash := strings.Fields(waitCount(t, src, pid, "", -1))[1]
	cp, err := m.Checkpoint(ctx, id, "")
	if err != nil || cp.Processes != 1 {
		t.Fatalf("checkpoint: %v %+v", err, cp)
	}
	t0 := time.Now()
	bs, ph, remove, err := state.ForkFastBranches(m, id, cp.Node.ID, n)
	if err != nil {
		t.Fatal(err)
	}
	made := time.Since(t0)
	rts := runtimes(bs)
	t.Logf("per branch: init %.1f ms, state %.1f ms, copy placed %.1f ms", ms(ph[0], n), ms(ph[1], n), ms(ph[2], n))
	defer remove()
	for _, rt := range rts {
		waitHost(t, rt, pid, hash)
	}
	total := time.Since(t0)
	var pss, dirty int64
	want, _ := strconv.Atoi(pid)
	for _, rt := range rts {
		host, err := fastpath(rt, want)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/smaps_rollup", host))
		for _, l := range strings.Split(string(b), "\n") {
			f := strings.Fields(l)
			if len(f) >= 2 {
				v, _ := strconv.ParseInt(f[1], 10, 64)
				switch f[0] {
				case "Pss:":
					pss += v
				case "Private_Dirty:":
					dirty += v
				}
			}
		}
	}
	t.Logf("FORKFAST n=%d: made (branch inits, states, copies placed) in %v (%.1f ms/branch), every copy written in its branch by %v; per copy Pss %d kB, Private_Dirty %d kB",
		n, made.Round(time.Millisecond), float64(made.Microseconds())/1000/float64(n), total.Round(time.Millisecond), pss/int64(n), dirty/int64(n))
}

func ms(d time.Duration, n int) float64 { return float64(d.Microseconds()) / 1000 / float64(n) }

func runtimes(bs []state.FastBranch) []*sandbox.Sandbox {
	var out []*sandbox.Sandbox
	for _, b := range bs {
		out = append(out, b.RT)
	}
	return out
}

// TestForkFastSessions: a python session (a dict of 10^5 objects, a generator
// mid-iteration, a random.Random) and a bash session (a variable, a function, a cwd),
// checkpointed, placed by the fast path's mechanism into 4 branches: each branch's
// sessions answer with the checkpoint's state at the checkpoint's PIDs, through
// terminals of the branch's own; each diverges alone; the source is unchanged. The copy
// of a session killed in one branch is seen ended there (its exit, reported by the
// family init, reaches the branch's session) and the others go on.
func TestForkFastSessions(t *testing.T) {
	testutil.Require(t, os.Geteuid() == 0, "needs root")
	root := testutil.NewStore(t)
	m := open(t, root)
	defer m.Close()
	ctx := context.Background()
	const id = "ffsess"
	if _, err := m.Create(ctx, state.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"python", "bash"} {
		if _, err := m.StartSession(ctx, id, state.SessionOptions{Name: k[:2], Kind: apitypes.SessionKind(k)}); err != nil {
			t.Fatal(err)
		}
	}
	call(t, m, id, "py", "import os, random\nd = {i: str(i) for i in range(100000)}\ng = iter(range(1000))\nnext(g); next(g)\nr = random.Random(5)\nr.random()")
	call(t, m, id, "ba", "V=hello; f() { echo f$1; }; cd /tmp")
	const pyState = "(len(d), d[99999], next(g), r.random(), os.getpid())"
	const baState = `echo "$V $(f 1) $PWD $$"`
	wantPy := call(t, m, id, "py", pyState)
	call(t, m, id, "py", "g = iter(range(2, 1000))\nr = random.Random(5)\nr.random()") // back to the state above
	wantBa := call(t, m, id, "ba", baState)
	cp, err := m.Checkpoint(ctx, id, "")
	if err != nil || cp.Processes != 2 {
		t.Fatalf("checkpoint: %v %+v", err, cp)
	}
	bs, _, remove, err := state.ForkFastBranches(m, id, cp.Node.ID, 4)
	if err != nil {
		t.Fatal(err)
	}
	defer remove()
	run := func(b state.FastBranch, name, code string) string {
		t.Helper()
		s := b.Sessions[name]
		if s == nil {
			t.Fatalf("branch %s has no session %s", b.RT.ID, name)
		}
		r, err := s.Run(ctx, code, 10*time.Second, 1<<20, nil)
		if err != nil || r.ExitCode != 0 {
			t.Fatalf("branch %s session %s: %q: %v %+v", b.RT.ID, name, code, err, r)
		}
		return r.Output
	}
	for i, b := range bs {
		if got := run(b, "py", pyState); got != wantPy {
			t.Fatalf("branch %d's python: %q, want the checkpoint's %q", i, got, wantPy)
		}
		if got := run(b, "ba", baState); got != wantBa {
			t.Fatalf("branch %d's bash: %q, want the checkpoint's %q", i, got, wantBa)
		}
		run(b, "py", fmt.Sprintf("d[0] = 'b%d'", i))
	}
	for i, b := range bs {
		if got := run(b, "py", "d[0]"); got != fmt.Sprintf("'b%d'\n", i) {
			t.Fatalf("branch %d's python after the divergence: %q", i, got)
		}
	}
	if got := call(t, m, id, "py", pyState); got != wantPy {
		t.Fatalf("the source's python: %q, want %q", got, wantPy)
	}
	if got := call(t, m, id, "py", "d[0]"); got != "'0'\n" {
		t.Fatalf("the source's d[0]: %q", got)
	}
	// Branch 0's init kills everything in it: its sessions see their processes end.
	if _, err := bs[0].RT.KillAll(); err != nil {
		t.Fatal(err)
	}
	var info string
	for t0 := time.Now(); time.Since(t0) < 5*time.Second; time.Sleep(10 * time.Millisecond) {
		in := bs[0].Sessions["py"].Info()
		if info = fmt.Sprintf("running %v exit %q", in.Running, in.Exit); !in.Running && in.Exit == "killed by SIGKILL" {
			break
		}
	}
	if info != `running false exit "killed by SIGKILL"` {
		t.Fatalf("branch 0's python session after its init's kill-all: %s, want its process's exit status from the family init", info)
	}
	for i, b := range bs[1:] {
		if got := run(b, "py", "d[0]"); got != fmt.Sprintf("'b%d'\n", i+1) {
			t.Fatalf("branch %d's python after branch 0's kill-all: %q", i+1, got)
		}
	}
}

// TestForkFastSandbox: sb.fork (ForkSandbox) with the fast path on: 3 branches of a
// sandbox with a python and a bash session and a background process, each "fast", at
// the checkpoint's PIDs, each session answering with the checkpoint's state; the source
// moved into a PID namespace of its own (none of the branches' processes in it) with
// the same state; a branch's own checkpoint and restore bring its state back at the
// PIDs; a restore of the node made before the fork, in a branch and in the source,
// places the holder's templates (the checkpoint's state at its PIDs); removing the
// source leaves the branches running; removing them all ends the family's holder
// (nothing of the family left on the host).
func TestForkFastSandbox(t *testing.T) {
	testutil.Require(t, os.Geteuid() == 0, "needs root")
	root := testutil.NewStore(t)
	cfg := state.DefaultConfig()
	cfg.ForkFast = true
	m := openWith(t, root, cfg)
	defer m.Close()
	ctx := context.Background()
	const id = "ffsb"
	if _, err := m.Create(ctx, state.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	if _, err := m.StartSession(ctx, id, state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	pyPid := strings.TrimSpace(call(t, m, id, "py", "import os, random\nd = {i: str(i) for i in range(100000)}\ng = iter(range(1000)); next(g)\nr = random.Random(3); r.random()\nos.getpid()"))
	baPid := strings.TrimSpace(call(t, m, id, "main", "cd /tmp; V=v1; f() { echo f$1; }; echo $$"))
	bgPid := strings.TrimSpace(sh(t, m, id, "nohup sleep 100000 </dev/null >/dev/null 2>&1 & echo $!"))
	const pyState = "q = random.Random(3); q.random(); (len(d), next(g), r.random() == q.random(), os.getpid())"
	check := func(sb string) {
		t.Helper()
		if got, want := call(t, m, sb, "py", pyState), fmt.Sprintf("(100000, 1, True, %s)\n", pyPid); got != want {
			t.Fatalf("%s: python %q, want %q", sb, got, want)
		}
		if got, want := call(t, m, sb, "main", `echo $PWD $V $(f x) $$`), fmt.Sprintf("/tmp v1 fx %s\n", baPid); got != want {
			t.Fatalf("%s: bash %q, want %q", sb, got, want)
		}
		if got := sh(t, m, sb, "cat /proc/"+bgPid+"/comm"); got != "sleep\n" {
			t.Fatalf("%s: background process %q", sb, got)
		}
	}
	res, err := m.ForkSandbox(ctx, id, state.CheckpointOptions{}, state.ForkOptions{Count: 3, CreateOptions: state.CreateOptions{ID: "ffb"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("fork of 3: %.0f ms: %s", res.DurationMS, res.Branches[0].Reason)
	for i, b := range res.Branches {
		if b.Path != "fast" || b.Restore.Processes != 3 || b.Sandbox.ID != fmt.Sprintf("ffb-%d", i) {
			t.Fatalf("branch %d: %s path %s (%s), %+v", i, b.Sandbox.ID, b.Path, b.Reason, b.Restore)
		}
	}
	for _, b := range res.Branches {
		check(b.Sandbox.ID)
		call(t, m, b.Sandbox.ID, "py", fmt.Sprintf("d[0] = '%s'", b.Sandbox.ID))
	}
	// The source: its state, in a PID namespace of its own (it lists its own).
	if got := call(t, m, id, "py", "d[0]"); got != "'0'\n" {
		t.Fatalf("the source's d[0]: %q", got)
	}
	check(id)
	ps := sh(t, m, id, "cd /proc; echo [0-9]*")
	for _, b := range res.Branches {
		bps := sh(t, m, b.Sandbox.ID, "cd /proc; echo [0-9]*")
		t.Logf("%s /proc: %s", b.Sandbox.ID, strings.TrimSpace(bps))
	}
	t.Logf("%s /proc: %s", id, strings.TrimSpace(ps))
	src := rtOf(t, m, id)
	for _, b := range res.Branches {
		if a, c := nsOf(t, rtOf(t, m, b.Sandbox.ID).InitPid(), "pid"), nsOf(t, src.InitPid(), "pid"); a == c {
			t.Fatalf("branch %s shares the source's PID namespace", b.Sandbox.ID)
		}
	}
	// A branch is a sandbox like any other: its own checkpoint and restore (templates
	// forked from its processes, in its namespace) bring its state back, at the PIDs.
	b0 := res.Branches[0].Sandbox.ID
	cp0, err := m.Checkpoint(ctx, b0, "")
	if err != nil || cp0.Processes != 3 {
		t.Fatalf("checkpoint of %s: %v %+v", b0, err, cp0)
	}
	call(t, m, b0, "py", "d[0] = 'changed'")
	r0, err := m.Restore(ctx, b0, cp0.Node.ID)
	if err != nil || r0.Processes != 3 {
		t.Fatalf("restore of %s: %v %+v", b0, err, r0)
	}
	if got := call(t, m, b0, "py", "(d[0], os.getpid())"); got != fmt.Sprintf("('%s', %s)\n", b0, pyPid) {
		t.Fatalf("%s after its restore: %q", b0, got)
	}
	// The node made before the fork, restored in a branch and in the source: the
	// holder's templates placed into each one's namespace, the checkpoint's state.
	for _, sb := range []string{b0, id} {
		r, err := m.Restore(ctx, sb, res.Node)
		if err != nil || r.Processes != 3 {
			t.Fatalf("restore of %s to the pre-fork node: %v %+v", sb, err, r)
		}
		check(sb)
		if got := call(t, m, sb, "py", "d[0]"); got != "'0'\n" {
			t.Fatalf("%s after its restore to the pre-fork node: d[0] %q", sb, got)
		}
	}
	// Removing the source: the branches go on.
	if err := m.Remove(id); err != nil {
		t.Fatal(err)
	}
	for _, b := range res.Branches[1:] {
		if got := call(t, m, b.Sandbox.ID, "py", "d[0]"); got != fmt.Sprintf("'%s'\n", b.Sandbox.ID) {
			t.Fatalf("%s after the source's removal: %q", b.Sandbox.ID, got)
		}
	}
	for _, b := range res.Branches {
		if err := m.Remove(b.Sandbox.ID); err != nil {
			t.Fatal(err)
		}
	}
	if left := sandboxLeft(t, id+".family"); left != "" {
		t.Fatalf("the family's holder is left: %s", left)
	}
}

// sandboxLeft says what is left of cgroup id ("" when it is gone).
func sandboxLeft(t *testing.T, id string) string {
	b, err := os.ReadFile(filepath.Join(cgroup.Root, id, "cgroup.procs"))
	if err != nil {
		return ""
	}
	return "processes " + strings.Join(strings.Fields(string(b)), " ")
}

// TestForkFastFailureLeavesSource: a fast fork whose branch 2 cannot be made (its name is
// taken) removes the branches made and leaves the source as it was: its sessions' state
// and PIDs, in its own PID namespace (no holder made, nothing moved).
func TestForkFastFailureLeavesSource(t *testing.T) {
	testutil.Require(t, os.Geteuid() == 0, "needs root")
	root := testutil.NewStore(t)
	cfg := state.DefaultConfig()
	cfg.ForkFast = true
	m := openWith(t, root, cfg)
	defer m.Close()
	ctx := context.Background()
	const id = "fffail"
	for _, sb := range []string{id, "fff-2"} {
		if _, err := m.Create(ctx, state.CreateOptions{ID: sb}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := m.StartSession(ctx, id, state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	want := call(t, m, id, "py", "import os\nx = 41\n(x, os.getpid())")
	initNS := nsOf(t, rtOf(t, m, id).InitPid(), "pid")
	before := m.List()
	_, err := m.ForkSandbox(ctx, id, state.CheckpointOptions{}, state.ForkOptions{Count: 3, CreateOptions: state.CreateOptions{ID: "fff"}})
	if err == nil || !strings.Contains(err.Error(), "branch 2 of 3") || !strings.Contains(err.Error(), "already exists") || !strings.Contains(err.Error(), "fast path") {
		t.Fatalf("fork with branch 2's name taken: %v", err)
	}
	if after := m.List(); len(after) != len(before) {
		t.Fatalf("%d sandboxes after the failed fork, %d before", len(after), len(before))
	}
	if got := call(t, m, id, "py", "(x, os.getpid())"); got != want {
		t.Fatalf("the source after the failed fork: %q, want %q", got, want)
	}
	if got := nsOf(t, rtOf(t, m, id).InitPid(), "pid"); got != initNS {
		t.Fatalf("the source moved (PID namespace %s, was %s)", got, initNS)
	}
	if left := sandboxLeft(t, id+".family"); left != "" {
		t.Fatalf("a holder was made: %s", left)
	}
}

// TestForkFastExecRootOnce: the family init builds the branch inits' exec root once, on
// one thread with a mount namespace of its own (sbinit's branchMaker), and makes every
// later branch from it: after three branches and after two more, the init has exactly
// one thread outside its own mount namespace, the same namespace both times, and the
// later branches' copies run as the first ones' did. Each branch init runs with one P
// (GOMAXPROCS=1, its whole environment).
func TestForkFastExecRootOnce(t *testing.T) {
	testutil.Require(t, os.Geteuid() == 0, "needs root")
	root := testutil.NewStore(t)
	m := open(t, root)
	defer m.Close()
	ctx := context.Background()
	const id = "ffonce"
	if _, err := m.Create(ctx, state.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	pid := strings.TrimSpace(sh(t, m, id, fastCounter))
	src := rtOf(t, m, id)
	hash := strings.Fields(waitCount(t, src, pid, "", -1))[1]
	cp, err := m.Checkpoint(ctx, id, "")
	if err != nil || cp.Processes != 1 {
		t.Fatalf("checkpoint: %v %+v", err, cp)
	}
	init := src.InitPid()
	// makers lists the mount namespaces of init's threads other than its own.
	makers := func() []string {
		own := nsOf(t, init, "mnt")
		tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", init))
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, tk := range tasks {
			ns, err := os.Readlink(fmt.Sprintf("/proc/%d/task/%s/ns/mnt", init, tk.Name()))
			if err == nil && ns != own {
				out = append(out, ns)
			}
		}
		return out
	}
	var seen []string
	for round, n := range []int{3, 2} {
		bs, _, remove, err := state.ForkFastBranches(m, id, cp.Node.ID, n)
		if err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		for _, rt := range runtimes(bs) {
			waitHost(t, rt, pid, hash)
			// The branch init runs with one P (sbinit's startBranch).
			if env, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", rt.InitPid())); err != nil || string(env) != "GOMAXPROCS=1\x00" {
				t.Fatalf("branch init %d's environment %q (%v), want GOMAXPROCS=1 alone", rt.InitPid(), env, err)
			}
		}
		if err := remove(); err != nil {
			t.Fatalf("round %d: remove the branches: %v", round, err)
		}
		got := makers()
		if len(got) != 1 {
			t.Fatalf("round %d (%d branches): the family init has %d threads in a mount namespace of their own (%v), want 1: the exec root built once and kept", round, n, len(got), got)
		}
		seen = append(seen, got[0])
	}
	if seen[0] != seen[1] {
		t.Fatalf("the exec root's namespace changed between rounds (%s, then %s): built again", seen[0], seen[1])
	}
}
