package sbinit

import (
	"bufio"
	"debug/buildinfo"
	"debug/elf"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// The branch init's executable. The family init pivoted into a tmpfs that holds only
// /proc and /dev, so an exec there finds neither the daemon's binary by path nor, for
// a dynamically linked one, its ELF interpreter and libraries (exec fails with ENOENT:
// the interpreter). The daemon hands them over with each request, as detached mounts
// (open_tree OPEN_TREE_CLONE, made in the daemon's mount namespace, one per file),
// which the family init's branch-making thread attaches (move_mount) in a small tmpfs
// of its own private mount namespace at the paths the loader looks for, with the
// symlinks on those paths (/lib -> usr/lib...) made again, the binary at branchExe. A
// user namespace's process may attach a detached mount into a mount namespace it owns
// (checked on Linux 6.18). That tmpfs becomes the root of the thread's namespace
// (pivot_root, the base tree detached), and the branch init's setupRoot pivots away from
// it and detaches it in turn: no branch keeps any of it. Nothing is written: the files
// are the host's, read-only for the branch init (it is not host root).

// branchExe is where the daemon's binary is in the branch-making namespace.
const branchExe = "/deltabox"

// execEntry is one thing of the exec tree: a file (a detached mount of it comes with the
// request, in order) or a symlink.
type execEntry struct {
	Path   string `json:"path"`
	Target string `json:"target,omitempty"` // a symlink's; "" for a file
}

var (
	execTreeOnce sync.Once
	execTreeList []execEntry
	execTreeSrc  []string // the host path of each file entry, in order
	execTreeErr  error
)

var soName = regexp.MustCompile(`\.so(\.[0-9]+)*$`)

// InitBinaryName is the small init's file name, beside the daemon's binary
// (cmd/deltabox-init).
const InitBinaryName = "deltabox-init"

// InitBinary is the executable every sandbox init (Start's, and a fork's branch inits)
// runs and why: the small init beside the daemon's binary if it can stand for it
// (initBinaryUsable), else the daemon's own ("/proc/self/exe"). Resolved once per
// daemon, at its start (the daemon logs it), which opens the fd Start execs (initExe).
func InitBinary() (path, why string) {
	initBinOnce.Do(func() {
		initBinPath, initBinWhy = "/proc/self/exe", "the daemon's own binary"
		self, err := os.Executable()
		if err != nil {
			initBinWhy += " (" + err.Error() + ")"
			return
		}
		p := filepath.Join(filepath.Dir(self), InitBinaryName)
		ours, ok := debug.ReadBuildInfo()
		if !ok {
			initBinWhy += " (it has no build information)"
			return
		}
		if err := initBinaryUsable(p, self, ours); err != nil {
			initBinWhy += " (" + err.Error() + ")"
			return
		}
		if err := openInitExe(p); err != nil {
			initBinWhy += " (" + err.Error() + ")"
			return
		}
		initBinPath, initBinWhy = p, "the static init beside the daemon's binary"
	})
	return initBinPath, initBinWhy
}

var (
	initBinOnce sync.Once
	initBinPath string
	initBinWhy  string
)

// initExe is what Start execs: InitBinary's small init through an O_PATH fd the daemon
// holds from its start on ("/proc/self/fd/N", resolved in the child before its exec
// closes the fd), else the daemon's own binary. Not by its path: the child execs as the
// sandbox's root, its host uid unprivileged, which may not search the directories on
// the way to it (a test's binary is in a 0700 temporary directory); a magic link is no
// search. N is 100 or above, clear of the fds the child's exec installs at 0, 1, 2,
// 3... (exec.Cmd's ExtraFiles), which would cover a lower one.
func initExe() string {
	InitBinary()
	return initExePath
}

// openInitExe sets initExePath for the small init at p (InitBinary, once).
func openInitExe(p string) error {
	fd, err := unix.Open(p, unix.O_PATH|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	hi, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 100)
	if err != nil {
		return err
	}
	initExePath = "/proc/self/fd/" + strconv.Itoa(hi)
	return nil
}

var initExePath = "/proc/self/exe"

// initBinaryUsable says why p cannot stand for the daemon's binary self, whose build
// information is ours, as a branch init (nil when it can): it must be a static
// executable (the exec root holds no ELF interpreter or library for it), built by the
// same Go from the same commit and no earlier than self (the daemon and the init speak
// one protocol, and a daemon rebuilt alone would find an init of other code beside it;
// every build script builds the init after the daemon).
func initBinaryUsable(p, self string, ours *debug.BuildInfo) error {
	fi, err := os.Stat(p)
	if err != nil {
		return err
	}
	si, err := os.Stat(self)
	if err != nil {
		return err
	}
	if !fi.Mode().IsRegular() || fi.Mode()&0o111 == 0 {
		return fmt.Errorf("%s is not an executable file", p)
	}
	if fi.ModTime().Before(si.ModTime()) {
		return fmt.Errorf("%s is older than %s: build it after the daemon (CGO_ENABLED=0 go build -o %s ./cmd/%s)", p, self, p, InitBinaryName)
	}
	f, err := elf.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	for _, pr := range f.Progs {
		if pr.Type == elf.PT_INTERP {
			return fmt.Errorf("%s is dynamically linked: build it with CGO_ENABLED=0", p)
		}
	}
	theirs, err := buildinfo.ReadFile(p)
	if err != nil {
		return err
	}
	if theirs.GoVersion != ours.GoVersion || theirs.Path != InitBinaryPath || ours.Main.Path != theirs.Main.Path {
		return fmt.Errorf("%s is %s of %s (%s), not of the daemon's module %s (%s)", p, theirs.Path, theirs.Main.Path, theirs.GoVersion, ours.Main.Path, ours.GoVersion)
	}
	for _, k := range []string{"vcs.revision", "vcs.modified"} {
		if a, b := buildSetting(theirs, k), buildSetting(ours, k); a != b {
			return fmt.Errorf("%s was built with %s %q, the daemon with %q", p, k, a, b)
		}
	}
	return nil
}

// InitBinaryPath is the small init's package path (cmd/deltabox-init).
const InitBinaryPath = "deltabox/cmd/deltabox-init"

func buildSetting(bi *debug.BuildInfo, key string) string {
	for _, s := range bi.Settings {
		if s.Key == key {
			return s.Value
		}
	}
	return ""
}

// execTree lists what the branch init's exec needs: the small init alone
// (InitBinary), or the daemon's binary, its ELF interpreter, the loader's cache and
// every shared library the daemon has mapped (the same binary), each at its real path,
// and the symlinks on the way to them.
func execTree() ([]execEntry, []string, error) {
	execTreeOnce.Do(func() {
		execTreeList = append(execTreeList, execEntry{Path: branchExe})
		if p, _ := InitBinary(); p != "/proc/self/exe" {
			execTreeSrc = append(execTreeSrc, p)
			return
		}
		links := map[string]string{}
		files := map[string]bool{}
		add := func(p string) error {
			real, err := walkLinks(p, links, 0)
			if err != nil {
				return err
			}
			if !files[real] {
				files[real] = true
				execTreeList = append(execTreeList, execEntry{Path: real})
				execTreeSrc = append(execTreeSrc, real)
			}
			return nil
		}
		execTreeSrc = append(execTreeSrc, "/proc/self/exe")
		f, err := elf.Open("/proc/self/exe")
		if err != nil {
			execTreeErr = err
			return
		}
		defer f.Close()
		for _, p := range f.Progs {
			if p.Type != elf.PT_INTERP {
				continue
			}
			b := make([]byte, p.Filesz)
			if _, err := p.ReadAt(b, 0); err != nil {
				execTreeErr = err
				return
			}
			if execTreeErr = add(strings.TrimRight(string(b), "\x00")); execTreeErr != nil {
				return
			}
			if _, err := os.Stat("/etc/ld.so.cache"); err == nil {
				if execTreeErr = add("/etc/ld.so.cache"); execTreeErr != nil {
					return
				}
			}
		}
		m, err := os.Open("/proc/self/maps")
		if err != nil {
			execTreeErr = err
			return
		}
		defer m.Close()
		sc := bufio.NewScanner(m)
		for sc.Scan() {
			fl := strings.Fields(sc.Text())
			if len(fl) == 6 && strings.HasPrefix(fl[5], "/") && soName.MatchString(fl[5]) {
				if execTreeErr = add(fl[5]); execTreeErr != nil {
					return
				}
			}
		}
		var ls []execEntry
		for p, t := range links {
			ls = append(ls, execEntry{Path: p, Target: t})
		}
		execTreeList = append(execTreeList, ls...)
	})
	return execTreeList, execTreeSrc, execTreeErr
}

// walkLinks resolves p component by component, recording each symlink met in links, and
// returns the real path.
func walkLinks(p string, links map[string]string, depth int) (string, error) {
	if depth > 16 {
		return "", fmt.Errorf("%s: too many symlinks", p)
	}
	cur := "/"
	parts := strings.Split(strings.TrimPrefix(filepath.Clean(p), "/"), "/")
	for i, c := range parts {
		next := filepath.Join(cur, c)
		fi, err := os.Lstat(next)
		if err != nil {
			return "", err
		}
		if fi.Mode()&os.ModeSymlink == 0 {
			cur = next
			continue
		}
		t, err := os.Readlink(next)
		if err != nil {
			return "", err
		}
		links[next] = t
		if !filepath.IsAbs(t) {
			t = filepath.Join(cur, t)
		}
		return walkLinks(filepath.Join(append([]string{t}, parts[i+1:]...)...), links, depth+1)
	}
	return cur, nil
}

// cloneExecTree makes a detached mount of each file of the exec tree (the caller
// closes them).
func cloneExecTree() ([]execEntry, []int, error) {
	list, src, err := execTree()
	if err != nil {
		return nil, nil, fmt.Errorf("the branch init's executable: %w", err)
	}
	var fds []int
	for _, p := range src {
		fd, err := unix.OpenTree(unix.AT_FDCWD, p, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
		if err != nil {
			closeAll(fds)
			return nil, nil, fmt.Errorf("open_tree %s: %w", p, err)
		}
		fds = append(fds, fd)
	}
	return list, fds, nil
}

// buildExecRoot makes, on the calling thread (locked, with a private mount namespace
// and fs state), the root the branch init is exec'd in: a tmpfs with the exec tree
// (files are fds, in the order of list's file entries), the base namespace's harmless
// devices, an unmasked proc (branch.go says why) and an empty /initroot, pivoted into
// with the old root detached. The working directory is /initroot.
func buildExecRoot(list []execEntry, fds []int) error {
	const x = "/dev/shm"
	if err := unix.Mount("tmpfs", x, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=0755,size=64k"); err != nil {
		return fmt.Errorf("mount the exec root: %w", err)
	}
	k := 0
	for _, e := range list {
		p := x + e.Path
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return err
		}
		if e.Target != "" {
			if err := os.Symlink(e.Target, p); err != nil && !os.IsExist(err) {
				return err
			}
			continue
		}
		if k >= len(fds) {
			return fmt.Errorf("exec tree: %d files, %d fds", k+1, len(fds))
		}
		f, err := os.OpenFile(p, os.O_CREATE|os.O_WRONLY, 0o755)
		if err != nil {
			return err
		}
		f.Close()
		if err := unix.MoveMount(fds[k], "", unix.AT_FDCWD, p, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
			return fmt.Errorf("attach %s: %w", e.Path, err)
		}
		k++
	}
	if k != len(fds) {
		return fmt.Errorf("exec tree: %d files, %d fds", k, len(fds))
	}
	for _, d := range []string{"dev", "proc", "initroot", "oldroot"} {
		if err := os.MkdirAll(filepath.Join(x, d), 0o755); err != nil {
			return err
		}
	}
	for _, name := range []string{"null", "zero", "full", "random", "urandom", "tty"} {
		p := filepath.Join(x, "dev", name)
		f, err := os.OpenFile(p, os.O_CREATE|os.O_WRONLY, 0o666)
		if err != nil {
			return err
		}
		f.Close()
		if err := unix.Mount("/dev/"+name, p, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("bind /dev/%s: %w", name, err)
		}
	}
	// A fully visible proc of P_S (the base one has masks over it), before the masked
	// one goes with the old root.
	if err := unix.Mount("proc", x+"/proc", "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("mount an unmasked proc for the branch init: %w", err)
	}
	if err := unix.PivotRoot(x, x+"/oldroot"); err != nil {
		return fmt.Errorf("pivot_root into the exec root: %w", err)
	}
	if err := unix.Chdir("/"); err != nil {
		return err
	}
	if err := unix.Unmount("/oldroot", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("detach the base root: %w", err)
	}
	return unix.Chdir("/initroot")
}
