package security

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/testutil"
)

// attacks is run by python3 inside a sandbox (the default image has no compiler): one
// attempt per class of what real root with every capability reaches in the host's
// kernel, each printing "NAME: WORKS ..." when it got through and "NAME: refused ..."
// otherwise. None changes the host when it works: files are opened for writing and
// not written, settimeofday gets no time, swapon no swap file, the bpf map and perf
// event are closed at once.
const attacks = `
import ctypes, ctypes.util, errno, os, struct, subprocess
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def sc(nr, *a):
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(x) if isinstance(x, int) else x for x in a])
    return r, ctypes.get_errno()
def report(name, ok, detail=""):
    print("%s: %s" % (name, "WORKS" if ok else "refused " + detail), flush=True)
def err(e):
    return errno.errorcode.get(e, str(e))
def mount(src, target, fstype, opts=None):
    os.makedirs(target, exist_ok=True)
    r = libc.mount(src.encode(), target.encode(), fstype.encode(), 0, opts.encode() if opts else None)
    return r, ctypes.get_errno()
def open_w(path):
    try:
        os.close(os.open(path, os.O_WRONLY))
        return True, ""
    except OSError as e:
        return False, e.strerror

# 1. A fresh proc mount: core_pattern runs a program as host root on any crash.
r, e = mount("proc", "/tmp/atk-proc", "proc")
if r == 0:
    ok, why = open_w("/tmp/atk-proc/sys/kernel/core_pattern")
    report("proc-mount-core_pattern", ok, why)
else:
    report("proc-mount-core_pattern", False, err(e))
# 2. The sandbox's own /proc/sys.
ok, why = open_w("/proc/sys/kernel/core_pattern")
report("proc-sys-write", ok, why)
# 3. cgroup v1 release_agent through a fresh mount of the memory hierarchy.
r, e = mount("cgroup", "/tmp/atk-cg", "cgroup", "memory")
if r == 0:
    ok, why = open_w("/tmp/atk-cg/release_agent")
    report("cgroup-release_agent", ok, why)
else:
    report("cgroup-release_agent", False, err(e))
# 4. sysfs knobs.
r, e = mount("sysfs", "/tmp/atk-sys", "sysfs")
if r == 0:
    ok, why = open_w("/tmp/atk-sys/kernel/mm/transparent_hugepage/enabled")
    report("sysfs-write", ok, why)
else:
    report("sysfs-write", False, err(e))
# 5. The clock: settimeofday(NULL, NULL) checks the permission and sets nothing.
r, e = sc(164, None, None)
report("settimeofday", r == 0, err(e))
# 6. Swap: with the permission, swapon of a missing file fails with ENOENT.
r, e = sc(167, b"/nonexistent-swap", 0)
report("swapon", r == 0 or e != errno.EPERM, err(e))
# 7. bpf: an array map (BPF_MAP_CREATE, type 2, key 4, value 4, one entry).
attr = ctypes.create_string_buffer(struct.pack("IIII", 2, 4, 4, 1) + bytes(128))
r, e = sc(321, 0, attr, 144)
report("bpf", r >= 0, err(e))
if r >= 0: os.close(r)
# 8. perf_event_open system-wide: a software cpu-clock counter, pid -1, cpu 0.
attr = ctypes.create_string_buffer(struct.pack("IIQ", 1, 64, 0) + bytes(48))
r, e = sc(298, attr, -1, 0, -1, 0)
report("perf-system-wide", r >= 0, err(e))
if r >= 0: os.close(r)
# 9. userfaultfd and io_uring.
r, e = sc(323, os.O_CLOEXEC)
report("userfaultfd", r >= 0, err(e))
if r >= 0: os.close(r)
params = ctypes.create_string_buffer(120)
r, e = sc(425, 1, params)
report("io_uring_setup", r >= 0, err(e))
if r >= 0: os.close(r)
# 10. The host root's keyrings (KEYCTL_GET_KEYRING_ID of the user keyring).
r, e = sc(250, 0, -4, 0)
report("keyring", r >= 0, err(e))
# 11. A block device node (the store's loop devices are major 7), and the kernel log's.
try:
    os.mknod("/tmp/atk-loop", 0o600 | 0o060000, os.makedev(7, 0))
    try:
        os.close(os.open("/tmp/atk-loop", os.O_RDONLY))
        report("mknod-block", True, "made and opened")
    except OSError as x:
        report("mknod-block", False, "made, open: " + x.strerror)
except OSError as x:
    report("mknod-block", False, x.strerror)
# 12. open_by_handle_at: a handle of /dev/null opened from the /dev mount (tmpfs
# exports handles); with an fd on any other filesystem it reaches past the root.
fh = ctypes.create_string_buffer(struct.pack("Ii", 128, 0) + bytes(128))
mid = ctypes.c_int()
r, e = sc(303, -100, b"/dev/null", fh, ctypes.byref(mid), 0)
if r == 0:
    d = os.open("/dev", os.O_RDONLY | os.O_DIRECTORY)
    r, e = sc(304, d, fh, os.O_RDONLY)
    report("open_by_handle_at", r >= 0, err(e))
else:
    report("open_by_handle_at", False, "name_to_handle_at: " + err(e))
# 13. Namespaces: unshare a mount and a user namespace, setns (into its own).
for name, flag in (("unshare-mnt", 0x20000), ("unshare-user", 0x10000000)):
    pid = os.fork()
    if pid == 0:
        r, e = sc(272, flag)
        os._exit(0 if r == 0 else 1)
    report(name, os.waitpid(pid, 0)[1] == 0)
try:
    fd = os.open("/proc/self/ns/mnt", os.O_RDONLY)  # /proc/1/ns: EACCES now, init has more capabilities
    pid = os.fork()
    if pid == 0:
        r, e = sc(308, fd, 0)
        os._exit(0 if r == 0 else 1)
    report("setns", os.waitpid(pid, 0)[1] == 0)
except OSError as x:
    report("setns", False, "open: " + x.strerror)
# 14. The kernel log (syslog(SYSLOG_ACTION_SIZE_BUFFER)) and kallsyms' addresses.
# (This kernel has no /proc/kcore or /proc/sysrq-trigger: they are masked, untested.)
r, e = sc(103, 10, None, 0)
report("syslog", r >= 0, err(e))
with open("/proc/kallsyms") as f:
    addrs = [l.split()[0] for _, l in zip(range(50), f)]
report("kallsyms", any(int(a, 16) != 0 for a in addrs), addrs[0] if addrs else "")
`

// TestPrivilegeAttacks: real root with every capability (bar CAP_LINUX_IMMUTABLE) and
// a keyrings-only seccomp filter reached the host's kernel from inside a sandbox in
// every way listed in attacks. Each must be refused, and the host's core_pattern,
// swaps and memory cgroup release_agent be unchanged, the daemon answering and a
// second sandbox's file intact.
func TestPrivilegeAttacks(t *testing.T) {
	d := testutil.StartDaemon(t)
	for _, id := range []string{"sec-priv", "sec-priv-victim"} {
		if _, err := d.C.Create(ctx(t), apitypes.CreateOptions{ID: id}); err != nil {
			t.Fatal(err)
		}
	}
	sh(t, d, "sec-priv-victim", "echo victim > /root/v")
	host := func() map[string]string {
		m := map[string]string{}
		for _, p := range []string{"/proc/sys/kernel/core_pattern", "/proc/swaps", "/sys/fs/cgroup/memory/release_agent",
			"/sys/kernel/mm/transparent_hugepage/enabled"} {
			b, _ := os.ReadFile(p)
			m[p] = string(b)
		}
		return m
	}
	before := host()

	r, err := d.C.Exec(ctx(t), "sec-priv", apitypes.ExecRequest{Argv: []string{"python3", "-c", attacks}, TimeoutMS: 60_000})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("attacks (exit %d):\n%s%s", r.ExitCode, r.Stdout, r.Stderr)
	n := 0
	for _, l := range strings.Split(strings.TrimSpace(r.Stdout), "\n") {
		name, res, _ := strings.Cut(l, ": ")
		n++
		if strings.HasPrefix(res, "WORKS") {
			t.Errorf("attack %s got through: %s", name, res)
		}
	}
	if n < 18 || r.ExitCode != 0 {
		t.Fatalf("the attack script did not run to its end (%d results, exit %d): %s", n, r.ExitCode, r.Stderr)
	}

	after := host()
	for p, v := range before {
		if after[p] != v {
			t.Errorf("host's %s changed: %q -> %q", p, v, after[p])
		}
	}
	if out := sh(t, d, "sec-priv-victim", "cat /root/v"); out != "victim\n" {
		t.Errorf("victim sandbox's file: %q", out)
	}
}

// TestAgentToolsWork: what agents run still works under the filter and the bounded
// capabilities: bash, python (threads, subprocess, multiprocessing), git, perl, and
// ptrace of one's own child (gdb and strace do that; neither is in the default image).
func TestAgentToolsWork(t *testing.T) {
	d := testutil.StartDaemon(t)
	if _, err := d.C.Create(ctx(t), apitypes.CreateOptions{ID: "sec-tools"}); err != nil {
		t.Fatal(err)
	}
	const script = `set -e
cd /root
python3 - <<'EOF'
import ctypes, os, signal, subprocess, threading, multiprocessing, time
t = threading.Thread(target=lambda: None); t.start(); t.join()
assert subprocess.run(["true"]).returncode == 0
with multiprocessing.Pool(2) as p: assert p.map(abs, [-1, -2]) == [1, 2]
libc = ctypes.CDLL(None, use_errno=True)
pid = os.fork()
if pid == 0:
    time.sleep(30); os._exit(0)
assert libc.ptrace(16, pid, None, None) == 0, os.strerror(ctypes.get_errno())  # PTRACE_ATTACH
os.waitpid(pid, 0)
assert libc.ptrace(17, pid, None, None) == 0                                    # PTRACE_DETACH
os.kill(pid, signal.SIGKILL); os.waitpid(pid, 0)
assert libc.personality(0x0040000) >= 0, "personality(ADDR_NO_RANDOMIZE) as gdb does"
print("python ok")
EOF
git init -q repo && cd repo && echo a > f && git add f && git -c user.name=a -c user.email=a@b commit -qm one && echo git ok
perl -e 'print "perl ok\n"'
ping -c1 -W1 127.0.0.1 >/dev/null 2>&1 && echo ping ok || echo ping absent
`
	r, err := d.C.Exec(ctx(t), "sec-tools", apitypes.ExecRequest{Argv: []string{"bash", "-c", script}, TimeoutMS: 60_000})
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"python ok", "git ok", "perl ok"} {
		if !strings.Contains(r.Stdout, want) {
			t.Errorf("%q missing (exit %d):\n%s%s", want, r.ExitCode, r.Stdout, r.Stderr)
		}
	}
}

// TestDeviceNodeInLayerCannotBeOpened: a device node in a layer (an image's, or one
// made while the sandbox had CAP_MKNOD) cannot be opened from inside: overlays are
// mounted nodev. The node is planted from the host, in the sandbox's upper (the layer
// its record names), as a character device 1:3 (/dev/null: harmless if opened).
func TestDeviceNodeInLayerCannotBeOpened(t *testing.T) {
	d := testutil.StartDaemon(t)
	in, err := d.C.Create(ctx(t), apitypes.CreateOptions{ID: "sec-nodev"})
	if err != nil {
		t.Fatal(err)
	}
	node := filepath.Join(d.Root, "layers", strconv.FormatUint(in.Upper, 10), "diff", "planted-null")
	if err := syscall.Mknod(node, syscall.S_IFCHR|0o666, 1<<8|3); err != nil {
		t.Fatal(err)
	}
	out := sh(t, d, "sec-nodev", `python3 -c "
import os
try:
    os.close(os.open('/planted-null', os.O_RDONLY)); print('opened')
except OSError as e:
    print(e.strerror)"`)
	if out != "Permission denied\n" {
		t.Fatalf("opening a device node of a layer from inside: %q, want Permission denied (nodev)", out)
	}
}

// TestLeastPrivilegeAcrossCheckpointAndRestore: the filter, the bounded capabilities
// and the /proc masks are those of every process of the sandbox in every state: a bash
// and a python session, as started, after a checkpoint (moved onto a new namespace) and
// after a restore (forked from their templates by injected clone3, seized with
// PTRACE_O_SUSPEND_SECCOMP, then detached: the python makes the refused call itself, so
// its filter is not left suspended).
func TestLeastPrivilegeAcrossCheckpointAndRestore(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "sec-priv-cr"
	if _, err := d.C.Create(ctx(t), apitypes.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	if _, err := d.C.StartSession(ctx(t), id, apitypes.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	run := func(sess, code string) string {
		t.Helper()
		r, err := d.C.Run(ctx(t), id, sess, code, 30*time.Second)
		if err != nil {
			t.Fatalf("%s: %q: %v", sess, code, err)
		}
		return r.Stdout
	}
	run("py", "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)")
	// CapBnd: CHOWN DAC_OVERRIDE FOWNER FSETID KILL SETGID SETUID SETPCAP
	// NET_BIND_SERVICE NET_RAW SYS_CHROOT SYS_ADMIN AUDIT_WRITE SETFCAP.
	const bash = `grep -E '^(CapBnd|CapEff|CapInh|Seccomp):' /proc/$$/status | tr -s '\t' ' '
unshare -m true 2>/dev/null && echo unshared
echo x 2>/dev/null > /proc/sys/kernel/hostname || echo sysctl read-only
grep -c ' /proc/' /proc/self/mountinfo`
	const wantBash = "CapInh: 0000000000000000\nCapEff: 00000000a02425fb\nCapBnd: 00000000a02425fb\nSeccomp: 2\nsysctl read-only\n"
	const py = "print(libc.unshare(0x20000), ctypes.get_errno(), open('/proc/self/status').read().count('Seccomp:\\t2'))"
	check := func(when string) {
		t.Helper()
		got := run("main", bash)
		if !strings.HasPrefix(got, wantBash) {
			t.Errorf("bash session %s:\n%s\nwant it to begin with\n%s", when, got, wantBash)
		}
		// The masks that this kernel has files for (keys, timer_list, sched_debug, bus, fs,
		// irq, sys: sbinit.MaskProc) are mounts under /proc in every state's namespace.
		if n, _ := strconv.Atoi(strings.TrimSpace(strings.TrimPrefix(got, wantBash))); n < 7 {
			t.Errorf("bash session %s: %d mounts under /proc, want the masks:\n%s", when, n, got)
		}
		if got := run("py", py); got != "-1 1 1\n" {
			t.Errorf("python session %s: unshare, errno, filtered: %q, want \"-1 1 1\"", when, got)
		}
	}
	check("as started")
	op, err := d.C.Checkpoint(ctx(t), id, "one")
	if err != nil || op.Processes != 2 {
		t.Fatalf("checkpoint: %v %+v", err, op)
	}
	check("after a checkpoint")
	run("main", "echo after > /root/after")
	if _, err := d.C.Restore(ctx(t), id, op.Node.ID); err != nil {
		t.Fatal(err)
	}
	check("after a restore")
}
