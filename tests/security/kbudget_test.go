package security

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"deltabox/internal/apitypes"
	"deltabox/internal/hostids"
	"deltabox/internal/testutil"
)

// The kernel's per-user budgets (inotify instances, POSIX message-queue bytes, queued
// signals) are charged to the user at every level of user namespaces up to the
// initial one, where a sandbox's charge goes to its user namespace's owner: with every
// sandbox's namespace owned by host root, one sandbox used them up for all the others
// and for root of the host.

// budgetPy defines, for python3 in a sandbox or on the host, one attempt at each
// budget: inotify_init1, mq_open of a 10 x 8 KiB queue (what an unprivileged user may
// ask; about 82 KB of RLIMIT_MSGQUEUE), rt_sigqueueinfo of a blocked RT signal to
// itself (si_code SI_QUEUE: checked against RLIMIT_SIGPENDING, where kill(2) is not).
// Each returns (result, errno name).
const budgetPy = `
import ctypes, errno, os, signal, struct, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
class MqAttr(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_long), ("maxmsg", ctypes.c_long), ("msgsize", ctypes.c_long),
                ("curmsgs", ctypes.c_long), ("pad", ctypes.c_long * 4)]
def err():
    return errno.errorcode.get(ctypes.get_errno(), "?")
def inotify():
    fd = libc.inotify_init1(os.O_CLOEXEC)
    return fd, err()
def mq(name):
    a = MqAttr(0, 10, 8192, 0)
    fd = libc.mq_open(name.encode(), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600, ctypes.byref(a))
    return fd, err()
SIG = int(signal.SIGRTMIN) + 3
signal.pthread_sigmask(signal.SIG_BLOCK, [SIG])
info = struct.pack("iii", SIG, 0, -1) + bytes(116)
def sigq():
    r = libc.syscall(129, os.getpid(), SIG, info)
    return r, err()
`

// hogPy takes as much of each budget as it is given, reports "NAME COUNT ERRNO" for
// each on stdout and in /tmp/hog.out, then holds it all (fds, queues, pending signals)
// until killed.
const hogPy = budgetPy + `
out = []
fds = []
while len(fds) < 100000:
    fd, e = inotify()
    if fd < 0: break
    fds.append(fd)
out.append("inotify %d %s" % (len(fds), e))
n = 0
while n < 1000:
    fd, e = mq("/hog-%d-%d" % (os.getpid(), n))
    if fd < 0: break
    os.close(fd)
    n += 1
out.append("mq %d %s" % (n, e))
n = 0
while n < 10000000:
    r, e = sigq()
    if r < 0: break
    n += 1
out.append("sig %d %s" % (n, e))
print("\n".join(out), flush=True)
open("/tmp/hog.out", "w").write("\n".join(out) + "\n")
while True: time.sleep(60)
`

// checkPy makes one attempt at each budget and reports "NAME ok" or "NAME ERRNO".
const checkPy = budgetPy + `
fd, e = inotify()
print("inotify", "ok" if fd >= 0 else e)
name = "/check-%d" % os.getpid()
fd, e = mq(name)
print("mq", "ok" if fd >= 0 else e)
if fd >= 0: libc.mq_unlink(name.encode())
r, e = sigq()
print("sig", "ok" if r >= 0 else e)
`

// nsOwner is the owner uid of pid's user namespace (ioctl NS_GET_OWNER_UID).
func nsOwner(t *testing.T, pid int) uint32 {
	t.Helper()
	f, err := os.Open(fmt.Sprintf("/proc/%d/ns/user", pid))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var uid uint32
	const nsGetOwnerUID = 0xb704 // _IO(0xb7, 0x4), linux/nsfs.h
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), nsGetOwnerUID, uintptr(unsafe.Pointer(&uid))); e != 0 {
		t.Fatalf("NS_GET_OWNER_UID of pid %d: %v", pid, e)
	}
	return uid
}

// parseBudget reads "NAME VALUE [VALUE]" lines into NAME -> fields.
func parseBudget(s string) map[string][]string {
	m := map[string][]string{}
	for _, l := range strings.Split(strings.TrimSpace(s), "\n") {
		if f := strings.Fields(l); len(f) >= 2 {
			m[f[0]] = f[1:]
		}
	}
	return m
}

// wantAllOK fails the test for each budget that check's output does not report ok.
func wantAllOK(t *testing.T, who, out string) {
	t.Helper()
	got := parseBudget(out)
	for _, name := range []string{"inotify", "mq", "sig"} {
		if v := got[name]; len(v) != 1 || v[0] != "ok" {
			t.Errorf("%s: %s refused while another sandbox holds its whole budget: %v (output %q)", who, name, v, out)
		}
	}
}

// TestKernelBudgetsPerSandbox: sandbox A takes every inotify instance, message-queue
// byte and queued signal it is given, and holds them. Sandbox B, and root of the host,
// still get each; A's user namespace is owned by A's uid base, whose count on the host
// A has used up; once A is removed that count is free again: A's message queues, which
// outlive their process in the IPC namespace, went with it.
func TestKernelBudgetsPerSandbox(t *testing.T) {
	py, err := exec.LookPath("/usr/bin/python3")
	testutil.Require(t, err == nil, "no /usr/bin/python3 on the host for the host's own attempt: %v", err)
	d := testutil.StartDaemon(t)
	c := ctx(t)
	a, err := d.C.Create(c, apitypes.CreateOptions{ID: "kb-a"})
	if err != nil {
		t.Fatal(err)
	}
	create(t, d, apitypes.CreateOptions{ID: "kb-b"})

	// A's hog runs in a session, which outlives the call that started it.
	if _, err := d.C.StartSession(c, "kb-a", apitypes.SessionOptions{Name: "hog", Argv: []string{"python3", "-c", hogPy}}); err != nil {
		t.Fatal(err)
	}
	var hog string
	for deadline := time.Now().Add(60 * time.Second); ; {
		hog = sh(t, d, "kb-a", "cat /tmp/hog.out 2>/dev/null")
		if strings.Count(hog, "\n") >= 3 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("sandbox A's hog did not report within 60 s: %q", hog)
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Logf("sandbox A (uid base %d) took:\n%s", a.UIDBase, hog)
	// The mechanism: A's user namespace is owned by A's own uid base.
	pids := hostPidsWith(t, "/tmp/hog.out")
	if len(pids) != 1 {
		t.Fatalf("host PIDs of A's hog: %v, want one", pids)
	}
	if owner := nsOwner(t, pids[0]); owner != a.UIDBase {
		t.Errorf("sandbox A's user namespace is owned by host uid %d, want its uid base %d", owner, a.UIDBase)
	}
	taken := parseBudget(hog)
	for name, want := range map[string]string{"inotify": "EMFILE", "mq": "EMFILE", "sig": "EAGAIN"} {
		v := taken[name]
		if len(v) != 2 || v[1] != want {
			t.Fatalf("sandbox A's hog did not exhaust %s (want %s at the end): %v", name, want, v)
		}
		if n, _ := strconv.Atoi(v[0]); n == 0 {
			t.Errorf("sandbox A got no %s at all: %v", name, v)
		}
	}

	r, err := d.C.Exec(c, "kb-b", apitypes.ExecRequest{Argv: []string{"python3", "-c", checkPy}, TimeoutMS: 30_000})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("sandbox B:\n%s%s", r.Stdout, r.Stderr)
	wantAllOK(t, "sandbox B", r.Stdout)

	out, err := testutil.Command(t, 30*time.Second, py, "-c", checkPy).CombinedOutput()
	if err != nil {
		t.Fatalf("host check: %v\n%s", err, out)
	}
	t.Logf("root of the host:\n%s", out)
	wantAllOK(t, "root of the host", string(out))

	// A host process running as A's owner is charged at the same place as A (the
	// host's count of that uid): refused while A holds it all, served once A is gone
	// (its queues, which outlive their process in its IPC namespace, with it; the
	// namespace is freed after an RCU grace period: polled).
	owner := func() string {
		cmd := testutil.Command(t, 30*time.Second, py, "-c", checkPy)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: a.UIDBase, Gid: a.UIDBase}}
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("check as A's owner %d on the host: %v\n%s", a.UIDBase, err, out)
		}
		return string(out)
	}
	held := parseBudget(owner())
	for name, want := range map[string]string{"inotify": "EMFILE", "mq": "EMFILE", "sig": "EAGAIN"} {
		if v := held[name]; len(v) != 1 || v[0] != want {
			t.Errorf("the host's count of A's owner while A holds its budget: %s %v, want %s (is A charged to its owner?)", name, v, want)
		}
	}
	if err := d.C.Remove(c, "kb-a"); err != nil {
		t.Fatal(err)
	}
	var after string
	removed := time.Now()
	for deadline := removed.Add(10 * time.Second); ; {
		after = owner()
		if strings.Count(after, " ok") == 3 || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("A's owner on the host %v after A was removed:\n%s", time.Since(removed).Round(time.Millisecond), after)
	wantAllOK(t, "A's owner after A was removed", after)
}

// TestIDRangesUniquePerHost: two daemons on one host, on stores of their own, create
// sandboxes at the same time; no two sandboxes get the same host id range (each
// daemon picked the lowest range it did not use itself, and both gave their first
// sandbox 2^30: one sandbox's root then owned the other's processes and files). A
// removed sandbox gives its range back to the host's record.
func TestIDRangesUniquePerHost(t *testing.T) {
	d1, d2 := testutil.StartDaemon(t), testutil.StartDaemon(t)
	type made struct {
		who  string
		base uint32
		err  error
	}
	ch := make(chan made)
	for i, d := range []*testutil.Daemon{d1, d2} {
		for j := range 3 {
			go func() {
				id := fmt.Sprintf("ids-%d-%d", i, j)
				info, err := d.C.Create(ctx(t), apitypes.CreateOptions{ID: id})
				if err != nil {
					ch <- made{who: id, err: err}
					return
				}
				ch <- made{who: id, base: info.UIDBase}
			}()
		}
	}
	by := map[uint32]string{}
	for range 6 {
		m := <-ch
		if m.err != nil {
			t.Fatalf("create %s: %v", m.who, m.err)
		}
		if m.base == 0 {
			t.Fatalf("sandbox %s has no id range", m.who)
		}
		if o, ok := by[m.base]; ok {
			t.Errorf("sandboxes %s and %s (two daemons' or one's) share the host uid base %d", o, m.who, m.base)
		}
		by[m.base] = m.who
	}
	// Their roots are distinct host users: a process of one is not the other's.
	a := sh(t, d1, "ids-0-0", "cat /proc/self/uid_map")
	b := sh(t, d2, "ids-1-0", "cat /proc/self/uid_map")
	t.Logf("uid maps: %q, %q", a, b)
	if a == b {
		t.Errorf("two daemons' sandboxes have the same uid map %q", a)
	}
	// The lowest range, given back by its sandbox, goes to the other daemon's next one.
	low := uint32(0)
	for b := range by {
		if low == 0 || b < low {
			low = b
		}
	}
	from, other := d1, d2
	if strings.HasPrefix(by[low], "ids-1-") {
		from, other = d2, d1
	}
	reg, err := hostids.Open(hostids.DefaultDir, hostids.Ranges{First: 1 << 30, Size: 1 << 16, Count: 1 << 14})
	if err != nil {
		t.Fatal(err)
	}
	if h, live, err := reg.Holder(low); err != nil || !live || h.Sandbox != by[low] {
		t.Fatalf("the host's record of uid base %d: %+v live %v (%v), want %s's", low, h, live, err, by[low])
	}
	if err := from.C.Remove(ctx(t), by[low]); err != nil {
		t.Fatal(err)
	}
	// Given back: free, or already another sandbox's (other tests' daemons run too).
	if h, live, err := reg.Holder(low); err != nil || live && h.Sandbox == by[low] && h.Dir == filepath.Join(from.Root, "sandboxes", by[low]) {
		t.Errorf("after %s was removed the host's record of uid base %d still names it: %+v (%v)", by[low], low, h, err)
	}
	// And the other daemon hands out ranges still (the lowest free one, whatever it is).
	if info, err := other.C.Create(ctx(t), apitypes.CreateOptions{ID: "ids-next"}); err != nil || info.UIDBase == 0 {
		t.Fatalf("create after a release: %+v %v", info, err)
	}
}
