package e2e

import (
	"bytes"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	"deltabox/internal/client"
	"deltabox/internal/state"
	"deltabox/internal/testutil"
)

// squashFingerprint is what a sandbox's whole filesystem looks like (every entry of
// the root overlay with its type, mode, owner, size and link target (no directory
// sizes: XFS's depend on how the directory was filled, which a squash changes); every byte of
// /workspace and /etc; user xattrs of /workspace): equal fingerprints, equal trees.
const squashFingerprint = `cd / && find / -xdev \( -type d -printf '%p d %m %U %G\n' \) -o -printf '%p %y %m %U %G %s %l\n' | LC_ALL=C sort
find /workspace /etc -xdev -type f -print0 | LC_ALL=C sort -z | xargs -0 md5sum
python3 -c '
import os
for d, _, fs in sorted(os.walk("/workspace")):
    for f in sorted(fs):
        p = os.path.join(d, f)
        if not os.path.islink(p):
            print(p, sorted((k, os.getxattr(p, k)) for k in os.listxattr(p)))
'`

// TestSquashedStackRestoresExactly: with stacks squashed every 4 layers
// (DELTABOX_SQUASH_DEPTH=4), a line of 13 checkpoints whose steps create, rewrite,
// delete and rename files and directories (the image's too), change modes, xattrs and
// hard links: every node restores to exactly the tree it was taken with (the
// fingerprint of the whole root), nodes say they were squashed and mount at most 4
// layers, the python session's state comes back, and checkpoints after a restore
// onto a squashed node build on it.
func TestSquashedStackRestoresExactly(t *testing.T) {
	d := testutil.StartDaemonEnv(t, testutil.NewStore(t), "DELTABOX_SQUASH_DEPTH=4")
	id := dbxCreate(t, d, "").ID
	if _, err := d.C.StartSession(dbxCtx(t), id, state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	steps := []string{
		`mkdir -p /workspace/pkg/sub /workspace/data && for i in 1 2 3; do echo $i > /workspace/pkg/sub/m$i.py; done; echo d > /workspace/data/x`,
		`rm /etc/debian_version; echo changed >> /etc/hostname.test; chmod 700 /workspace/pkg`,
		`mv /workspace/pkg /workspace/pkg2; ln /workspace/data/x /workspace/data/x-link`,
		`python3 -c 'import os; os.setxattr("/workspace/data/x", "user.tag", b"v1")'; ln -s ../data /workspace/pkg2/link`,
		`rm -r /workspace/data; mkdir /workspace/data; echo fresh > /workspace/data/y`,
		`mv /usr/share/doc /usr/share/doc-moved; echo new > /usr/share/doc-moved/added`,
		`rm -r /usr/share/doc-moved; mkfifo /workspace/fifo; chown 1000:1000 /workspace/data/y`,
		`head -c 300000 /dev/urandom > /workspace/blob; truncate -s 10M /workspace/sparse`,
		`echo again > /etc/debian_version; rm /workspace/pkg2/sub/m2.py`,
		`dd if=/dev/zero of=/workspace/blob bs=1 count=10 seek=1000 conv=notrunc 2>/dev/null; chmod 4755 /workspace/pkg2/sub/m1.py`,
		`rm -r /workspace/pkg2; mv /workspace/data /workspace/pkg2`,
		`python3 -c 'import os; os.setxattr("/workspace/pkg2", "user.dir", b"d")'; touch -d 2001-01-01 /workspace/pkg2/y`,
		`echo last > /workspace/last`,
	}
	var nodes, prints []string
	for i, s := range steps {
		dbxSh(t, d, id, s)
		sessRun(t, d, id, "py", fmt.Sprintf("step = %d", i))
		nodes = append(nodes, dbxCheckpoint(t, d, id, fmt.Sprint("s", i)).Node.ID)
		prints = append(prints, dbxSh(t, d, id, squashFingerprint))
	}
	last := nodes[len(nodes)-1]
	deadline := time.Now().Add(60 * time.Second)
	for {
		n, err := d.C.Node(dbxCtx(t), last)
		if err != nil {
			t.Fatal(err)
		}
		if n.Depth <= 4 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("node %s still mounts %d layers after 60 s (squashes every 4)", last, n.Depth)
		}
		time.Sleep(50 * time.Millisecond)
	}
	tree, err := d.C.Tree(dbxCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	squashed := 0
	for _, n := range tree.Nodes {
		if n.SquashLayer != 0 {
			squashed++
		}
		if n.Depth > 4 && n.ID != nodes[4] && n.ID != nodes[5] && n.ID != nodes[6] && n.ID != nodes[7] {
			// A node at depth 5-8 may be waiting for its squash; the line's
			// squashes are at depths 4, 8 and 12 (or later ones, which stand for them).
			t.Logf("node %s (%s) mounts %d layers", n.ID, n.Label, n.Depth)
		}
	}
	if squashed == 0 {
		t.Fatalf("no node was squashed")
	}
	t.Logf("%d of %d nodes squashed", squashed, len(nodes))
	order := []int{12, 0, 7, 3, 11, 4, 8, 1, 10, 5, 9, 2, 6}
	for _, i := range order {
		dbxRestore(t, d, id, nodes[i])
		if got := dbxSh(t, d, id, squashFingerprint); got != prints[i] {
			t.Errorf("restore of node %d (%s): the tree differs from the checkpoint's:\n%s", i, nodes[i], squashDiff(prints[i], got))
		}
		if out := sessRun(t, d, id, "py", "print(step)"); strings.TrimSpace(out) != fmt.Sprint(i) {
			t.Errorf("restore of node %d: the python session says step %q", i, out)
		}
	}
	// Build on a squashed node: a new checkpoint mounts its layer over the squash.
	dbxRestore(t, d, id, last)
	dbxSh(t, d, id, `echo after > /workspace/after && rm /workspace/last`)
	after := dbxCheckpoint(t, d, id, "after").Node.ID
	want := dbxSh(t, d, id, squashFingerprint)
	dbxRestore(t, d, id, nodes[0])
	dbxRestore(t, d, id, after)
	if got := dbxSh(t, d, id, squashFingerprint); got != want {
		t.Errorf("the node made on a squashed node restores to another tree")
	}
	if b, err := d.C.ReadFile(dbxCtx(t), id, "/workspace/after"); err != nil || !bytes.Equal(b, []byte("after\n")) {
		t.Errorf("/workspace/after: %q, %v", b, err)
	}
}

// squashDiff lists the lines only one of two fingerprints has (at most 20).
func squashDiff(want, got string) string {
	w, g := map[string]bool{}, map[string]bool{}
	for _, l := range strings.Split(want, "\n") {
		w[l] = true
	}
	for _, l := range strings.Split(got, "\n") {
		g[l] = true
	}
	var out []string
	for l := range w {
		if !g[l] {
			out = append(out, "- "+l)
		}
	}
	for l := range g {
		if !w[l] {
			out = append(out, "+ "+l)
		}
	}
	sort.Strings(out)
	if len(out) > 20 {
		out = append(out[:20], fmt.Sprintf("... %d more", len(out)-20))
	}
	return strings.Join(out, "\n")
}

// TestDepthPastOverlayLimit: a line of 520 checkpoints, each with a change, is past
// overlayfs's 500 lowers; with the default squashing every node restores (the first,
// one in the middle, the last), with its own content, and the deepest mounts no more
// than twice the squash depth.
func TestDepthPastOverlayLimit(t *testing.T) {
	d := testutil.StartDaemon(t)
	id := dbxCreate(t, d, "").ID
	const n = 520
	nodes := make([]string, n)
	start := time.Now()
	for i := 0; i < n; i++ {
		if _, err := d.C.WriteFile(dbxCtx(t), id, "/workspace/step", strings.NewReader(fmt.Sprint(i)), client.WriteFileOptions{}); err != nil {
			t.Fatalf("write at depth %d: %v", i, err)
		}
		r, err := d.C.Checkpoint(dbxCtx(t), id, "")
		if err != nil {
			t.Fatalf("checkpoint at depth %d: %v", i+1, err)
		}
		nodes[i] = r.Node.ID
	}
	t.Logf("%d checkpoints in %v", n, time.Since(start))
	check := func(d *testutil.Daemon, when string) {
		t.Helper()
		for _, i := range []int{n - 1, 0, n / 2, n - 1} {
			dbxRestore(t, d, id, nodes[i])
			b, err := d.C.ReadFile(dbxCtx(t), id, "/workspace/step")
			if err != nil || string(b) != fmt.Sprint(i) {
				t.Errorf("%s: restore of node %d: /workspace/step is %q (%v)", when, i, b, err)
			}
		}
		// The squashes run in the background and may lag a fast line on a loaded
		// machine; they catch up (each reads only what the layers hold).
		start := time.Now()
		for {
			info, err := d.C.Node(dbxCtx(t), nodes[n-1])
			if err != nil {
				t.Fatal(err)
			}
			if info.Depth <= 2*state.DefaultSquashDepth {
				t.Logf("%s: the deepest node mounts %d layers (after %v)", when, info.Depth, time.Since(start).Round(time.Millisecond))
				break
			}
			if time.Since(start) > time.Minute {
				t.Errorf("%s: the deepest node still mounts %d layers after a minute (squash depth %d)", when, info.Depth, state.DefaultSquashDepth)
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	check(d, "first daemon")
	// The squash layers are in the nodes' records: a new daemon keeps and uses them.
	d.Stop()
	check(testutil.StartDaemonOn(t, d.Root), "after a restart")
}
