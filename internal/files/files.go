// Package files reads and writes a sandbox's filesystem from the daemon, confined to
// it. Every function takes root, an fd on the root of the sandbox's current overlay
// (sandbox.RootFD), and a sandbox path: absolute, "/" being the sandbox's root
// (Resolve turns a path relative to the workdir into one).
//
// # Confinement
//
// Paths are resolved by the kernel with openat2 and
// RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV:
//
//   - ".." never climbs above root, and an absolute symlink resolves from root: a
//     symlink to "/etc" or "/../../etc" names the sandbox's /etc, as it does for the
//     sandbox's own processes, never the host's.
//   - No mount is crossed: the sandbox's /proc, /dev and /dev/shm (and anything a
//     sandboxed process mounts) are other mounts stacked inside the overlay, so a path
//     into them is refused (ErrOtherMount). That also rules out /proc's magic links
//     (/proc/self/root, /proc/1/cwd...), which RESOLVE_NO_MAGICLINKS refuses besides.
//
// A path given by the caller whose ".." components climb above "/" is refused outright
// (ErrEscape) rather than clamped: that is an escape attempt, not a sandbox path.
//
// Beyond the resolution of a path's directory, every step works on a directory fd with
// *at calls that never follow a symlink (unlinkat, mkdirat, renameat, linkat, statx
// with AT_SYMLINK_NOFOLLOW, openat2 with RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS), so a
// sandboxed process that swaps a name for a symlink while an operation runs cannot
// redirect it outside the root. A file is read only after an O_PATH open has shown it is
// a regular file, and is then reopened through that very fd (no device node, FIFO or
// socket is ever opened).
//
// Writes go through the overlay like any process's: copy-up happens, frozen layers are
// never touched.
package files

import (
	"errors"
	"fmt"
	"os"
	"path"
	"sort"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/apitypes"
	"deltabox/internal/errdefs"
)

// Limits.
const (
	// DefaultMaxRead caps what one read returns; larger files are read in ranges.
	DefaultMaxRead = 64 << 20
	// DefaultMaxWrite caps the content of one write.
	DefaultMaxWrite = 64 << 20
	// DefaultMaxEntries caps the entries of one listing (Listing.Truncated says so).
	DefaultMaxEntries = 10000
	// DefaultMaxDepth caps the depth of a recursive listing.
	DefaultMaxDepth = 32
	// maxSymlinks is how many symlinks a write follows for its final component (as
	// the kernel's own limit).
	maxSymlinks = 40
)

// Errors. Each is wrapped with the path and an errdefs class (ErrInvalid: 400).
var (
	// ErrEscape: the path's ".." components climb above the sandbox's root.
	ErrEscape = errors.New("the path leaves the sandbox's filesystem")
	// ErrOtherMount: the path crosses into another mount (/proc, /dev, /dev/shm).
	ErrOtherMount = errors.New("the path crosses into another mount; the sandbox's /proc, /dev and /dev/shm are not reachable through the files API")
)

// resolveFlags confine a lookup from the sandbox's root.
const resolveFlags = unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV

// beneathFlags confine a one-component lookup from a directory fd: no symlink, no mount.
const beneathFlags = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV

// Info describes one file, and Listing is the answer of List. Both are answers of the
// files API: their wire form is defined once, in apitypes.
type (
	Info    = apitypes.FileInfo
	Listing = apitypes.FileListing
)

// Resolve turns p, absolute or relative to workdir, into a clean absolute sandbox
// path. A path whose ".." components would climb above "/" is refused with ErrEscape.
func Resolve(workdir, p string) (string, error) {
	if p == "" {
		return "", fmt.Errorf("a path is required: %w", errdefs.ErrInvalid)
	}
	if strings.IndexByte(p, 0) >= 0 {
		return "", fmt.Errorf("path %q contains a NUL byte: %w", p, errdefs.ErrInvalid)
	}
	full := p
	if !strings.HasPrefix(p, "/") {
		if !strings.HasPrefix(workdir, "/") {
			return "", fmt.Errorf("relative path %q needs an absolute workdir (got %q): %w", p, workdir, errdefs.ErrInvalid)
		}
		full = workdir + "/" + p
	}
	depth := 0
	for _, c := range strings.Split(full, "/") {
		switch c {
		case "", ".":
		case "..":
			depth--
			if depth < 0 {
				return "", fmt.Errorf("path %q: %w: no path can go above the sandbox's \"/\": %w", p, ErrEscape, errdefs.ErrInvalid)
			}
		default:
			depth++
		}
	}
	return path.Clean(full), nil
}

// rel checks p and returns it relative to the root ("" for the root itself), with no
// "." or ".." component.
func rel(p string) (string, error) {
	if !strings.HasPrefix(p, "/") {
		return "", fmt.Errorf("path %q must be absolute in the sandbox: %w", p, errdefs.ErrInvalid)
	}
	c, err := Resolve("/", p)
	if err != nil {
		return "", err
	}
	return strings.TrimPrefix(c, "/"), nil
}

func split(r string) (dir, name string) {
	i := strings.LastIndexByte(r, '/')
	if i < 0 {
		return "", r
	}
	return r[:i], r[i+1:]
}

func abs(r string) string { return "/" + r }

// fsErr turns an errno met while working on sandbox path p into a classified error.
func fsErr(p string, err error) error {
	var en syscall.Errno
	if !errors.As(err, &en) {
		return fmt.Errorf("%s: %w", p, err)
	}
	switch en {
	case unix.ENOENT:
		return fmt.Errorf("%s: no such file or directory in the sandbox: %w", p, errdefs.ErrNotFound)
	case unix.ENOTDIR:
		return fmt.Errorf("%s: a component of the path is not a directory: %w", p, errdefs.ErrNotFound)
	case unix.EXDEV:
		return fmt.Errorf("%s: %w: %w", p, ErrOtherMount, errdefs.ErrInvalid)
	case unix.ELOOP:
		return fmt.Errorf("%s: too many levels of symlinks, or a /proc magic link: %w", p, errdefs.ErrInvalid)
	case unix.EISDIR:
		return fmt.Errorf("%s: is a directory: %w", p, errdefs.ErrInvalid)
	case unix.ENOTEMPTY, unix.EEXIST:
		return fmt.Errorf("%s: %v: %w", p, en, errdefs.ErrConflict)
	case unix.ENAMETOOLONG, unix.EINVAL, unix.EPERM, unix.EACCES, unix.EROFS, unix.EBUSY:
		return fmt.Errorf("%s: %v: %w", p, en, errdefs.ErrInvalid)
	case unix.ENOSPC, unix.EDQUOT:
		return fmt.Errorf("%s: %v (the store is full): %w", p, en, errdefs.ErrUnavailable)
	}
	return fmt.Errorf("%s: %w", p, err)
}

// openat2 opens r (relative to root, "" for root) confined to the sandbox.
func openat2(root int, r string, flags uint64) (int, error) {
	return openHow(root, r, flags, resolveFlags)
}

func openHow(dirfd int, r string, flags, resolve uint64) (int, error) {
	if r == "" {
		r = "."
	}
	flags |= unix.O_CLOEXEC
	if flags&unix.O_PATH == 0 {
		flags |= unix.O_NOCTTY // (openat2 refuses it with O_PATH)
	}
	how := unix.OpenHow{Flags: flags, Resolve: resolve}
	for i := 0; ; i++ {
		fd, err := unix.Openat2(dirfd, r, &how)
		// EAGAIN: a concurrent rename or mount made the kernel give up on ".."
		// safety checks; trying again is what the man page advises.
		if (err == unix.EAGAIN && i < 32) || err == unix.EINTR {
			continue
		}
		return fd, err
	}
}

// openDir opens directory r with O_PATH.
func openDir(root int, r string) (int, error) {
	return openat2(root, r, unix.O_PATH|unix.O_DIRECTORY)
}

func statx(dirfd int, name string) (*unix.Statx_t, error) {
	var st unix.Statx_t
	flags := unix.AT_SYMLINK_NOFOLLOW | unix.AT_NO_AUTOMOUNT | unix.AT_STATX_SYNC_AS_STAT
	if name == "" {
		flags |= unix.AT_EMPTY_PATH
	}
	for {
		err := unix.Statx(dirfd, name, flags, unix.STATX_BASIC_STATS, &st)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return nil, err
		}
		return &st, nil
	}
}

func isMountRoot(st *unix.Statx_t) bool {
	return st.Attributes_mask&unix.STATX_ATTR_MOUNT_ROOT != 0 && st.Attributes&unix.STATX_ATTR_MOUNT_ROOT != 0
}

func fileType(mode uint32) (typ string, lsChar byte) {
	switch mode & unix.S_IFMT {
	case unix.S_IFREG:
		return "file", '-'
	case unix.S_IFDIR:
		return "dir", 'd'
	case unix.S_IFLNK:
		return "symlink", 'l'
	case unix.S_IFIFO:
		return "fifo", 'p'
	case unix.S_IFSOCK:
		return "socket", 's'
	case unix.S_IFCHR:
		return "char", 'c'
	case unix.S_IFBLK:
		return "block", 'b'
	}
	return "unknown", '?'
}

// lsPermissions renders mode as ls -l does ("-rwsr-xr-x").
func lsPermissions(typ byte, mode uint32) string {
	b := []byte{typ, '-', '-', '-', '-', '-', '-', '-', '-', '-'}
	for i, c := range "rwxrwxrwx" {
		if mode&(1<<(8-i)) != 0 {
			b[1+i] = byte(c)
		}
	}
	special := func(bit uint32, i int, set, unset byte) {
		if mode&bit != 0 {
			if b[i] == 'x' {
				b[i] = set
			} else {
				b[i] = unset
			}
		}
	}
	special(unix.S_ISUID, 3, 's', 'S')
	special(unix.S_ISGID, 6, 's', 'S')
	special(unix.S_ISVTX, 9, 't', 'T')
	return string(b)
}

func readlink(dirfd int, name string) (string, error) {
	buf := make([]byte, unix.PathMax)
	n, err := unix.Readlinkat(dirfd, name, buf)
	if err != nil {
		return "", err
	}
	return string(buf[:n]), nil
}

// info builds the Info of name in dirfd from its statx.
func info(dirfd int, name, p string, st *unix.Statx_t) Info {
	mode := uint32(st.Mode)
	typ, c := fileType(mode)
	in := Info{
		Name: name, Path: p, Type: typ, Size: int64(st.Size), Mode: mode & 0o7777,
		Permissions: lsPermissions(c, mode), UID: st.Uid, GID: st.Gid,
		ModTime:    time.Unix(st.Mtime.Sec, int64(st.Mtime.Nsec)).UTC(),
		MountPoint: name != "" && isMountRoot(st),
	}
	if p == "/" {
		in.Name = "/"
	}
	if typ == "symlink" {
		in.LinkTarget, _ = readlink(dirfd, name)
	}
	return in
}

// Stat describes sandbox path p without following a final symlink (lstat): a symlink
// is reported as one, with its target.
func Stat(root int, p string) (*Info, error) {
	r, err := rel(p)
	if err != nil {
		return nil, err
	}
	p = abs(r)
	if r == "" {
		st, err := statx(root, "")
		if err != nil {
			return nil, fsErr(p, err)
		}
		in := info(root, "", p, st)
		return &in, nil
	}
	dir, name := split(r)
	dfd, err := openDir(root, dir)
	if err != nil {
		return nil, fsErr(p, err)
	}
	defer unix.Close(dfd)
	st, err := statx(dfd, name)
	if err != nil {
		return nil, fsErr(p, err)
	}
	in := info(dfd, name, p, st)
	return &in, nil
}

// ListOptions configures List.
type ListOptions struct {
	Recursive  bool
	MaxDepth   int // levels below p for a recursive listing (0: DefaultMaxDepth)
	MaxEntries int // 0: DefaultMaxEntries
}

// List lists directory p (a final symlink to a directory is followed, as ls does),
// sorted by name; recursively, each directory's entries follow it. Mount points are
// listed (MountPoint) but not entered.
func List(root int, p string, o ListOptions) (*Listing, error) {
	r, err := rel(p)
	if err != nil {
		return nil, err
	}
	p = abs(r)
	if o.MaxDepth <= 0 {
		o.MaxDepth = DefaultMaxDepth
	}
	if o.MaxEntries <= 0 {
		o.MaxEntries = DefaultMaxEntries
	}
	pfd, err := openat2(root, r, unix.O_PATH)
	if err != nil {
		return nil, fsErr(p, err)
	}
	st, err := statx(pfd, "")
	if err != nil {
		unix.Close(pfd)
		return nil, fsErr(p, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		unix.Close(pfd)
		return nil, fmt.Errorf("%s is not a directory (stat or read it instead): %w", p, errdefs.ErrInvalid)
	}
	dfd, err := openHow(pfd, ".", unix.O_RDONLY|unix.O_DIRECTORY, beneathFlags)
	unix.Close(pfd)
	if err != nil {
		return nil, fsErr(p, err)
	}
	l := &Listing{Path: p, Entries: []Info{}}
	err = list(dfd, p, 1, o, l)
	return l, err
}

// list appends the entries of directory dfd (sandbox path p) to l and closes dfd.
func list(dfd int, p string, depth int, o ListOptions, l *Listing) error {
	f := os.NewFile(uintptr(dfd), p)
	defer func() { _ = f.Close() }() // a directory, only read: its close has nothing to report
	names, err := f.Readdirnames(-1)
	if err != nil {
		return fsErr(p, err)
	}
	sort.Strings(names)
	for _, name := range names {
		if len(l.Entries) >= o.MaxEntries {
			l.Truncated = true
			return nil
		}
		cp := path.Join(p, name)
		st, err := statx(dfd, name)
		if err != nil {
			if errors.Is(err, unix.ENOENT) {
				continue // removed meanwhile
			}
			return fsErr(cp, err)
		}
		in := info(dfd, name, cp, st)
		l.Entries = append(l.Entries, in)
		if o.Recursive && in.Type == "dir" && !in.MountPoint && depth < o.MaxDepth {
			cfd, err := openHow(dfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, beneathFlags)
			if err != nil {
				if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.EXDEV) || errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR) {
					continue // changed meanwhile
				}
				return fsErr(cp, err)
			}
			if err := list(cfd, cp, depth+1, o, l); err != nil {
				return err
			}
			if l.Truncated {
				return nil
			}
		}
	}
	return nil
}

// SandboxID is host id as a sandbox whose user namespace maps 0..65535 to
// base..base+65535 sees it: 65534 (the kernel's overflow id) for an id outside the
// range, id itself when base is 0 (no user namespace).
func SandboxID(id, base uint32) uint32 {
	switch {
	case base == 0:
		return id
	case id >= base && id-base < 1<<16:
		return id - base
	default:
		return 65534
	}
}
