package security

import (
	"encoding/json"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/testutil"
)

// ptracePy is python3 (ctypes; the default image has no compiler, gdb nor strace)
// shared by the forger and the probe: forge(pid) seizes pid and, at the entry of its
// exit_group, rewrites the argument to 0; it returns the wait status it saw last.
const ptracePy = `
import ctypes, json, os, signal, sys, threading, time
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
libc.ptrace.restype = ctypes.c_long
libc.syscall.restype = ctypes.c_long
SEIZE, INTERRUPT, SYSCALL, GETREGS, SETREGS, DETACH = 0x4206, 0x4207, 24, 12, 13, 17
class Regs(ctypes.Structure):
    _fields_ = [(n, ctypes.c_ulonglong) for n in "r15 r14 r13 r12 rbp rbx r11 r10 r9 r8 rax rcx rdx rsi rdi orig_rax rip cs eflags rsp ss fs_base gs_base ds es fs gs".split()]
def log(*a):
    print(*a, file=sys.stderr, flush=True)
def forge(pid, started=None):
    if libc.ptrace(SEIZE, pid, None, 1) != 0:  # PTRACE_O_TRACESYSGOOD
        e = ctypes.get_errno()
        log('seize', pid, 'errno', e)
        return -e
    log('seized', pid)
    libc.ptrace(INTERRUPT, pid, None, None)
    while True:
        try:
            _, st = os.waitpid(pid, 0x40000000)  # __WALL
        except ChildProcessError:
            return None
        if os.WIFEXITED(st) or os.WIFSIGNALED(st):
            return st
        if started:
            started(); started = None
        s, sig = os.WSTOPSIG(st), 0
        if s == signal.SIGTRAP | 0x80:
            r = Regs()
            libc.ptrace(GETREGS, pid, None, ctypes.byref(r))
            if r.orig_rax == 231 and r.rdi != 0:  # exit_group(code)
                r.rdi = 0
                libc.ptrace(SETREGS, pid, None, ctypes.byref(r))
                log('forged', pid)
        elif st >> 16 != 128:  # not PTRACE_EVENT_STOP: a signal to pass on
            sig = s
        libc.ptrace(SYSCALL, pid, None, sig)
`

// forgerPy runs in the background: each process whose command line holds
// reversed(argv[1]) is forged (forge); with argv[2] == "thread" it has a second
// thread, so that a checkpoint takes it through CRIU.
const forgerPy = ptracePy + `
marker = sys.argv[1][::-1].encode()
if sys.argv[2] == 'thread':
    threading.Thread(target=time.sleep, args=(100000,), daemon=True).start()
log('forger up', os.getpid())
seen = set()
while True:
    for p in os.listdir('/proc'):
        if p.isdigit() and int(p) not in seen and int(p) != os.getpid():
            try:
                cmd = open('/proc/%s/cmdline' % p, 'rb').read()
            except OSError:
                continue
            if marker in cmd:
                seen.add(int(p))
                forge(int(p))
    time.sleep(0.005)
`

// probePy tries, on pid argv[1] (or, with "own", on a child of its own), what a
// forger would: ptrace, a read-write open of /proc/PID/mem, a read of
// /proc/PID/environ (a grader's secrets), process_vm_readv and
// process_vm_writev (the bytes read written back), pidfd_getfd, a signal (SIGCONT,
// harmless); with "own" also the forge of the child's exit_group(3). It prints the
// errno of each (0: it worked) as JSON, and landlock_create_ruleset's errno.
const probePy = ptracePy + `
class iovec(ctypes.Structure):
    _fields_ = [('base', ctypes.c_void_p), ('len', ctypes.c_size_t)]
def err(rc):
    return 0 if rc >= 0 else ctypes.get_errno()
def probe(pid):
    out = {}
    rc = libc.ptrace(SEIZE, pid, None, None)
    out['ptrace'] = err(rc)
    if rc == 0:  # a seized tracee is detached from a stop
        libc.ptrace(INTERRUPT, pid, None, None)
        os.waitpid(pid, 0x40000000)
        libc.ptrace(DETACH, pid, None, None)
    try:
        os.close(os.open('/proc/%d/mem' % pid, os.O_RDWR))
        out['mem'] = 0
    except OSError as e:
        out['mem'] = e.errno
    try:
        open('/proc/%d/environ' % pid, 'rb').read()
        out['environ'] = 0
    except OSError as e:
        out['environ'] = e.errno
    addr = 0x10000  # unmapped: a write there, if allowed at all, fails with EFAULT
    try:
        for l in open('/proc/%d/maps' % pid):
            a, perms = l.split()[:2]
            if perms.startswith('rw'):
                addr = int(a.split('-')[0], 16)
                break
    except OSError:
        pass
    buf = ctypes.create_string_buffer(8)
    local, remote = iovec(ctypes.cast(buf, ctypes.c_void_p), 8), iovec(addr, 8)
    out['vm_readv'] = err(libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0))
    out['vm_writev'] = err(libc.process_vm_writev(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0))
    pfd = os.pidfd_open(pid)
    rc = libc.syscall(438, pfd, 0, 0)  # pidfd_getfd
    out['pidfd_getfd'] = err(rc)
    if rc >= 0:
        os.close(rc)
    os.close(pfd)
    try:
        os.kill(pid, signal.SIGCONT)
        out['kill'] = 0
    except OSError as e:
        out['kill'] = e.errno
    return out
if sys.argv[1] == 'own':
    r, w = os.pipe()
    c = os.fork()
    if c == 0:
        os.close(w)
        os.read(r, 1)
        os._exit(3)
    os.close(r)
    out = probe(c)
    st = forge(c, started=lambda: os.write(w, b'x'))
    out['own_child_exit'] = os.waitstatus_to_exitcode(st) if st is not None and st >= 0 else st
else:
    out = probe(int(sys.argv[1]))
out['landlock'] = err(libc.syscall(444, None, 0, 1))  # landlock_create_ruleset(VERSION)
print(json.dumps(out))
`

// shq quotes s for a shell.
func shq(s string) string { return "'" + strings.ReplaceAll(s, "'", `'"'"'`) + "'" }

// reverse gives a marker as the forger is told it, so that its own command line does
// not hold it.
func reverse(s string) string {
	b := []byte(s)
	for i, j := 0, len(b)-1; i < j; i, j = i+1, j-1 {
		b[i], b[j] = b[j], b[i]
	}
	return string(b)
}

// TestExitCodeForgerCannotTrace: the attack of issue 24: a background process of the
// sandbox PTRACE_SEIZEs each command the daemon starts and rewrites its exit_group
// argument, so that `exit 3` answers 0; it survived checkpoints and restores. Each
// command now runs in a Landlock domain of its own (internal/landlock), out of the
// forger's reach, and so do the forger's copies: fork keeps a template's domain (fast
// path), and CRIU restores a tree inside a fresh domain (internal/durable). The forger
// must try (its log says so) and fail, before any checkpoint, after a checkpoint and
// after a restore to it, with the forger taken by the fast path and through CRIU.
func TestExitCodeForgerCannotTrace(t *testing.T) {
	d := testutil.StartDaemon(t)
	for _, tc := range []struct {
		name, mode string
		criu       int // processes the checkpoint takes through CRIU
	}{{"fast", "single", 0}, {"criu", "thread", 1}} {
		t.Run(tc.name, func(t *testing.T) {
			id := "sec-forger-" + tc.name
			if _, err := d.C.Create(ctx(t), apitypes.CreateOptions{ID: id}); err != nil {
				t.Fatal(err)
			}
			marker := "victim" + strconv.Itoa(os.Getpid()) + tc.name
			sh(t, d, id, `nohup python3 -c `+shq(forgerPy)+` `+reverse(marker)+` `+tc.mode+` </dev/null >>/tmp/forger.log 2>&1 &
for i in $(seq 500); do grep -q "forger up" /tmp/forger.log && exit 0; sleep 0.01; done; exit 1`)
			attempt := func(when string) {
				t.Helper()
				r, err := d.C.Exec(ctx(t), id, apitypes.ExecRequest{Argv: []string{"bash", "-c", "sleep 1; exit 3", marker}, TimeoutMS: 30_000})
				if err != nil {
					t.Fatalf("%s: victim exec: %v", when, err)
				}
				log := sh(t, d, id, "cat /tmp/forger.log")
				t.Logf("%s: victim exit %d (signal %d); forger's log:\n%s", when, r.ExitCode, r.Signal, log)
				if !strings.Contains(log, "seize") {
					t.Fatalf("%s: the forger did not try (is it running?)", when)
				}
				if r.ExitCode != 3 {
					t.Errorf("%s: exec of `sleep 1; exit 3` answered exit code %d (signal %d), not 3", when, r.ExitCode, r.Signal)
				}
				if strings.Contains(log, "seized") {
					t.Errorf("%s: the forger seized a command the daemon started", when)
				}
				sh(t, d, id, ": > /tmp/forger.log")
			}
			attempt("before any checkpoint")
			cp, err := d.C.CheckpointWith(ctx(t), id, apitypes.CheckpointRequest{Label: "forger"})
			if err != nil {
				t.Fatal(err)
			}
			if cp.CRIUProcesses != tc.criu {
				t.Fatalf("checkpoint took %d processes through CRIU, want %d: %+v", cp.CRIUProcesses, tc.criu, cp)
			}
			attempt("after a checkpoint")
			res, err := d.C.Restore(ctx(t), id, cp.Node.ID)
			if err != nil {
				t.Fatal(err)
			}
			if res.CRIUProcesses != tc.criu {
				t.Fatalf("restore took %d processes through CRIU, want %d: %+v", res.CRIUProcesses, tc.criu, res)
			}
			attempt("after a restore")
		})
	}
}

// probe runs probePy on target ("own", or a PID in the sandbox) as a command of its own.
func probe(t *testing.T, d *testutil.Daemon, id, target string) map[string]int {
	t.Helper()
	r, err := d.C.Exec(ctx(t), id, apitypes.ExecRequest{Argv: []string{"python3", "-c", probePy, target}, TimeoutMS: 30_000})
	if err != nil {
		t.Fatal(err)
	}
	return probeOut(t, target, r)
}

// probeOut is probePy's answer: the last line of its output (a session's terminal
// mixes its log in).
func probeOut(t *testing.T, target string, r *apitypes.ExecResult) map[string]int {
	t.Helper()
	lines := strings.Split(strings.TrimSpace(r.Stdout), "\n")
	var out map[string]int
	if err := json.Unmarshal([]byte(strings.TrimSpace(lines[len(lines)-1])), &out); err != nil {
		t.Fatalf("probe of %s: exit %d, %q %q", target, r.ExitCode, r.Stdout, r.Stderr)
	}
	return out
}

// TestCommandsOutOfEachOthersReach: what a forger would use on a command the daemon
// started, a session's shell and a running exec, from another exec: ptrace, a
// read-write /proc/PID/mem, process_vm_readv/writev and pidfd_getfd are all refused
// (EPERM, or EACCES for the open), and the sandbox cannot make a Landlock domain of
// its own (ENOSYS: the seccomp filter; a domain could not be carried by a CRIU
// restore), nor signal another command (LANDLOCK_SCOPE_SIGNAL).
func TestCommandsOutOfEachOthersReach(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "sec-reach"
	if _, err := d.C.Create(ctx(t), apitypes.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	si, err := d.C.StartSession(ctx(t), id, apitypes.SessionOptions{Name: "main"})
	if err != nil {
		t.Fatal(err)
	}
	marker := "reach" + strconv.Itoa(os.Getpid())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		d.C.Exec(ctx(t), id, apitypes.ExecRequest{Argv: []string{"bash", "-c", "sleep 4; true", marker}, TimeoutMS: 30_000})
	}()
	defer wg.Wait()
	var running string
	for i := 0; i < 300 && running == ""; i++ {
		running = strings.TrimSpace(sh(t, d, id, "pgrep -f '^bash -c sleep 4; true "+marker+"' | head -1"))
		time.Sleep(10 * time.Millisecond)
	}
	if running == "" {
		t.Fatal("the running exec was not found")
	}
	refused := func(e int) bool { return e == 1 || e == 13 } // EPERM, EACCES
	for _, target := range []struct{ what, pid string }{{"a session's shell", strconv.Itoa(si.Pid)}, {"a running exec", running}} {
		out := probe(t, d, id, target.pid)
		t.Logf("%s (pid %s): %v", target.what, target.pid, out)
		for _, k := range []string{"ptrace", "mem", "environ", "vm_readv", "vm_writev", "pidfd_getfd", "kill"} {
			if e, ok := out[k]; !ok || !refused(e) {
				t.Errorf("%s of %s from another command: errno %d, want EPERM or EACCES", k, target.what, e)
			}
		}
		if out["landlock"] != 38 { // ENOSYS
			t.Errorf("landlock_create_ruleset in the sandbox: errno %d, want ENOSYS", out["landlock"])
		}
	}
}

// TestOwnChildrenStillTraceable: what gdb and strace do, on a command's own child,
// still works inside a command and inside a session, before and after a checkpoint
// and restore: ptrace (and the forge of the child's exit_group: a debugger may change
// what its debuggee does), /proc/PID/mem, process_vm_readv/writev, pidfd_getfd and a
// signal. (It guards the domains' design: it passes without them too.)
func TestOwnChildrenStillTraceable(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "sec-own"
	if _, err := d.C.Create(ctx(t), apitypes.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	if _, err := d.C.StartSession(ctx(t), id, apitypes.SessionOptions{Name: "main"}); err != nil {
		t.Fatal(err)
	}
	check := func(when, how string, out map[string]int) {
		t.Helper()
		t.Logf("%s, %s: %v", when, how, out)
		for _, k := range []string{"ptrace", "mem", "environ", "vm_readv", "vm_writev", "pidfd_getfd", "kill", "own_child_exit"} {
			if e, ok := out[k]; !ok || e != 0 {
				t.Errorf("%s, %s: %s on its own child: %d, want 0", when, how, k, e)
			}
		}
	}
	round := func(when string) {
		check(when, "an exec", probe(t, d, id, "own"))
		r, err := d.C.Run(ctx(t), id, "main", "python3 -c "+shq(probePy)+" own", 30*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		check(when, "in a session", probeOut(t, "own", r))
	}
	round("before any checkpoint")
	cp, err := d.C.Checkpoint(ctx(t), id, "own")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.C.Restore(ctx(t), id, cp.Node.ID); err != nil {
		t.Fatal(err)
	}
	round("after a restore")
}

// TestSignalsDoNotForgeZero: a signal from another command no longer reaches an exec
// (LANDLOCK_SCOPE_SIGNAL); on the code before the domains it measured what one did to
// the exec of `sleep 1; exit 3`, sent to the command or to its child: never a forged 0
// by itself (a signal report, or the command's own code), which docs/SECURITY.md
// quotes. Now `kill` fails and the answer is 3.
func TestSignalsDoNotForgeZero(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "sec-signals"
	if _, err := d.C.Create(ctx(t), apitypes.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	for _, sig := range []string{"KILL", "TERM", "INT", "HUP", "QUIT", "USR1", "ALRM", "PIPE"} {
		for _, to := range []string{"command", "child"} {
			marker := "sig" + strconv.Itoa(os.Getpid()) + sig + to
			pick := "pgrep -f '^bash -c sleep 1; exit 3 " + marker + "'"
			if to == "child" {
				pick = "pgrep -P $(" + pick + ")"
			}
			var wg sync.WaitGroup
			var sent string
			wg.Add(1)
			go func() {
				defer wg.Done()
				sent = sh(t, d, id, "for i in $(seq 300); do p=$("+pick+") && [ -n \"$p\" ] && { kill -"+sig+" $p 2>&1; echo sent $?; exit; }; sleep 0.01; done")
			}()
			r, err := d.C.Exec(ctx(t), id, apitypes.ExecRequest{Argv: []string{"bash", "-c", "sleep 1; exit 3", marker}, TimeoutMS: 30_000})
			wg.Wait()
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("SIG%s to the %s: %q; exit code %d, signal %d", sig, to, sent, r.ExitCode, r.Signal)
			if !strings.Contains(sent, "sent") {
				t.Fatalf("SIG%s to the %s: the sender found no target", sig, to)
			}
			if r.ExitCode != 3 || !strings.Contains(sent, "sent 1") {
				t.Errorf("SIG%s to the %s of `sleep 1; exit 3` from another command: kill said %q, exit code %d (signal %d), want EPERM and 3", sig, to, sent, r.ExitCode, r.Signal)
			}
		}
	}
}
