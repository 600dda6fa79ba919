package sbinit

import (
	"bufio"
	"bytes"
	"debug/buildinfo"
	"debug/elf"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
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
// of its own private mount namespace (built once, at its first branch: branchMaker) at
// the paths the loader looks for, with the symlinks on those paths (/lib -> usr/lib...)
// made again, the binary at branchExe. A user namespace's process may attach a detached
// mount into a mount namespace it owns (checked on Linux 6.18). That tmpfs becomes the
// root of the thread's namespace (pivot_root, the base tree detached), and each branch
// init's setupRoot pivots away from its copy and detaches it in turn: no branch keeps
// any of it. Nothing is written: the files are the host's, read-only for the branch
// init (it is not host root). The small init (InitBinary) is a sealed memfd instead, on
// no mount open_tree may clone (EINVAL): a copy of its fd comes with each request, and
// the thread execs it through the tmpfs's proc (/proc/self/fd/N) and closes it after.
// A request's other files, which an exec root built before already holds (the same
// devices and inodes), are closed unused.

// branchExe is where the daemon's binary is in the branch-making namespace.
const branchExe = "/deltabox"

// execEntry is one thing of the exec tree: a file (a detached mount of it comes with the
// request, in order) or a symlink.
type execEntry struct {
	Path   string `json:"path"`
	Target string `json:"target,omitempty"` // a symlink's; "" for a file
	// Memfd: the file is the small init's sealed memfd (InitBinary), its fd passed as
	// is, exec'd through /proc/self/fd: a memfd is on no mount of any namespace, so
	// open_tree cannot clone it (EINVAL) nor a bind mount attach it.
	Memfd bool `json:"memfd,omitempty"`
}

var (
	execTreeOnce sync.Once
	execTreeList []execEntry
	execTreeSrc  []string // the host path of each file entry, in order
	execTreeErr  error
)

var soName = regexp.MustCompile(`\.so(\.[0-9]+)*$`)

// InitBinaryName is the small init's name (cmd/deltabox-init), which the daemon's
// binary carries (scripts/build.sh builds it first and embeds it).
const InitBinaryName = "deltabox-init"

// InitBinaryPath is the small init's package path (cmd/deltabox-init).
const InitBinaryPath = "deltabox/cmd/deltabox-init"

// UseInit gives the daemon, before it starts any sandbox, the small init its binary
// carries (exe), or nil and why it carries none (a plain `go build ./cmd/deltabox`).
func UseInit(exe []byte, whyNone string) {
	embeddedInit, embeddedWhy = exe, whyNone
}

var (
	embeddedInit []byte
	embeddedWhy  = "this binary carries no small init"
)

// InitBinary is the executable every sandbox init (Start's, and a fork's branch inits)
// runs and why: the small init the daemon's binary carries (UseInit), in a sealed
// memfd (initMemfd), else the daemon's own ("/proc/self/exe"). Resolved once per
// daemon, at its start (the daemon logs it).
func InitBinary() (path, why string) {
	initBinOnce.Do(func() {
		initBinPath, initBinWhy = "/proc/self/exe", "the daemon's own binary"
		if embeddedInit == nil {
			initBinWhy += " (" + embeddedWhy + ")"
			return
		}
		fd, err := initMemfd(embeddedInit)
		if err != nil {
			initBinWhy += " (" + err.Error() + ")"
			return
		}
		initMemfdFD = fd
		initExePath = "/proc/self/fd/" + strconv.Itoa(fd)
		initBinPath = "memfd:" + InitBinaryName
		initBinWhy = fmt.Sprintf("the small init this binary carries (%d bytes, sealed memfd)", len(embeddedInit))
	})
	return initBinPath, initBinWhy
}

var (
	initBinOnce sync.Once
	initBinPath string
	initBinWhy  string
	initMemfdFD = -1 // the sealed memfd, or -1 (the daemon's own binary)
)

// initExe is what Start execs: the sealed memfd of the small init ("/proc/self/fd/N",
// resolved in the child before its exec closes the fd), else the daemon's own binary.
// A magic link, not a path: the child execs as the sandbox's root, its host uid
// unprivileged, which may not search the directories on the way to a file (a test's
// binary is in a 0700 temporary directory). N is 100 or above, clear of the fds the
// child's exec installs at 0, 1, 2, 3... (exec.Cmd's ExtraFiles), which would cover a
// lower one.
func initExe() string {
	InitBinary()
	return initExePath
}

var initExePath = "/proc/self/exe"

// initMemfd puts the small init exe in a memfd no one may change and returns its fd
// (CLOEXEC, 100 or above). Sealed against writing, growing and shrinking, and the
// seals sealed: an fd of it, or /proc/PID/exe of an init, opened by anyone, never
// changes what the next init runs. Mode 0555: every init execs it as an unprivileged
// host uid; none may open it for writing. MFD_EXEC (Linux 6.3) asks for an executable
// memfd where vm.memfd_noexec would make it noexec by default; vm.memfd_noexec=2
// refuses it (EACCES), and the daemon then execs its own binary.
func initMemfd(exe []byte) (int, error) {
	if err := initUsable(exe); err != nil {
		return -1, err
	}
	fd, err := unix.MemfdCreate(InitBinaryName, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING|unix.MFD_EXEC)
	if err == unix.EINVAL { // before Linux 6.3, no MFD_EXEC: every memfd is executable
		fd, err = unix.MemfdCreate(InitBinaryName, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	}
	if err != nil {
		if b, rerr := os.ReadFile("/proc/sys/vm/memfd_noexec"); rerr == nil && strings.TrimSpace(string(b)) == "2" {
			return -1, fmt.Errorf("vm.memfd_noexec=2 refuses an executable memfd for the small init (%v)", err)
		}
		return -1, fmt.Errorf("memfd_create for the small init: %w", err)
	}
	defer unix.Close(fd)
	for b := exe; len(b) > 0; {
		n, err := unix.Write(fd, b)
		if err != nil {
			return -1, fmt.Errorf("write the small init's memfd: %w", err)
		}
		b = b[n:]
	}
	if err := unix.Fchmod(fd, 0o555); err != nil {
		return -1, fmt.Errorf("chmod the small init's memfd: %w", err)
	}
	seals := unix.F_SEAL_SEAL | unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_WRITE
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, seals); err != nil {
		return -1, fmt.Errorf("seal the small init's memfd: %w", err)
	}
	hi, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 100)
	if err != nil {
		return -1, err
	}
	return hi, nil
}

// initUsable says why exe cannot be a sandbox init (nil when it can): it must be the
// small init's static executable (a branch init's exec root holds no ELF interpreter
// or library for it). Being embedded by the build of the daemon's binary, it is of the
// daemon's commit.
func initUsable(exe []byte) error {
	f, err := elf.NewFile(bytes.NewReader(exe))
	if err != nil {
		return fmt.Errorf("the small init is not an ELF executable: %w", err)
	}
	defer f.Close()
	for _, pr := range f.Progs {
		if pr.Type == elf.PT_INTERP {
			return fmt.Errorf("the small init is dynamically linked: build it with CGO_ENABLED=0 (scripts/build.sh)")
		}
	}
	bi, err := buildinfo.Read(bytes.NewReader(exe))
	if err != nil {
		return fmt.Errorf("the small init: %w", err)
	}
	if bi.Path != InitBinaryPath {
		return fmt.Errorf("the small init is %s, not %s", bi.Path, InitBinaryPath)
	}
	return nil
}

// execTree lists what the branch init's exec needs: the small init's memfd alone
// (InitBinary), or the daemon's binary, its ELF interpreter, the loader's cache and
// every shared library the daemon has mapped (the same binary), each at its real path,
// and the symlinks on the way to them.
func execTree() ([]execEntry, []string, error) {
	execTreeOnce.Do(func() {
		if InitBinary(); initMemfdFD >= 0 {
			execTreeList = append(execTreeList, execEntry{Path: branchExe, Memfd: true})
			execTreeSrc = append(execTreeSrc, initExePath)
			return
		}
		execTreeList = append(execTreeList, execEntry{Path: branchExe})
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

// cloneExecTree makes a detached mount of each file of the exec tree, or a copy of the
// small init's memfd fd (the caller closes them).
func cloneExecTree() ([]execEntry, []int, error) {
	list, src, err := execTree()
	if err != nil {
		return nil, nil, fmt.Errorf("the branch init's executable: %w", err)
	}
	var fds []int
	if len(list) == 1 && list[0].Memfd {
		fd, err := unix.FcntlInt(uintptr(initMemfdFD), unix.F_DUPFD_CLOEXEC, 0)
		if err != nil {
			return nil, nil, fmt.Errorf("dup the small init's memfd: %w", err)
		}
		return list, []int{fd}, nil
	}
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
// with the old root detached. The working directory is /initroot. It returns the path
// to exec: branchExe, or for the small init's memfd "/proc/self/fd/N" of a copy of its
// fd at 100 or above (CLOEXEC; the caller closes it after the exec), clear of the fds
// the exec installs at 0, 1, 2, 3...
func buildExecRoot(list []execEntry, fds []int) (exe string, memfd int, _ error) {
	exe, memfd = branchExe, -1
	const x = "/dev/shm"
	if err := unix.Mount("tmpfs", x, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=0755,size=64k"); err != nil {
		return "", -1, fmt.Errorf("mount the exec root: %w", err)
	}
	k := 0
	for _, e := range list {
		if e.Memfd {
			if k >= len(fds) || memfd >= 0 {
				return "", memfd, fmt.Errorf("exec tree: the small init's memfd without its fd")
			}
			hi, err := unix.FcntlInt(uintptr(fds[k]), unix.F_DUPFD_CLOEXEC, 100)
			if err != nil {
				return "", -1, fmt.Errorf("dup the small init's memfd: %w", err)
			}
			exe, memfd = "/proc/self/fd/"+strconv.Itoa(hi), hi
			k++
			continue
		}
		p := x + e.Path
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return "", memfd, err
		}
		if e.Target != "" {
			if err := os.Symlink(e.Target, p); err != nil && !os.IsExist(err) {
				return "", memfd, err
			}
			continue
		}
		if k >= len(fds) {
			return "", memfd, fmt.Errorf("exec tree: %d files, %d fds", k+1, len(fds))
		}
		f, err := os.OpenFile(p, os.O_CREATE|os.O_WRONLY, 0o755)
		if err != nil {
			return "", memfd, err
		}
		f.Close()
		if err := unix.MoveMount(fds[k], "", unix.AT_FDCWD, p, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
			return "", memfd, fmt.Errorf("attach %s: %w", e.Path, err)
		}
		k++
	}
	if k != len(fds) {
		return "", memfd, fmt.Errorf("exec tree: %d files, %d fds", k, len(fds))
	}
	for _, d := range []string{"dev", "proc", "initroot", "oldroot"} {
		if err := os.MkdirAll(filepath.Join(x, d), 0o755); err != nil {
			return "", memfd, err
		}
	}
	for _, name := range []string{"null", "zero", "full", "random", "urandom", "tty"} {
		p := filepath.Join(x, "dev", name)
		f, err := os.OpenFile(p, os.O_CREATE|os.O_WRONLY, 0o666)
		if err != nil {
			return "", memfd, err
		}
		f.Close()
		if err := unix.Mount("/dev/"+name, p, "", unix.MS_BIND, ""); err != nil {
			return "", memfd, fmt.Errorf("bind /dev/%s: %w", name, err)
		}
	}
	// A fully visible proc of P_S (the base one has masks over it), before the masked
	// one goes with the old root.
	if err := unix.Mount("proc", x+"/proc", "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return "", memfd, fmt.Errorf("mount an unmasked proc for the branch init: %w", err)
	}
	if err := unix.PivotRoot(x, x+"/oldroot"); err != nil {
		return "", memfd, fmt.Errorf("pivot_root into the exec root: %w", err)
	}
	if err := unix.Chdir("/"); err != nil {
		return "", memfd, err
	}
	if err := unix.Unmount("/oldroot", unix.MNT_DETACH); err != nil {
		return "", memfd, fmt.Errorf("detach the base root: %w", err)
	}
	return exe, memfd, unix.Chdir("/initroot")
}
