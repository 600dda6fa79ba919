package files

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"deltabox/internal/errdefs"
)

// Open opens regular file p for reading (a symlink is followed, inside the sandbox).
// Directories and special files are refused. The caller closes the file.
func Open(root int, p string) (*os.File, *Info, error) {
	r, err := rel(p)
	if err != nil {
		return nil, nil, err
	}
	p = abs(r)
	pfd, err := openat2(root, r, unix.O_PATH)
	if err != nil {
		return nil, nil, fsErr(p, err)
	}
	defer unix.Close(pfd)
	st, err := statx(pfd, "")
	if err != nil {
		return nil, nil, fsErr(p, err)
	}
	in := info(pfd, "", p, st)
	in.Name = baseName(p)
	switch in.Type {
	case "file":
	case "dir":
		return nil, nil, fmt.Errorf("%s is a directory (list it instead): %w", p, errdefs.ErrInvalid)
	default:
		return nil, nil, fmt.Errorf("%s is not a regular file (it is a %s): %w", p, in.Type, errdefs.ErrInvalid)
	}
	// Reopen the very inode the O_PATH fd holds: the name may have been swapped since.
	fd, err := unix.Open("/proc/self/fd/"+strconv.Itoa(pfd), unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOCTTY, 0)
	if err != nil {
		return nil, nil, fsErr(p, err)
	}
	return os.NewFile(uintptr(fd), p), &in, nil
}

// EmptyDir reports whether directory p is missing or empty. A final symlink, a file,
// another mount (p confined as every path here) or an error is not. Opened O_NONBLOCK:
// a FIFO swapped in for the name must not block the daemon (O_DIRECTORY refuses it).
func EmptyDir(root int, p string) bool {
	r, err := rel(p)
	if err != nil {
		return false
	}
	fd, err := openat2(root, r, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_NONBLOCK)
	if errors.Is(err, unix.ENOENT) {
		return true
	}
	if err != nil {
		return false
	}
	d := os.NewFile(uintptr(fd), abs(r))
	defer func() { _ = d.Close() }() // read-only, after the read
	_, err = d.Readdirnames(1)
	return err == io.EOF
}

func baseName(p string) string {
	if p == "/" {
		return "/"
	}
	_, name := split(p)
	return name
}

// ReadRange is the part of a file of size bytes that a read from off of length bytes
// (0: to the end) returns, or an error if that is over max bytes (0: DefaultMaxRead).
func ReadRange(p string, size, off, length, max int64) (int64, error) {
	if off < 0 || length < 0 {
		return 0, fmt.Errorf("offset and length must be >= 0: %w", errdefs.ErrInvalid)
	}
	if max <= 0 {
		max = DefaultMaxRead
	}
	n := size - off
	if n < 0 {
		n = 0
	}
	if length > 0 && length < n {
		n = length
	}
	if n > max {
		return 0, fmt.Errorf("%s: reading %d bytes (the file has %d) is over the limit of %d bytes per read: read it in ranges with offset and length: %w",
			p, n, size, max, errdefs.ErrInvalid)
	}
	return n, nil
}

// Read returns length bytes (0: to the end) of regular file p from off, refusing more
// than max bytes (0: DefaultMaxRead), and the file's Info.
func Read(root int, p string, off, length, max int64) ([]byte, *Info, error) {
	f, in, err := Open(root, p)
	if err != nil {
		return nil, nil, err
	}
	defer func() { _ = f.Close() }() // only read: its close has nothing to report
	n, err := ReadRange(in.Path, in.Size, off, length, max)
	if err != nil {
		return nil, nil, err
	}
	b := make([]byte, n)
	m, err := f.ReadAt(b, off)
	if err != nil && err != io.EOF {
		return nil, nil, fsErr(in.Path, err)
	}
	return b[:m], in, nil
}

// WriteOptions configures Write.
type WriteOptions struct {
	// Mode, when HasMode, is the file's permission bits. Otherwise an existing file
	// keeps its mode and a new one gets 0644.
	Mode    uint32
	HasMode bool
	// MkdirParents creates missing parent directories (0755).
	MkdirParents bool
	// MaxBytes caps the content (0: DefaultMaxWrite).
	MaxBytes int64
}

// Write replaces the content of p with what r yields, atomically: the content goes to
// a new inode in p's directory, which is then renamed over p, so a reader sees the old
// content or the new, never a mix. An existing file keeps its owner and (unless
// o.HasMode) its mode. A final symlink is followed inside the sandbox, as open(2) by a
// sandboxed process would, so the symlink's target is what is replaced.
func Write(root int, p string, r io.Reader, o WriteOptions) (*Info, error) {
	rp, err := rel(p)
	if err != nil {
		return nil, err
	}
	p = abs(rp)
	if rp == "" {
		return nil, fmt.Errorf("/ is a directory: %w", errdefs.ErrInvalid)
	}
	if o.HasMode && o.Mode&^0o7777 != 0 {
		return nil, fmt.Errorf("mode %o: only permission bits (07777) can be set: %w", o.Mode, errdefs.ErrInvalid)
	}
	if o.MaxBytes <= 0 {
		o.MaxBytes = DefaultMaxWrite
	}
	if o.MkdirParents {
		if dir, _ := split(rp); dir != "" {
			if _, err := mkdirAll(root, dir, 0o755); err != nil {
				return nil, err
			}
		}
	}
	dfd, name, target, err := resolveFinal(root, rp)
	if errors.Is(err, errdefs.ErrNotFound) && o.MkdirParents && target != p {
		// A final symlink whose target's directory is missing: make it (inside the
		// sandbox, like any directory of the path).
		if dir, _ := split(strings.TrimPrefix(target, "/")); dir != "" {
			if _, err := mkdirAll(root, dir, 0o755); err != nil {
				return nil, err
			}
		}
		dfd, name, target, err = resolveFinal(root, rp)
	}
	if err != nil {
		if errors.Is(err, errdefs.ErrNotFound) && !o.MkdirParents {
			if target != p {
				return nil, fmt.Errorf("%s is a symlink to %w (the directory must exist, or pass mkdir to create it)", p, err)
			}
			return nil, fmt.Errorf("%w (the directory must exist, or pass mkdir to create it)", err)
		}
		return nil, err
	}
	defer unix.Close(dfd)

	mode, uid, gid, keepOwner := uint32(0o644), -1, -1, false
	switch st, err := statx(dfd, name); {
	case err == nil:
		if isMountRoot(st) {
			return nil, fmt.Errorf("%s: %w: %w", target, ErrOtherMount, errdefs.ErrInvalid)
		}
		if st.Mode&unix.S_IFMT == unix.S_IFDIR {
			return nil, fmt.Errorf("%s is a directory: %w", target, errdefs.ErrInvalid)
		}
		if st.Mode&unix.S_IFMT == unix.S_IFREG {
			mode, uid, gid, keepOwner = uint32(st.Mode)&0o7777, int(st.Uid), int(st.Gid), true
		}
	case errors.Is(err, unix.ENOENT):
	default:
		return nil, fsErr(target, err)
	}
	if o.HasMode {
		mode = o.Mode
	}

	f, tmp, err := createTemp(dfd)
	if err != nil {
		return nil, fsErr(target, err)
	}
	linked, closed := tmp != "", false
	defer func() {
		if !closed {
			_ = f.Close() // a failed write: its error is the one reported
		}
		if linked {
			// A failed write's temporary name, removed as a courtesy: the write's
			// error is the one reported, and a name left is hidden (.deltabox-tmp-*).
			_ = unix.Unlinkat(dfd, tmp, 0)
		}
	}()
	n, err := io.Copy(f, io.LimitReader(r, o.MaxBytes+1))
	if err != nil {
		return nil, fmt.Errorf("write %s: %w", target, err)
	}
	if n > o.MaxBytes {
		return nil, fmt.Errorf("%s: the content is over the limit of %d bytes per write: %w", p, o.MaxBytes, errdefs.ErrInvalid)
	}
	fd := int(f.Fd())
	// Owner first: chown clears setuid/setgid, which the chmod then sets.
	if keepOwner {
		if err := unix.Fchown(fd, uid, gid); err != nil {
			return nil, fsErr(target, err)
		}
	}
	if err := unix.Fchmod(fd, mode); err != nil {
		return nil, fsErr(target, err)
	}
	if !linked {
		// An O_TMPFILE inode: give it a name (linkat cannot replace), then rename it.
		for {
			tmp = tempName()
			err = unix.Linkat(fd, "", dfd, tmp, unix.AT_EMPTY_PATH)
			if err != unix.EEXIST {
				break
			}
		}
		if err != nil {
			return nil, fsErr(target, err)
		}
		linked = true
	}
	// Closed, and the close checked, before the file takes the name: a write that
	// fails does not replace the old file.
	closed = true
	if err := f.Close(); err != nil {
		return nil, fsErr(target, err)
	}
	if err := unix.Renameat(dfd, tmp, dfd, name); err != nil {
		return nil, fsErr(target, err)
	}
	linked = false
	st, err := statx(dfd, name)
	if err != nil {
		return nil, fsErr(target, err)
	}
	in := info(dfd, name, p, st)
	in.Name = baseName(p)
	return &in, nil
}

func tempName() string {
	b := make([]byte, 8)
	rand.Read(b)
	return ".deltabox-tmp-" + hex.EncodeToString(b)
}

// createTemp makes the new inode of a write in directory dfd: an unnamed O_TMPFILE
// (tmp "") where the filesystem supports it, else a fresh hidden name.
func createTemp(dfd int) (*os.File, string, error) {
	fd, err := openHow(dfd, ".", unix.O_TMPFILE|unix.O_WRONLY, beneathFlags)
	if err == nil {
		return os.NewFile(uintptr(fd), "tmpfile"), "", nil
	}
	if err != unix.EOPNOTSUPP && err != unix.EISDIR && err != unix.EINVAL {
		return nil, "", err
	}
	for {
		tmp := tempName()
		how := unix.OpenHow{Flags: unix.O_CREAT | unix.O_EXCL | unix.O_WRONLY | unix.O_NOFOLLOW | unix.O_CLOEXEC, Mode: 0o600, Resolve: beneathFlags}
		fd, err := unix.Openat2(dfd, tmp, &how)
		if err == unix.EEXIST {
			continue
		}
		if err != nil {
			return nil, "", err
		}
		return os.NewFile(uintptr(fd), tmp), tmp, nil
	}
}

// resolveFinal opens (O_PATH) the directory that holds r's final component after
// following a final symlink inside the sandbox, and returns it with the component's
// name and the path it stands for (also when that directory does not exist).
func resolveFinal(root int, r string) (dfd int, name, target string, err error) {
	for hops := 0; ; hops++ {
		dir, name := split(r)
		target = abs(r)
		if name == "" || name == "." || name == ".." {
			return -1, "", "", fmt.Errorf("%s is a directory: %w", target, errdefs.ErrInvalid)
		}
		dfd, err := openDir(root, dir)
		if err != nil {
			return -1, "", target, fsErr(target, err)
		}
		link, err := readlink(dfd, name)
		if err == unix.EINVAL || err == unix.ENOENT {
			return dfd, name, target, nil // not a symlink, or nothing yet
		}
		unix.Close(dfd)
		if err != nil {
			return -1, "", "", fsErr(target, err)
		}
		if hops >= maxSymlinks {
			return -1, "", "", fsErr(target, unix.ELOOP)
		}
		if link == "" {
			return -1, "", "", fsErr(target, unix.ENOENT)
		}
		// The kernel resolves what is left with RESOLVE_IN_ROOT: ".." in the link
		// stops at the root, an absolute link starts from it.
		if strings.HasPrefix(link, "/") {
			r = strings.TrimLeft(link, "/")
		} else if dir == "" {
			r = link
		} else {
			r = dir + "/" + link
		}
		r = strings.TrimRight(r, "/")
		if r == "" {
			return -1, "", "", fmt.Errorf("%s is a directory: %w", abs(r), errdefs.ErrInvalid)
		}
	}
}

// Mkdir creates directory p with mode (0: 0755) and, with parents, its missing
// parents (0755). It reports whether p was created; an existing directory is no error
// with parents, and ErrConflict without.
func Mkdir(root int, p string, mode uint32, parents bool) (bool, error) {
	r, err := rel(p)
	if err != nil {
		return false, err
	}
	p = abs(r)
	if mode == 0 {
		mode = 0o755
	}
	if mode&^0o7777 != 0 {
		return false, fmt.Errorf("mode %o: only permission bits (07777) can be set: %w", mode, errdefs.ErrInvalid)
	}
	if parents {
		return mkdirAll(root, r, mode)
	}
	if r == "" {
		return false, fmt.Errorf("/ exists: %w", errdefs.ErrConflict)
	}
	dir, name := split(r)
	dfd, err := openDir(root, dir)
	if err != nil {
		return false, fsErr(p, err)
	}
	defer unix.Close(dfd)
	if err := mkdirat(dfd, name, mode); err != nil {
		return false, fsErr(p, err)
	}
	return true, nil
}

// mkdirat creates name in dfd and sets its mode exactly (not through the umask), on
// an fd opened without following any symlink.
func mkdirat(dfd int, name string, mode uint32) error {
	if err := unix.Mkdirat(dfd, name, mode); err != nil {
		return err
	}
	fd, err := openHow(dfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, beneathFlags)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return unix.Fchmod(fd, mode)
}

// mkdirAll creates r and its missing parents; mode is for the last one.
func mkdirAll(root int, r string, mode uint32) (bool, error) {
	if r == "" {
		return false, nil
	}
	comps := strings.Split(r, "/")
	created := false
	for i := range comps {
		prefix := strings.Join(comps[:i+1], "/")
		fd, err := openDir(root, prefix)
		if err == nil {
			unix.Close(fd)
			continue
		}
		if err != unix.ENOENT {
			if err == unix.ENOTDIR {
				return false, fmt.Errorf("%s exists and is not a directory: %w", abs(prefix), errdefs.ErrConflict)
			}
			return false, fsErr(abs(prefix), err)
		}
		pfd, err := openDir(root, strings.Join(comps[:i], "/"))
		if err != nil {
			return false, fsErr(abs(prefix), err)
		}
		m := uint32(0o755)
		if i == len(comps)-1 {
			m = mode
		}
		err = mkdirat(pfd, comps[i], m)
		unix.Close(pfd)
		if err == unix.EEXIST {
			// Made meanwhile, or a dangling symlink: check again.
			if fd, err := openDir(root, prefix); err == nil {
				unix.Close(fd)
				continue
			}
			return false, fmt.Errorf("%s exists and is not a directory (a dangling symlink?): %w", abs(prefix), errdefs.ErrConflict)
		}
		if err != nil {
			return false, fsErr(abs(prefix), err)
		}
		created = i == len(comps)-1
	}
	return created, nil
}

// Remove removes p: a file, a symlink (not its target) or an empty directory; with
// recursive, a directory and everything in it. Mount points and "/" are refused.
func Remove(root int, p string, recursive bool) error {
	r, err := rel(p)
	if err != nil {
		return err
	}
	p = abs(r)
	if r == "" {
		return fmt.Errorf("refusing to remove the sandbox's /: %w", errdefs.ErrInvalid)
	}
	dir, name := split(r)
	dfd, err := openDir(root, dir)
	if err != nil {
		return fsErr(p, err)
	}
	defer unix.Close(dfd)
	st, err := statx(dfd, name)
	if err != nil {
		return fsErr(p, err)
	}
	if isMountRoot(st) {
		return fmt.Errorf("%s: %w: %w", p, ErrOtherMount, errdefs.ErrInvalid)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		if err := unix.Unlinkat(dfd, name, 0); err != nil {
			return fsErr(p, err)
		}
		return nil
	}
	if recursive {
		if err := removeTree(dfd, name, p); err != nil {
			return err
		}
	}
	if err := unix.Unlinkat(dfd, name, unix.AT_REMOVEDIR); err != nil {
		if err == unix.ENOTEMPTY || err == unix.EEXIST {
			return fmt.Errorf("%s is a directory that is not empty (remove it recursively): %w", p, errdefs.ErrConflict)
		}
		return fsErr(p, err)
	}
	return nil
}

// removeTree empties directory name of dfd (sandbox path p) without following
// symlinks or crossing mounts.
func removeTree(dfd int, name, p string) error {
	cfd, err := openHow(dfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, beneathFlags)
	if err != nil {
		return fsErr(p, err)
	}
	f := os.NewFile(uintptr(cfd), p)
	defer func() { _ = f.Close() }() // a directory, only read: its close has nothing to report
	for {
		names, err := f.Readdirnames(1024)
		if len(names) == 0 {
			if err != nil && err != io.EOF {
				return fsErr(p, err)
			}
			return nil
		}
		for _, n := range names {
			cp := p + "/" + n
			st, err := statx(cfd, n)
			if err == unix.ENOENT {
				continue
			}
			if err != nil {
				return fsErr(cp, err)
			}
			if isMountRoot(st) {
				return fmt.Errorf("%s: %w: %w", cp, ErrOtherMount, errdefs.ErrInvalid)
			}
			flags := 0
			if st.Mode&unix.S_IFMT == unix.S_IFDIR {
				if err := removeTree(cfd, n, cp); err != nil {
					return err
				}
				flags = unix.AT_REMOVEDIR
			}
			if err := unix.Unlinkat(cfd, n, flags); err != nil && err != unix.ENOENT {
				return fsErr(cp, err)
			}
		}
	}
}
