package e2e

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"deltabox/internal/errdefs"
	"deltabox/internal/state"
	"deltabox/internal/testutil"
)

// inotifyWatcher is a python session's code: an inotify fd (the fast path refuses it:
// a fork would share it with the template, so CRIU carries the session) watching for
// files created in a project's directory, in /workspace, in a directory of the session's
// working directory, and in a directory of the image outside every directory DeltaBox
// lists for CRIU (internal/durable/inotify.go: the daemon names it from its handle);
// events() reads what came since its last call.
const inotifyWatcher = `import ctypes, os, struct
libc = ctypes.CDLL(None, use_errno=True)
ino = libc.inotify_init1(os.O_NONBLOCK)
os.chdir("/usr/src/app")
wds = [libc.inotify_add_watch(ino, p, 0x100) for p in (b"/workspace/proj/src", b"/workspace", b"/usr/src/app/lib", b"/usr/share/doc")]
def events():
    out = []
    try:
        b = os.read(ino, 65536)
    except BlockingIOError:
        return out
    i = 0
    while i < len(b):
        wd, mask, cookie, n = struct.unpack_from("iIII", b, i)
        out.append("%d:%s" % (wd, b[i+16:i+16+n].rstrip(b"\0").decode()))
        i += 16 + n
    return sorted(out)
print(wds)`

// TestCRIUTreeCarriesInotifyWatches: a file watcher (a session holding inotify watches on
// directories of the sandbox's overlay) is carried by CRIU through a checkpoint and a
// restore, each watch at its number and on its directory: CRIU cannot decode an
// overlay's file handles and found the watched directories only where DeltaBox named
// them or told it to look. Before, such a checkpoint was refused ("Can't dump that
// handle"); without the names, it still is (the image's /usr/share/doc is under no
// directory CRIU walks). A watch on a directory renamed outside those is still refused
// (409), and the watcher goes on as before.
func TestCRIUTreeCarriesInotifyWatches(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "ino"
	dbxCreate(t, d, id)
	dbxSh(t, d, id, "mkdir -p /workspace/proj/src /usr/src/app/lib")
	if _, err := d.C.StartSession(dbxCtx(t), id, state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	if out := sessRun(t, d, id, "py", inotifyWatcher); out != "[1, 2, 3, 4]\n" {
		t.Fatalf("watches: %q", out)
	}
	seen := func(what, tag string) {
		t.Helper()
		dbxSh(t, d, id, fmt.Sprintf("touch /workspace/proj/src/a%s /workspace/b%s /usr/src/app/lib/c%s /usr/share/doc/d%s", tag, tag, tag, tag))
		want := fmt.Sprintf("['1:a%s', '2:b%s', '3:c%s', '4:d%s']\n", tag, tag, tag, tag)
		if got := sessRun(t, d, id, "py", "print(events())"); got != want {
			t.Fatalf("%s: events %q, want %q", what, got, want)
		}
	}
	seen("before", "0")
	a, err := d.C.Checkpoint(dbxCtx(t), id, "a")
	if err != nil {
		t.Fatalf("checkpoint of a watcher: %v", err)
	}
	if a.CRIUProcesses != 1 {
		t.Fatalf("checkpoint: %d processes through CRIU, want the session's: %+v", a.CRIUProcesses, a)
	}
	seen("after the checkpoint", "1")
	dbxSh(t, d, id, "touch /workspace/later")
	sessRun(t, d, id, "py", "_ = events()") // the later file's event
	dbxRestore(t, d, id, a.Node.ID)
	if ls := dbxSh(t, d, id, "ls /workspace"); ls != "b0\nproj\n" {
		t.Fatalf("restored /workspace: %q", ls)
	}
	seen("after the restore", "2")

	// A directory of the image renamed in the sandbox: its overlay handle names the
	// directory of the image under its old name, and it is in none of the directories
	// CRIU walks.
	if out := sessRun(t, d, id, "py", `os.rename("/usr/share/man", "/usr/share/man-renamed"); print(libc.inotify_add_watch(ino, b"/usr/share/man-renamed", 0x100))`); out != "5\n" {
		t.Fatalf("fifth watch: %q", out)
	}
	_, err = d.C.Checkpoint(dbxCtx(t), id, "b")
	if !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "inotify watch") {
		t.Fatalf("checkpoint of a watch on a renamed directory outside the searched ones: %v, want a conflict naming the inotify watch", err)
	}
	dbxSh(t, d, id, "touch /usr/share/man-renamed/e3")
	if got := sessRun(t, d, id, "py", "print(events())"); got != "['5:e3']\n" {
		t.Fatalf("after the refused checkpoint: the fifth watch's events %q", got)
	}
	seen("after the refused checkpoint", "3")
}
