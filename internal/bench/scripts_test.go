package bench

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// The workload scripts must write the same bytes for the same seed (the baselines rely
// on it) and change the number of files asked for.
func TestScriptsDeterministic(t *testing.T) {
	if _, err := exec.LookPath("python3"); err != nil {
		t.Skip("no python3")
	}
	ctx := context.Background()
	dir := t.TempDir()
	sum := func(root string) checksum {
		t.Helper()
		out, err := hostPy(ctx, checksumPy, root)
		if err != nil {
			t.Fatal(err)
		}
		var c checksum
		if err := json.Unmarshal([]byte(out), &c); err != nil {
			t.Fatal(err)
		}
		return c
	}
	var sums []checksum
	for _, name := range []string{"a", "b"} {
		root := filepath.Join(dir, name)
		if _, err := hostPy(ctx, genPy, root, "7", "2", "300", "2"); err != nil {
			t.Fatal(err)
		}
		sums = append(sums, sum(root))
	}
	if sums[0] != sums[1] {
		t.Fatalf("same seed, different workspaces: %+v", sums)
	}
	// 300 small files (about 600 KiB) + 2 large + meta + marker.
	if sums[0].Files != 304 || sums[0].Bytes < 2<<20 {
		t.Fatalf("unexpected workspace %+v", sums[0])
	}
	root := filepath.Join(dir, "a")
	out, err := hostPy(ctx, changePy, root, "7", "10", "100", "10", "label-x")
	if err != nil {
		t.Fatal(err)
	}
	var st struct{ Files, Large int }
	json.Unmarshal([]byte(out), &st)
	if st.Files != 101 || st.Large != 1 {
		t.Fatalf("change step: %s", out)
	}
	if b, _ := os.ReadFile(filepath.Join(root, ".bench", "marker")); string(b) != "label-x" {
		t.Fatalf("marker %q", b)
	}
	if sum(root) == sums[0] {
		t.Fatal("change step changed nothing")
	}
}

func TestSharedExtents(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "f")
	if err := os.WriteFile(p, make([]byte, 1<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, _, err := sharedExtents(p); err != nil {
		t.Skipf("FIEMAP not supported here: %v", err)
	}
}
