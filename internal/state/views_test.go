package state_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"deltabox/internal/state"
	"deltabox/internal/testutil"
)

// overlayMount is an overlay as /proc/PID/mountinfo shows it.
type overlayMount struct {
	point, opts string // mount point, per-mount options
	upper       string
	lowers      []string
}

func overlays(t *testing.T, pid int) []overlayMount {
	t.Helper()
	f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/mountinfo")
	if err != nil {
		return nil // gone
	}
	defer f.Close()
	var out []overlayMount
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		pre, post, ok := strings.Cut(sc.Text(), " - ")
		pf, qf := strings.Fields(pre), strings.Fields(post)
		if !ok || len(pf) < 6 || len(qf) < 3 || qf[0] != "overlay" {
			continue
		}
		o := overlayMount{point: pf[4], opts: pf[5]}
		for _, kv := range strings.Split(qf[2], ",") {
			k, v, _ := strings.Cut(kv, "=")
			switch k {
			case "upperdir":
				o.upper = v
			case "lowerdir", "lowerdir+":
				o.lowers = append(o.lowers, strings.Split(v, ":")...)
			}
		}
		out = append(out, o)
	}
	return out
}

// TestTemplatesParkedOnReadOnlyView: once a checkpoint has completed and its background
// work settled, no read-write overlay visible in any process of the sandbox (templates
// included) has a frozen layer as its upper: the only one is the sandbox's own upper;
// and every template stands on a read-only overlay of its node's layers, its file fds
// reopened there read-only at the offset they had.
func TestTemplatesParkedOnReadOnlyView(t *testing.T) {
	root := testutil.NewStore(t)
	m := open(t, root)
	defer m.Close()
	ctx := context.Background()
	const id = "pk"
	if _, err := m.Create(ctx, state.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	if _, err := m.StartSession(ctx, id, state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	// The first checkpoint is of the bare image (a node with a one-layer stack).
	call(t, m, id, "main", "cd /workspace")
	if r, err := m.Checkpoint(ctx, id, ""); err != nil || r.Processes != 2 || r.Node.Depth != 0 {
		t.Fatalf("checkpoint of the bare image: %v %+v", err, r)
	}
	call(t, m, id, "main", "echo a > /workspace/a")
	call(t, m, id, "py", "import os; open('/workspace/f', 'w').write('x' * 100); fd = os.open('/workspace/f', os.O_RDWR); os.lseek(fd, 7, 0)")
	for i := 0; i < 3; i++ {
		call(t, m, id, "main", fmt.Sprintf("echo %d >> /workspace/a", i))
		if r, err := m.Checkpoint(ctx, id, ""); err != nil || r.Processes != 2 {
			t.Fatalf("checkpoint %d: %v %+v", i, err, r)
		}
	}
	info, _ := m.Get(id)
	myUpper := filepath.Join(root, "layers", strconv.FormatUint(info.Upper, 10), "diff")
	got := settle(func() string {
		procs := sandboxProcs(t, id)
		templates := 0
		for pid, st := range procs {
			for _, o := range overlays(t, pid) {
				if o.upper != "" && !sameLayerPath(o.upper, myUpper) {
					return fmt.Sprintf("process %d (%c, %s) sees a read-write overlay on %s with upper %s, not the sandbox's upper %s", pid, st, procDesc(pid), o.point, o.upper, myUpper)
				}
			}
			if st != 'T' && st != 't' {
				continue
			}
			templates++
			var rootMnt *overlayMount
			for _, o := range overlays(t, pid) {
				if o.point == "/" {
					o := o
					rootMnt = &o
				}
			}
			if rootMnt == nil || rootMnt.upper != "" || !strings.HasPrefix(rootMnt.opts, "ro") || len(rootMnt.lowers) < 2 ||
				!strings.HasSuffix(rootMnt.lowers[0], "/frozen") && !strings.HasSuffix(rootMnt.lowers[0], "/images/default/rootfs") {
				return fmt.Sprintf("template %d is not on a read-only view of its node: %+v", pid, rootMnt)
			}
			fds, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
			for _, e := range fds {
				target, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, e.Name()))
				if target != "/workspace/f" {
					continue
				}
				fi, _ := os.ReadFile(fmt.Sprintf("/proc/%d/fdinfo/%s", pid, e.Name()))
				if !strings.Contains(string(fi), "pos:\t7\n") || !strings.Contains(string(fi), "flags:\t0100000\n") && !strings.Contains(string(fi), "flags:\t02100000\n") {
					return fmt.Sprintf("template %d fd %s (%s) is not a read-only reopen at offset 7:\n%s", pid, e.Name(), target, fi)
				}
			}
		}
		if templates != 8 {
			return fmt.Sprintf("%d templates, want 8", templates)
		}
		return ""
	})
	if got != "" {
		t.Fatal(got)
	}
}

// procDesc describes host process pid for a failure message: its command line, parent
// and PIDs.
func procDesc(pid int) string {
	cmd, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	st, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	var ppid, nspid string
	for _, l := range strings.Split(string(st), "\n") {
		if v, ok := strings.CutPrefix(l, "PPid:"); ok {
			ppid = strings.TrimSpace(v)
		}
		if v, ok := strings.CutPrefix(l, "NSpid:"); ok {
			nspid = strings.Join(strings.Fields(v), "/")
		}
	}
	return fmt.Sprintf("%q ppid %s nspid %s", strings.ReplaceAll(string(cmd), "\x00", " "), ppid, nspid)
}

// sameLayerPath reports whether a layer path read from mountinfo names host: with
// isolation, layers are named through the daemon's idmapped clone of the store's mount
// (/proc/self/fd/N/REL, REL from the mount's root), so REL must end host.
func sameLayerPath(seen, host string) bool {
	if rest, ok := strings.CutPrefix(seen, "/proc/self/fd/"); ok {
		if _, rel, ok := strings.Cut(rest, "/"); ok {
			return strings.HasSuffix(host, "/"+rel)
		}
	}
	return seen == host
}
