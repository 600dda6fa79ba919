package durable

import (
	"bufio"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
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
	cmd := exec.Command("python3", "-c", py, dir, arg)
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
