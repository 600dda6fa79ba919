package security

import (
	"strings"
	"testing"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/testutil"
)

// TestLazyRestoreLeavesNoUserfaultfd: a lazy restore from an image (state/lazy.go) has
// CRIU make each restored task's userfaultfd from /dev/userfaultfd, opened as host root
// (scripts/criu/0007), and the lazy-pages server (host root) make its API call. The
// attack, from a python session restored lazily (while its server still copies pages
// and after): find a userfaultfd, or /dev/userfaultfd, among the fds of any process of
// the sandbox (/proc/*/fd), open /dev/userfaultfd, and call userfaultfd(2). Each would
// give the sandbox's code a userfaultfd, which the sandbox's profile refuses (a classic
// aid to kernel races). None may work.
func TestLazyRestoreLeavesNoUserfaultfd(t *testing.T) {
	d := testutil.StartDaemonEnv(t, testutil.NewStore(t), "DELTABOX_LAZY_RESTORE=1")
	const id = "sec-lazy"
	if _, err := d.C.Create(ctx(t), apitypes.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	if _, err := d.C.StartSession(ctx(t), id, apitypes.SessionOptions{Name: "py", Kind: apitypes.SessionPython}); err != nil {
		t.Fatal(err)
	}
	run := func(code string) string {
		t.Helper()
		r, err := d.C.Run(ctx(t), id, "py", code, 60*time.Second)
		if err != nil || r.ExitCode != 0 {
			t.Fatalf("%q: %v %+v", code, err, r)
		}
		return strings.TrimSpace(r.Stdout)
	}
	run("import os, ctypes, glob; x = bytearray(os.urandom(200 << 20))")
	cp, err := d.C.Checkpoint(ctx(t), id, "big")
	if err != nil {
		t.Fatal(err)
	}
	for {
		n, err := d.C.Node(ctx(t), cp.Node.ID)
		if err != nil {
			t.Fatal(err)
		}
		if im := n.ProcessImage; im != nil && im.State == "complete" {
			break
		} else if im != nil && im.State == "failed" {
			t.Fatalf("image: %s", im.Error)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if _, err := d.C.EvictNode(ctx(t), cp.Node.ID); err != nil {
		t.Fatal(err)
	}
	res, err := d.C.Restore(ctx(t), id, cp.Node.ID)
	if err != nil || !res.FromImage || !res.LazyImage {
		t.Fatalf("restore: %v %+v, want a lazy restore from the image", err, res)
	}
	attack := `
found = []
for p in glob.glob('/proc/[0-9]*/fd/*'):
    try:
        l = os.readlink(p)
    except OSError:
        continue
    if 'userfaultfd' in l:
        found.append(p + ' -> ' + l)
try:
    os.close(os.open('/dev/userfaultfd', os.O_RDWR))
    found.append('opened /dev/userfaultfd')
except OSError as e:
    pass
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.syscall(323, 0)
if fd >= 0:
    found.append('userfaultfd(2) gave fd %d' % fd)
print(found)`
	for _, when := range []string{"while the pages come in", "after"} {
		if got := run(attack); got != "[]" {
			t.Fatalf("%s: the lazily restored sandbox reached a userfaultfd: %s", when, got)
		}
		if when == "while the pages come in" {
			run("sum(x[::4096])") // every page in
			time.Sleep(500 * time.Millisecond)
		}
	}
}
