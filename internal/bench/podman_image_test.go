package bench

import (
	"archive/tar"
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestPodmanImageImportsTheRootfs: the podman baselines import the store's image into
// podman once (podmanCLI.image). With a podman that has no such image yet (a fresh
// machine), podman gets exactly `import - TAG` after its global flags, and a tar of the
// rootfs on its stdin. (The shell line passed the rootfs and podman's path to podman
// too: "unrecognized command `podman /var/lib/deltabox/images/default/rootfs`", seen
// only on a machine where the image had never been imported.)
func TestPodmanImageImportsTheRootfs(t *testing.T) {
	dir := t.TempDir()
	root := filepath.Join(dir, "store")
	rootfs := filepath.Join(root, "images", "img", "rootfs")
	if err := os.MkdirAll(filepath.Join(rootfs, "etc"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(rootfs, "etc", "hostname"), []byte("x\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	// A podman that has no image (`image exists` fails) and records an import's
	// arguments and stdin.
	fake := filepath.Join(dir, "podman")
	script := `#!/bin/sh
for a in "$@"; do [ "$a" = exists ] && exit 1; done
printf '%s\n' "$@" > "` + dir + `/args"
cat > "` + dir + `/stdin"
`
	if err := os.WriteFile(fake, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	p := podmanCLI{bin: fake, env: os.Environ()}
	tag, why := p.image(context.Background(), root, "img", t.Logf)
	if why != "" || tag != "localhost/deltabox-bench:img" {
		t.Fatalf("image: tag %q, why %q; want the tag and no reason", tag, why)
	}
	args, err := os.ReadFile(filepath.Join(dir, "args"))
	if err != nil {
		t.Fatal(err)
	}
	want := strings.Join(podmanArgs("import", "-", tag), "\n") + "\n"
	if string(args) != want {
		t.Fatalf("podman was run with\n%s\nwant\n%s", args, want)
	}
	f, err := os.Open(filepath.Join(dir, "stdin"))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.Close() }() // read-only
	tr := tar.NewReader(f)
	found := false
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("podman's stdin is not a tar: %v", err)
		}
		found = found || h.Name == "./etc/hostname"
	}
	if !found {
		t.Fatal("the tar on podman's stdin holds no ./etc/hostname of the rootfs")
	}
}
