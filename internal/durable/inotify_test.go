package durable

import (
	"os"
	"os/exec"
	"reflect"
	"testing"
)

// TestIrmapScanPaths: the tree's working directories come first, each once, except those
// a listed directory holds and /proc; then the listed directories.
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
	want := append([]string{"/usr/share", "/usr/lib"}, irmapFixed...)
	if got := irmapScanPaths(tree); !reflect.DeepEqual(got, want) {
		t.Fatalf("irmapScanPaths = %q, want %q", got, want)
	}
}
