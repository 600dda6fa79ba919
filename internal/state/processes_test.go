package state_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"deltabox/internal/cgroup"
	"deltabox/internal/procfs"
	"deltabox/internal/sandbox"
	"deltabox/internal/state"
	"deltabox/internal/store"
	"deltabox/internal/testutil"
)

// call runs code in a session of sandbox id and returns its output; it fails the test
// unless the call succeeds with status 0.
func call(t *testing.T, m *state.Manager, id, sess, code string) string {
	t.Helper()
	r := callRes(t, m, id, sess, code)
	if r.ExitCode != 0 {
		t.Fatalf("%s: %q: exit %d: %s", sess, code, r.ExitCode, r.Stdout)
	}
	return r.Stdout
}

func callRes(t *testing.T, m *state.Manager, id, sess, code string) *sandbox.ExecResult {
	t.Helper()
	r, err := m.Exec(context.Background(), id, sandbox.ExecRequest{Argv: []string{code}, Session: sess, Timeout: 30 * time.Second})
	if err != nil {
		t.Fatalf("%s: %q: %v", sess, code, err)
	}
	return r
}

// sandboxProcs lists the host PIDs in sandbox id's cgroup with their state letter.
func sandboxProcs(t *testing.T, id string) map[int]byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(cgroup.Root, id, "cgroup.procs"))
	if err != nil {
		t.Fatal(err)
	}
	out := map[int]byte{}
	for _, f := range strings.Fields(string(b)) {
		p, _ := strconv.Atoi(f)
		st, err := os.ReadFile("/proc/" + f + "/stat")
		if err != nil {
			continue
		}
		i := bytes.LastIndexByte(st, ')')
		out[p] = st[i+2]
	}
	return out
}

// stopped counts the sandbox's processes in a stop (its templates).
func stopped(t *testing.T, id string) int {
	n := 0
	for _, st := range sandboxProcs(t, id) {
		if st == 'T' || st == 't' {
			n++
		}
	}
	return n
}

// settle waits until f returns "" (up to 3 s) and returns its last answer.
func settle(f func() string) string {
	var s string
	for i := 0; i < 300; i++ {
		if s = f(); s == "" {
			return ""
		}
		time.Sleep(10 * time.Millisecond)
	}
	return s
}

// What the bash and the python sessions show of their state, without changing it: the
// mount namespace tells which state a process is on.
const (
	bashProbe = `echo "$V|$PWD|$$|$(alias a)|$(readlink /proc/$$/ns/mnt /proc/$$/cwd)"`
	pyProbe   = `(x, os.getpid(), os.getcwd(), os.readlink('/proc/self/ns/mnt'))`
)

// TestFailureAtEveryStepKeepsProcesses injects a failure at every step of a checkpoint
// and of a restore of a sandbox with a bash and a python session (a file mid-read and
// one mid-write), and checks what each failure leaves: the same node and upper, the same
// files, no node made, no frozen layer made, no template leaked (stopped processes in
// the sandbox's cgroup), and the sessions alive with the same PIDs and state. A restore
// that fails after the live processes were killed (steps 5-7: their PIDs must be free
// for the templates' fork) leaves the files exactly as they were and ends the sessions,
// which start afresh on their next call (documented in Manager.Restore).
func TestFailureAtEveryStepKeepsProcesses(t *testing.T) {
	root := testutil.NewStore(t)
	m := open(t, root)
	defer m.Close()
	ctx := context.Background()
	const id = "fp"
	if _, err := m.Create(ctx, state.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	if _, err := m.StartSession(ctx, id, state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	setup := func() {
		call(t, m, id, "main", `mkdir -p /tmp/w && cd /tmp/w && V=base; alias a='echo a'`)
		call(t, m, id, "py", `import os
open('/workspace/lines.txt', 'w').write(''.join('line%d\n' % i for i in range(1000)))
fin = open('/workspace/lines.txt')
fout = open('/workspace/out.txt', 'w')
import fcntl
flk = open('/workspace/lock.txt', 'w')
fcntl.lockf(flk, fcntl.LOCK_EX)
x = 'base'`)
	}
	// The python session's POSIX lock on lock.txt, tried from another process: a move
	// drops it (its dup3 closes the old fd), so a checkpoint that fails after the move
	// must set it again (MoveBack).
	locked := func(t *testing.T, what string) {
		t.Helper()
		out := sh(t, m, id, `python3 -c "
import fcntl
f = open('/workspace/lock.txt', 'a')
try:
    fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print('free')
except OSError:
    print('held')"`)
		if strings.TrimSpace(out) != "held" {
			t.Fatalf("%s: lock.txt is %s, want held by the python session", what, strings.TrimSpace(out))
		}
	}
	setup()
	base, err := m.Checkpoint(ctx, id, "base")
	if err != nil || base.Processes != 2 {
		t.Fatalf("base checkpoint: %v %+v", err, base)
	}
	// A process outside the sessions, which checkpoints take along too (holdOthers);
	// the restores to base end it.
	bg := strings.TrimSpace(sh(t, m, id, "cd /workspace; sleep 100000 </dev/null >/dev/null 2>&1 & echo $!"))
	// Read from the host: another command cannot read the job's /proc/PID/ns (each
	// command runs in a Landlock domain of its own).
	bgNS := func() string {
		t.Helper()
		for h := range sandboxProcs(t, id) {
			st, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", h))
			if err != nil {
				continue
			}
			for _, l := range strings.Split(string(st), "\n") {
				if f := strings.Fields(l); len(f) > 1 && f[0] == "NSpid:" && f[len(f)-1] == bg {
					ns, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/mnt", h))
					if err != nil {
						t.Fatal(err)
					}
					return ns + "\n"
				}
			}
		}
		t.Fatalf("the background process %s is not in the sandbox", bg)
		return ""
	}
	// A checkpoint answers early (checkpoint.go: "The early answer"), so that a failure
	// at step 2 or later comes after its answer; checkpoint-complete is one that answers
	// at its end.
	steps := map[string]int{"checkpoint": state.CheckpointStepCount, "checkpoint-complete": state.CheckpointStepCount, "restore": state.RestoreStepCount}
	for _, op := range []string{"checkpoint", "checkpoint-complete", "restore"} {
		for step := 1; step <= steps[op]; step++ {
			t.Run(fmt.Sprintf("%s-step%d", op, step), func(t *testing.T) {
				late := op == "restore" && step >= 5
				// Changes in the files and in both processes, so that the operation has
				// real work to do and a wrong undo shows.
				tag := fmt.Sprintf("%s%d", op, step)
				call(t, m, id, "main", fmt.Sprintf("V=%s; cd /tmp; echo %s >> /workspace/a.txt; rm -f /workspace/gone", tag, tag))
				call(t, m, id, "py", fmt.Sprintf("x = %q; fin.readline(); fout.write(%q); fout.flush()", tag, tag))
				before := sh(t, m, id, manifest)
				bash0 := call(t, m, id, "main", bashProbe)
				py0 := call(t, m, id, "py", pyProbe)
				line0 := call(t, m, id, "py", "print(fin.readline().strip())")
				info, _ := m.Get(id)
				nodes := len(m.Tree().Nodes)
				frozen := frozenLayers(t, root)
				templates := stopped(t, id)
				var bg0 string
				ckpt := strings.HasPrefix(op, "checkpoint")
				if ckpt {
					bg0 = bgNS()
				}
				state.SetFailStep(m, func(o string, k int) error {
					if strings.HasPrefix(op, o) && k == step {
						return fmt.Errorf("injected failure at %s step %d", o, k)
					}
					return nil
				})
				switch op {
				case "checkpoint":
					err = checkpointFault(t, m, id, step, state.CheckpointOptions{Label: "x"}, true)
				case "checkpoint-complete":
					err = checkpointFault(t, m, id, step, state.CheckpointOptions{Label: "x", Answer: state.AnswerComplete}, false)
				default:
					_, err = m.Restore(ctx, id, base.Node.ID)
				}
				state.SetFailStep(m, nil)
				if err == nil || !strings.Contains(err.Error(), "injected") {
					t.Fatalf("%s with a failure at step %d: err = %v, want the injected failure", op, step, err)
				}
				if after := sh(t, m, id, manifest); after != before {
					t.Fatalf("files changed by a failed %s:\nbefore:\n%s\nafter:\n%s", op, before, after)
				}
				info2, _ := m.Get(id)
				if info2.Head != info.Head || info2.Upper != info.Upper {
					t.Fatalf("position changed: head %s->%s upper %d->%d", info.Head, info2.Head, info.Upper, info2.Upper)
				}
				if n := len(m.Tree().Nodes); n != nodes {
					t.Fatalf("a failed %s left %d nodes, had %d", op, n, nodes)
				}
				if f := frozenLayers(t, root); len(f) != len(frozen) {
					t.Fatalf("a failed %s changed the frozen layers: %v -> %v", op, frozen, f)
				}
				if got := settle(func() string {
					if n := stopped(t, id); n != templates {
						return fmt.Sprintf("%d stopped processes, had %d: %v", n, templates, sandboxProcs(t, id))
					}
					return ""
				}); got != "" {
					t.Fatalf("a failed %s leaked or lost templates: %s", op, got)
				}
				if late {
					r := callRes(t, m, id, "main", bashProbe)
					if !r.SessionRestarted || strings.HasPrefix(r.Stdout, tag+"|") {
						t.Fatalf("bash after a restore failing at step %d: restarted %v, %q", step, r.SessionRestarted, r.Stdout)
					}
					setup()
				} else {
					if b := call(t, m, id, "main", bashProbe); b != bash0 {
						t.Fatalf("bash after a failed %s: %q, was %q", op, b, bash0)
					}
					if p := call(t, m, id, "py", pyProbe); p != py0 {
						t.Fatalf("python after a failed %s: %q, was %q", op, p, py0)
					}
					// The file mid-read goes on from where it was, and the one mid-write
					// still writes into the sandbox's upper.
					want := fmt.Sprintf("line%d", atoi(strings.TrimPrefix(strings.TrimSpace(line0), "line"))+1)
					if l := strings.TrimSpace(call(t, m, id, "py", "print(fin.readline().strip())")); l != want {
						t.Fatalf("fin after a failed %s: %q, want %q", op, l, want)
					}
					locked(t, "after a failed "+op)
					if ckpt {
						if ns := bgNS(); ns != bg0 {
							t.Fatalf("the background process after a failed checkpoint: namespace %s, was %s", ns, bg0)
						}
					}
					call(t, m, id, "py", "fout.write('+'); fout.flush()")
					if out := sh(t, m, id, "cat /workspace/out.txt"); !strings.HasSuffix(out, tag+"+") {
						t.Fatalf("fout after a failed %s: out.txt is %q", op, out)
					}
				}
				// And the operation works once the fault is gone.
				var res *state.OpResult
				if ckpt {
					res, err = m.Checkpoint(ctx, id, "ok")
				} else {
					res, err = m.Restore(ctx, id, base.Node.ID)
				}
				want := 2 // base's sessions
				if ckpt {
					want = 3 // and the background process
				}
				if err != nil || res.Processes != want {
					t.Fatalf("%s after the fault: %v %+v, want %d processes", op, err, res, want)
				}
				locked(t, op+" after the fault")
				if ckpt && res.Killed != 0 {
					t.Fatalf("the checkpoint after the fault killed %d processes, want the background one kept", res.Killed)
				}
			})
		}
	}
	info, _ := m.Get(id)
	c, r := info.Stats.CheckpointPaths, info.Stats.RestorePaths
	if c.Failed != 16 || r.Failed != 7 || c.Process != 17 || r.Process != 7 {
		t.Fatalf("counts: checkpoints %+v restores %+v", c, r)
	}
}

func atoi(s string) int { n, _ := strconv.Atoi(s); return n }

// TestTemplateMemory: a node's template costs what its live process no longer shares
// with it. Right after the checkpoint they share every page; once the live process has
// written 32 MiB of its heap, those pages' originals belong to the template alone, and
// its private dirty memory has grown by that much. The node, the sandbox and the tree
// show it.
func TestTemplateMemory(t *testing.T) {
	root := testutil.NewStore(t)
	m := open(t, root)
	defer m.Close()
	ctx := context.Background()
	const id = "mem"
	if _, err := m.Create(ctx, state.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	if _, err := m.StartSession(ctx, id, state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	call(t, m, id, "py", "a = bytearray(32 << 20)")
	r, err := m.Checkpoint(ctx, id, "")
	if err != nil || r.Processes != 1 {
		t.Fatalf("checkpoint: %v %+v", err, r)
	}
	n0, err := m.Node(r.Node.ID)
	if err != nil || n0.Templates == nil || n0.Templates.Processes != 1 || fmt.Sprint(n0.Templates.Sessions) != "[py]" {
		t.Fatalf("node's templates: %v %+v", err, n0)
	}
	call(t, m, id, "py", "for i in range(0, len(a), 4096): a[i] = 1")
	n1, _ := m.Node(r.Node.ID)
	grew := n1.Templates.PrivateDirty - n0.Templates.PrivateDirty
	if grew < 30<<20 {
		t.Fatalf("the template's private dirty memory grew by %d bytes after the live process wrote 32 MiB: before %+v after %+v", grew, n0.Templates.Memory, n1.Templates.Memory)
	}
	t.Logf("template of py: before %+v, after the live process wrote 32 MiB %+v", n0.Templates.Memory, n1.Templates.Memory)
	if n1.Templates.Pss < n1.Templates.PrivateDirty || n1.Templates.Rss < n1.Templates.Pss {
		t.Fatalf("template memory: %+v", n1.Templates.Memory)
	}
	info, _ := m.Get(id)
	tree := m.Tree()
	if info.Templates == nil || info.Templates.Processes != 1 || info.Templates.PrivateDirty < n1.Templates.PrivateDirty-(1<<20) ||
		tree.Templates.Processes != 1 || tree.Templates.PrivateDirty < 30<<20 {
		t.Fatalf("totals: sandbox %+v tree %+v", info.Templates, tree.Templates)
	}
}

// TestWarmRestoredProcess (Config.WarmProcesses): after a restore, while its session is
// idle, the restored python's heap pages are copied ahead of its next write (the
// template's private dirty memory grows by the heap as the live process stops sharing
// it); and a command that arrives during the warm-up runs untraced from its first
// instruction to its last.
func TestWarmRestoredProcess(t *testing.T) {
	root := testutil.NewStore(t)
	cfg := state.DefaultConfig()
	cfg.WarmProcesses = true
	m := openWith(t, root, cfg)
	defer m.Close()
	ctx := context.Background()
	const id = "warm"
	if _, err := m.Create(ctx, state.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	if _, err := m.StartSession(ctx, id, state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	call(t, m, id, "py", "a = bytearray(24 << 20)")
	n, err := m.Checkpoint(ctx, id, "")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Restore(ctx, id, n.Node.ID); err != nil {
		t.Fatal(err)
	}
	if got := settle(func() string {
		if in, _ := m.Get(id); in.Stats.WarmedBytes < 24<<20 {
			return fmt.Sprintf("warmed %d bytes", in.Stats.WarmedBytes)
		}
		return ""
	}); got != "" {
		t.Fatalf("no warm-up after a restore: %s", got)
	}
	if ni, _ := m.Node(n.Node.ID); ni.Templates == nil || ni.Templates.PrivateDirty < 24<<20 {
		t.Fatalf("the restored process still shares its heap with the template after the warm-up: %+v", ni.Templates)
	}
	// A command right after the restore: the warm-up lets go of the process first, and
	// stops (at most a chunk done, not the whole heap).
	in0, _ := m.Get(id)
	if _, err := m.Restore(ctx, id, n.Node.ID); err != nil {
		t.Fatal(err)
	}
	out := call(t, m, id, "py", `import time
seen, t0 = set(), time.time()
while time.time() - t0 < 0.2:
    seen.add(open('/proc/self/status').read().split('TracerPid:')[1].split()[0])
print(sorted(seen), len(a))`)
	if strings.TrimSpace(out) != "['0'] 25165824" {
		t.Fatalf("a command during the warm-up saw tracers: %q", out)
	}
	if in1, _ := m.Get(id); in1.Stats.WarmedBytes-in0.Stats.WarmedBytes >= 8<<20 {
		t.Fatalf("the warm-up went on for %d bytes after a command arrived", in1.Stats.WarmedBytes-in0.Stats.WarmedBytes)
	}
}

// TestCountsFastPathOff: with the fast path off (Config.FastPath) a checkpoint and a restore with a
// session running carry files only, and are counted as such.
func TestCountsFastPathOff(t *testing.T) {
	root := testutil.NewStore(t)
	cfg := state.DefaultConfig()
	cfg.FastPath = false
	m := openWith(t, root, cfg)
	defer m.Close()
	ctx := context.Background()
	if _, err := m.Create(ctx, state.CreateOptions{ID: "off"}); err != nil {
		t.Fatal(err)
	}
	call(t, m, "off", "main", "V=1")
	r, err := m.Checkpoint(ctx, "off", "")
	if err != nil || r.Processes != 0 {
		t.Fatalf("checkpoint: %v %+v", err, r)
	}
	if r, err := m.Restore(ctx, "off", r.Node.ID); err != nil || r.Processes != 0 {
		t.Fatalf("restore: %v %+v", err, r)
	}
	info, _ := m.Get("off")
	want := state.PathCounts{FilesOnly: 1, FastPathOff: 1}
	if info.Stats.CheckpointPaths != want || info.Stats.RestorePaths != want || info.Stats.ProcessCheckpoints != 0 {
		t.Fatalf("counts: %+v", info.Stats)
	}
}

// TestSlowStepKeepsTheNamespaceFd: the namespace fd the processes move (or are revived)
// into is let go only after the operation, however long its steps take. A step slowed
// past the background gate's bound (a loaded machine: the answer delay plus
// maxGateWait) after the first of two processes moved or was revived must not see the
// fd closed under the second ("open the new state's namespace: no such file").
func TestSlowStepKeepsTheNamespaceFd(t *testing.T) {
	root := testutil.NewStore(t)
	m := open(t, root)
	defer m.Close()
	ctx := context.Background()
	const id = "slow"
	if _, err := m.Create(ctx, state.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	if _, err := m.StartSession(ctx, id, state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	call(t, m, id, "main", "V=1")
	call(t, m, id, "py", "x = 1")
	slow := func(op string, k int) error {
		if (op == "checkpoint" && k == state.CheckpointStepCount-1) || (op == "restore" && k == state.RestoreStepCount-1) {
			time.Sleep(200 * time.Millisecond)
		}
		return nil
	}
	state.SetFailStep(m, slow)
	n, err := m.Checkpoint(ctx, id, "")
	state.SetFailStep(m, nil)
	if err != nil || n.Processes != 2 {
		t.Fatalf("slow checkpoint: %v %+v", err, n)
	}
	call(t, m, id, "main", "V=2")
	state.SetFailStep(m, slow)
	r, err := m.Restore(ctx, id, n.Node.ID)
	state.SetFailStep(m, nil)
	if err != nil || r.Processes != 2 {
		t.Fatalf("slow restore: %v %+v", err, r)
	}
	if out := call(t, m, id, "main", "echo $V"); out != "1\n" {
		t.Fatalf("bash after the restore: %q", out)
	}
	if out := call(t, m, id, "py", "print(x)"); out != "1\n" {
		t.Fatalf("python after the restore: %q", out)
	}
}

// TestRemoveWhileParking: a sandbox removed right after a checkpoint, while the
// checkpoint's templates are being parked and copied for their durable images, is
// removed at once and leaves no process. Parking runs without opMu; it once made a new
// tracer for the sandbox whose Remove had just closed its own, seized a template with
// it, and the killed init then waited for ever for that template's zombie to be reaped.
func TestRemoveWhileParking(t *testing.T) {
	root := testutil.NewStore(t)
	cfg := state.DefaultConfig()
	cfg.StopSandboxes = true
	st, err := store.Open(root)
	if err != nil {
		t.Fatal(err)
	}
	cgroup.SetRootFor(root, store.DefaultRoot)
	m, err := state.New(st, slog.New(slog.NewTextHandler(io.Discard, nil)), cfg) // durable images on
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	ctx := context.Background()
	for i := 0; i < 3; i++ {
		id := fmt.Sprintf("park%d", i)
		if _, err := m.Create(ctx, state.CreateOptions{ID: id}); err != nil {
			t.Fatal(err)
		}
		if _, err := m.StartSession(ctx, id, state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
			t.Fatal(err)
		}
		call(t, m, id, "py", "x = 1")
		if _, err := m.Checkpoint(ctx, id, ""); err != nil {
			t.Fatal(err)
		}
		// The tracer is closed and the sandbox not yet destroyed: the parking (2 ms
		// after the answer) runs in between.
		state.SetFailStep(m, func(op string, k int) error {
			if op == "remove" {
				time.Sleep(300 * time.Millisecond)
			}
			return nil
		})
		before := sandboxProcs(t, id)
		start := time.Now()
		err := m.Remove(id)
		state.SetFailStep(m, nil)
		if err != nil {
			t.Fatalf("remove %s: %v (after %v)", id, err, time.Since(start))
		}
		for p := range before {
			if _, err := os.Stat(fmt.Sprintf("/proc/%d", p)); err == nil {
				t.Errorf("remove %s left process %d (of %v)", id, p, before)
			}
		}
	}
}

// comm is host PID h's command name.
func comm(h int) string {
	b, _ := os.ReadFile("/proc/" + strconv.Itoa(h) + "/comm")
	return strings.TrimSpace(string(b))
}

// TestHostPidIsTheSandboxProcess: sandbox.HostPid, which a checkpoint asks for each
// session's process, answers the host PID whose NSpid has the sandbox PID at the
// sandbox's level, for every process of the sandbox (init, a session's, a background
// job's), and refuses a PID no process has.
func TestHostPidIsTheSandboxProcess(t *testing.T) {
	root := testutil.NewStore(t)
	m := open(t, root)
	defer m.Close()
	ctx := context.Background()
	const id = "hostpid"
	if _, err := m.Create(ctx, state.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	if _, err := m.StartSession(ctx, id, state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	rt, err := state.Runtime(m, id)
	if err != nil {
		t.Fatal(err)
	}
	sh(t, m, id, "sleep 300 >/dev/null 2>&1 &")
	initNS, err := procfs.NSpid(rt.InitPid())
	if err != nil {
		t.Fatal(err)
	}
	level := len(initNS) - 1 // the sandbox's namespace in an NSpid line
	want := map[int]int{}    // sandbox PID -> host PID
	var bg int
	if why := settle(func() string {
		clear(want)
		for h := range sandboxProcs(t, id) {
			ns, err := procfs.NSpid(h)
			if err != nil || len(ns) <= level {
				continue
			}
			want[ns[level]] = h
			if comm(h) == "sleep" {
				bg = ns[level]
			}
		}
		if bg == 0 || len(want) < 3 {
			return fmt.Sprintf("no background sleep among %v", want)
		}
		return ""
	}); why != "" {
		t.Fatal(why)
	}
	most := 0
	for pid, h := range want {
		got, ok, err := rt.HostPid(pid)
		if !ok {
			t.Skipf("this kernel has no NS_GET_PID_FROM_PIDNS (Linux 6.9): HostPid falls back to /proc")
		}
		if err != nil || got != h {
			t.Errorf("HostPid(%d) = %d, %v; want %d", pid, got, err, h)
		}
		most = max(most, pid)
	}
	if got, _, err := rt.HostPid(most + 1000); err == nil {
		t.Errorf("HostPid(%d), a PID no process has: %d, want an error", most+1000, got)
	}
}
