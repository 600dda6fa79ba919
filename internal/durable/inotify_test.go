package durable

import (
	"os"
	"os/exec"
	"reflect"
	"slices"
	"testing"

	"golang.org/x/sys/unix"

	"deltabox/internal/testutil"
)

// TestIrmapScanPaths: a tree holding no inotify fd gets no paths; one that holds one
// gets its working directories first, each once, except those a listed directory holds
// and /proc; then the listed directories.
func TestIrmapScanPaths(t *testing.T) {
	tmp, err := os.MkdirTemp("/tmp", "irmap")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(tmp)
	var tree []int
	for _, dir := range []string{"/usr/share", "/usr/share", tmp, "/proc", "/usr/lib"} {
		c := exec.Command("sleep", "100")
		c.Dir = dir
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		defer func() { _ = c.Process.Kill(); _ = c.Wait() }()
		tree = append(tree, c.Process.Pid)
	}
	if got := irmapScanPaths(tree, nil); got != nil {
		t.Fatalf("irmapScanPaths of a tree without inotify = %q, want none", got)
	}
	// The watcher holds an inotify fd (no watch), in a directory a listed one holds.
	w := exec.Command("python3", "-c", "import ctypes, sys, time; ctypes.CDLL(None).inotify_init1(0); print(flush=True); time.sleep(100)")
	w.Dir = tmp
	out, err := w.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = w.Process.Kill(); _ = w.Wait() }()
	if _, err := out.Read(make([]byte, 1)); err != nil { // its fd is open
		t.Fatal(err)
	}
	want := append([]string{"/usr/share", "/usr/lib"}, irmapFixed...)
	if got := irmapScanPaths(append(tree, w.Process.Pid), nil); !reflect.DeepEqual(got, want) {
		t.Fatalf("irmapScanPaths = %q, want %q", got, want)
	}
}

// TestInotifyHints: watches on an overlay's directories, one in its lower layer, one
// made in its upper, one on a directory copied up, are named by their paths under the
// overlay's root, from the handles the watches' fdinfo shows; a watch on a file of
// another filesystem is not named.
func TestInotifyHints(t *testing.T) {
	testutil.Require(t, os.Geteuid() == 0, "needs root (an overlay mount, open_by_handle_at)")
	d := t.TempDir()
	lower, upper, work, merged := d+"/lower", d+"/upper", d+"/work", d+"/merged"
	for _, p := range []string{lower + "/a/b", lower + "/k", upper, work, merged} {
		if err := os.MkdirAll(p, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := unix.Mount("overlay", merged, "overlay", 0, "lowerdir="+lower+",upperdir="+upper+",workdir="+work); err != nil {
		t.Fatal(err)
	}
	defer unix.Unmount(merged, unix.MNT_DETACH)
	if err := os.Mkdir(merged+"/c", 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(merged+"/k/f", nil, 0o644); err != nil { // copies k up
		t.Fatal(err)
	}
	ino, err := unix.InotifyInit1(unix.IN_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(ino)
	for _, p := range []string{merged + "/a/b", merged + "/c", merged + "/k", "/proc"} {
		if _, err := unix.InotifyAddWatch(ino, p, unix.IN_CREATE); err != nil {
			t.Fatal(p, err)
		}
	}
	got := inotifyHints(inotifyInfos([]int{os.Getpid()}), []string{upper, lower})
	slices.Sort(got)
	if want := []string{"/a/b", "/c", "/k"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("inotifyHints = %q, want %q", got, want)
	}
}
