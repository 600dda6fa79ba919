package durable

import (
	"bufio"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// holdRemoved starts a python that holds, under dir, an unlinked file g ("hello"), a
// removed working directory c, and, with big, an unlinked sparse file over RemovedLimit.
func holdRemoved(t *testing.T, dir string, big bool) int {
	t.Helper()
	py := `import os, sys, time
d = sys.argv[1]
g = open(d + "/g", "w+"); g.write("hello"); g.flush(); os.unlink(d + "/g")
if sys.argv[2] == "big":
    b = open(d + "/big", "w+"); b.truncate(` + "65 << 20" + `); os.unlink(d + "/big")
os.mkdir(d + "/c"); os.chdir(d + "/c"); os.rmdir(d + "/c")
print("ready", flush=True)
time.sleep(1000)
`
	arg := "small"
	if big {
		arg = "big"
	}
	return holdPy(t, py, dir, arg)
}

// TestRemovedFilesFound: an unlinked open file and a removed working directory are
// found (by their link count, not their names), keyed as CRIU keys external files, and
// the file's content is copied for the image; a removed file over RemovedLimit refuses
// the dump, naming it.
func TestRemovedFilesFound(t *testing.T) {
	dir, img := t.TempDir(), t.TempDir()
	pid := holdRemoved(t, dir, false)
	removed, src, err := removedFiles([]int{pid})
	if err != nil {
		t.Fatal(err)
	}
	var paths []string
	for _, r := range removed {
		paths = append(paths, r.Path)
		if !strings.HasPrefix(r.Key, "file[") || src[r.Key] == "" {
			t.Errorf("%s: key %q, link %q", r.Path, r.Key, src[r.Key])
		}
	}
	if len(removed) != 2 || !strings.Contains(strings.Join(paths, " "), filepath.Join(dir, "g")) || !strings.Contains(strings.Join(paths, " "), filepath.Join(dir, "c")) {
		t.Fatalf("found %v, want %s/g and %s/c", paths, dir, dir)
	}
	copied, err := copyRemovedFiles([]int{pid}, img, removed, src)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range copied {
		if r.Dir {
			continue
		}
		if b, err := os.ReadFile(filepath.Join(img, r.Copy)); err != nil || string(b) != "hello" {
			t.Fatalf("the copy of %s: %q %v", r.Path, b, err)
		}
	}

	pid = holdRemoved(t, t.TempDir(), true)
	if _, _, err := removedFiles([]int{pid}); err == nil || !strings.Contains(err.Error(), "over the 64 MiB") {
		t.Fatalf("a removed file of 65 MiB: %v, want a refusal naming the limit", err)
	}
}

// TestRemovedCopyBoundedAtCopy: removed files that were empty at the scan and larger at
// the copy (a template's live process shares its files and runs meanwhile; a tree runs
// until CRIU seizes it) are not copied past the limits the scan checked: one over
// RemovedLimit, or all together over RemovedTotal, refuses the dump (sparse files here:
// the limits are on their sizes).
func TestRemovedCopyBoundedAtCopy(t *testing.T) {
	for _, c := range []struct {
		sizes []int64
		want  string
	}{
		{[]int64{65 << 20}, "grew to 65 MiB since the scan, over the 64 MiB"},
		{[]int64{60 << 20, 60 << 20, 60 << 20, 60 << 20, 60 << 20}, "grew to over 256 MiB since the scan"},
	} {
		dir := t.TempDir()
		var removed []Removed
		src := map[string]string{}
		for i, size := range c.sizes {
			path := filepath.Join(dir, strconv.Itoa(i))
			f, err := os.Create(path)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			if err := os.Remove(path); err != nil {
				t.Fatal(err)
			}
			link := "/proc/self/fd/" + strconv.Itoa(int(f.Fd()))
			key, err := keyOf(link)
			if err != nil {
				t.Fatal(err)
			}
			removed = append(removed, Removed{Key: key, Path: path}) // Size 0, as scanned
			src[key] = link
			if err := f.Truncate(size); err != nil { // after the scan
				t.Fatal(err)
			}
		}
		_, err := copyRemovedFiles([]int{os.Getpid()}, t.TempDir(), removed, src)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("removed files of %v bytes, empty at the scan: %v, want a refusal (%s)", c.sizes, err, c.want)
		}
	}
}

// TestRemovedCopyKeepsHoles: a removed sparse file is copied into the image and made
// again on the state with its holes, size and blocks (CRIU's ghost_holes tests: a dense
// copy gave the first hole at the end and every block allocated).
func TestRemovedCopyKeepsHoles(t *testing.T) {
	dir, img, state := t.TempDir(), t.TempDir(), t.TempDir()
	orig := filepath.Join(dir, "sparse")
	f, err := os.OpenFile(orig, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, off := range []int64{0, 1 << 20, 3 << 20} {
		if _, err := f.WriteAt([]byte("x"), off); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.Truncate(5 << 20); err != nil { // a hole at the end too
		t.Fatal(err)
	}
	type shape struct{ hole, size, blocks int64 }
	shapeOf := func(f *os.File) shape {
		t.Helper()
		var st unix.Stat_t
		if err := unix.Fstat(int(f.Fd()), &st); err != nil {
			t.Fatal(err)
		}
		hole, err := unix.Seek(int(f.Fd()), 0, unix.SEEK_HOLE)
		if err != nil {
			t.Fatal(err)
		}
		return shape{hole, st.Size, st.Blocks}
	}
	want := shapeOf(f)
	if want.hole >= 1<<20 {
		t.Skipf("%s keeps no holes (first hole at %d)", dir, want.hole)
	}
	if _, err := copyRemoved(orig, filepath.Join(img, "removed-0"), RemovedTotal); err != nil {
		t.Fatal(err)
	}
	c, err := os.Open(filepath.Join(img, "removed-0"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if got := shapeOf(c); got != want {
		t.Errorf("the image's copy: first hole, size, blocks %v, want %v", got, want)
	}
	root, err := os.Open(state)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	m, err := makeRemoved(root, img, Removed{Path: "/sparse", Mode: 0o644, UID: uint32(os.Getuid()), GID: uint32(os.Getgid()), Copy: "removed-0"})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if got := shapeOf(m); got != want {
		t.Errorf("made again: first hole, size, blocks %v, want %v", got, want)
	}
	b := make([]byte, 1)
	if _, err := m.ReadAt(b, 3<<20); err != nil || string(b) != "x" {
		t.Errorf("made again: at 3 MiB %q %v, want x", b, err)
	}
}

// holdPy starts python3 -c py with args; it prints "ready" when set up.
func holdPy(t *testing.T, py string, args ...string) int {
	t.Helper()
	cmd := exec.Command("python3", append([]string{"-c", py}, args...)...)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Skipf("python3: %v", err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	if l, _ := bufio.NewReader(out).ReadString('\n'); l != "ready\n" {
		t.Fatalf("the holder did not start: %q", l)
	}
	return cmd.Process.Pid
}

// TestRemovedSpecialNamed: a refusal names what a removed special file is (CRIU's
// symlink01: an O_PATH fd of a removed symlink was called "a FIFO or device"), and an
// AIO ring's mapping (/[aio], which CRIU dumps itself) is not taken for a removed file.
func TestRemovedSpecialNamed(t *testing.T) {
	dir := t.TempDir()
	pid := holdPy(t, `import os, sys, ctypes, time
d = sys.argv[1]
os.symlink("target", d + "/l"); l = os.open(d + "/l", os.O_PATH | os.O_NOFOLLOW); os.unlink(d + "/l")
os.mkfifo(d + "/f"); f = os.open(d + "/f", os.O_RDWR); os.unlink(d + "/f")
ctx = ctypes.c_ulong(0)
assert ctypes.CDLL(None).syscall(206, 16, ctypes.byref(ctx)) == 0  # io_setup: /[aio]
print("ready", flush=True)
time.sleep(1000)
`, dir)
	var msgs []string
	_ = treeLinks([]int{pid}, func(p int, link string) error { // collects every error
		if _, err := removedAt(p, link); err != nil {
			msgs = append(msgs, err.Error())
		}
		return nil
	})
	all := strings.Join(msgs, "\n")
	if len(msgs) != 2 || !strings.Contains(all, dir+"/l, a symbolic link") || !strings.Contains(all, dir+"/f, a FIFO whose") || strings.Contains(all, "aio") {
		t.Fatalf("refusals:\n%s\nwant %s/l a symbolic link, %s/f a FIFO, and nothing of /[aio]", all, dir, dir)
	}
}

// TestTreePTYsOwn: a pty the process opened itself (it holds the master) is told apart
// from one whose master was closed (CRIU's pty00 and pty04 were called "a session's terminal").
func TestTreePTYsOwn(t *testing.T) {
	pid := holdPy(t, `import os, time
m, s = os.openpty()
m2, s2 = os.openpty(); os.close(m2)
print("ready", flush=True)
time.sleep(1000)
`)
	keys, err := TreeTTYs(pid)
	if err != nil {
		t.Fatal(err)
	}
	ptys := TreePTYs(pid, keys)
	if len(keys) != 2 || len(ptys) != 2 || !ptys[0].Own || ptys[0].Closed || ptys[1].Own || !ptys[1].Closed || !strings.HasPrefix(ptys[0].Path, "/dev/pts/") ||
		strings.HasSuffix(ptys[1].Path, "(deleted)") {
		t.Fatalf("keys %v, ptys %+v: want two, the first its own (its master held), the second's master closed", keys, ptys)
	}
}
