package security

import (
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/apitypes"
	"deltabox/internal/testutil"
)

// suidInside makes, as root of the sandbox, a setuid-root copy of id(1) in its
// workspace, and runs it as nobody there: it must run as root of the sandbox (setuid
// programs work inside, docs/SECURITY.md).
const suidInside = `
cp /usr/bin/id /workspace/suid-id && chmod 4755 /workspace/suid-id || exit 1
python3 -c '
import os
os.setgroups([]); os.setgid(65534); os.setuid(65534)
os.execv("/workspace/suid-id", ["id", "-u"])
'
`

// TestSetuidFileOnStoreNotHostRoot: a sandbox's root leaves a setuid-root program in
// its upper layer, which on the store is a file of host root with the set-uid bit (the
// store keeps a sandbox's ids as they are inside). Run on the host by nobody, through
// an fd (the store's directories are root's, 0700), it must not run as host root: the
// store is nosuid where the host sees it, whether the store is its filesystem's mount
// or a directory of a larger one (then bound onto itself). Inside the sandbox the
// program still runs as root of the sandbox.
func TestSetuidFileOnStoreNotHostRoot(t *testing.T) {
	for _, sub := range []bool{false, true} {
		name := map[bool]string{false: "own-mount", true: "subdirectory"}[sub]
		t.Run(name, func(t *testing.T) {
			root := smallStore(t, 512)
			if sub {
				// The store is a directory of the mount (the test's filesystem),
				// with the same images.
				dir := filepath.Join(root, "store")
				if err := os.MkdirAll(filepath.Join(dir, "images"), 0o700); err != nil {
					t.Fatal(err)
				}
				ims, _ := os.ReadDir(filepath.Join(root, "images"))
				for _, im := range ims {
					target, _ := os.Readlink(filepath.Join(root, "images", im.Name()))
					os.Symlink(target, filepath.Join(dir, "images", im.Name()))
				}
				t.Cleanup(func() { testutil.EndSandboxes(dir); unix.Unmount(dir, unix.MNT_DETACH) })
				root = dir
			}
			d := testutil.StartDaemonOn(t, root)
			create(t, d, apitypes.CreateOptions{ID: "suid"})
			r, err := d.C.Exec(ctx(t), "suid", apitypes.ExecRequest{Argv: []string{"bash", "-c", suidInside}, TimeoutMS: 30_000})
			if err != nil {
				t.Fatal(err)
			}
			if r.ExitCode != 0 || strings.TrimSpace(r.Stdout) != "0" {
				t.Fatalf("a setuid-root program run by nobody inside the sandbox: exit %d, euid %q (stderr %q), want 0: setuid programs work inside", r.ExitCode, r.Stdout, r.Stderr)
			}

			var found string
			filepath.WalkDir(filepath.Join(root, "layers"), func(p string, e fs.DirEntry, err error) error {
				if err == nil && e.Name() == "suid-id" {
					found = p
				}
				return nil
			})
			if found == "" {
				t.Fatalf("no suid-id in the store's layers under %s", root)
			}
			var st unix.Stat_t
			if err := unix.Stat(found, &st); err != nil {
				t.Fatal(err)
			}
			t.Logf("%s: uid %d, mode %o", found, st.Uid, st.Mode&0o7777)
			if st.Uid != 0 || st.Mode&unix.S_ISUID == 0 {
				t.Fatalf("the sandbox's file is not a setuid file of host root on the store (uid %d, mode %o): the test proves nothing", st.Uid, st.Mode&0o7777)
			}
			f, err := os.OpenFile(found, unix.O_PATH|unix.O_CLOEXEC, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			cmd := exec.Command("/proc/self/fd/3", "-u")
			cmd.ExtraFiles = []*os.File{f}
			cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
			done := time.AfterFunc(30*time.Second, func() { cmd.Process.Kill() })
			out, err := cmd.CombinedOutput()
			done.Stop()
			if err != nil {
				t.Fatalf("run the sandbox's setuid file on the host as nobody: %v\n%s", err, out)
			}
			if got := strings.TrimSpace(string(out)); got != "65534" {
				t.Errorf("the sandbox's setuid-root file, run on the host by nobody, ran with euid %s (want 65534: the store must be nosuid)", got)
			}
			var sfs unix.Statfs_t
			if err := unix.Statfs(found, &sfs); err != nil {
				t.Fatal(err)
			}
			if sfs.Flags&unix.ST_NODEV == 0 {
				t.Errorf("the store %s is not nodev where the host sees it", root)
			}
		})
	}
}
