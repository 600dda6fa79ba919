package store

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"strings"

	"golang.org/x/sys/unix"
)

// The attributes of a sandbox's "/". overlayfs takes the merged root directory's mode,
// owner, times and xattrs from the upper layer's root directory alone (the lowers' roots
// only contribute entries), so every new upper must start with the attributes "/" had:
// a checkpoint's new upper those of the upper it freezes, a restore's those of the
// node's top layer. A frozen layer's root keeps them for the restores to come (Freeze).
//
// Three kinds of xattrs sit on an upper's root directory:
//   - the sandbox's own (user.*, trusted.*, security.*, system.posix_acl_*): part of
//     the state, copied and compared;
//   - overlayfs's bookkeeping on its upper (trusted.overlay.uuid, trusted.overlay.impure,
//     ...): they describe that upper, not "/", and are neither copied nor compared;
//   - a trusted.overlay.X set from inside the sandbox, which overlayfs (Linux 6.7+)
//     stores escaped as trusted.overlay.overlay.X: the sandbox's own.
//
// Every function here works on directories of the store (layer and image roots), which
// the daemon owns: never on a path the sandbox can change (a root is opened with
// O_NOFOLLOW, and nothing below it is touched).

// RootAttrs are the attributes of a layer's root directory that make up "/"'s.
type RootAttrs struct {
	Mode, Uid, Gid uint32 // Mode: permission bits (07777)
	Atime, Mtime   unix.Timespec
	Xattrs         []Xattr // the sandbox's own, sorted by name
}

// Xattr is one extended attribute.
type Xattr struct {
	Name  string
	Value []byte
}

// Equal reports whether a and b describe the same "/", atime aside: reading "/"
// moves its atime (relatime), which must not make a layer of an unchanged sandbox.
func (a *RootAttrs) Equal(b *RootAttrs) bool {
	if a.Mode != b.Mode || a.Uid != b.Uid || a.Gid != b.Gid || a.Mtime != b.Mtime || len(a.Xattrs) != len(b.Xattrs) {
		return false
	}
	for i := range a.Xattrs {
		if a.Xattrs[i].Name != b.Xattrs[i].Name || !bytes.Equal(a.Xattrs[i].Value, b.Xattrs[i].Value) {
			return false
		}
	}
	return true
}

// sandboxXattr reports whether an xattr of an upper's root is the sandbox's own, not
// overlayfs's bookkeeping (see above).
func sandboxXattr(name string) bool {
	return !strings.HasPrefix(name, "trusted.overlay.") || strings.HasPrefix(name, "trusted.overlay.overlay.")
}

// ReadRootAttrs reads the root attributes of directory p (a layer's diff/ or frozen/,
// or an image's rootfs).
func ReadRootAttrs(p string) (*RootAttrs, error) {
	fd, err := openDir(p)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", p, err)
	}
	defer unix.Close(fd)
	return readRootAttrs(fd)
}

func readRootAttrs(fd int) (*RootAttrs, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, err
	}
	a := &RootAttrs{Mode: st.Mode & 0o7777, Uid: st.Uid, Gid: st.Gid, Atime: st.Atim, Mtime: st.Mtim}
	names, err := listXattrs(fd)
	if err != nil {
		return nil, err
	}
	for _, n := range names {
		if !sandboxXattr(n) {
			continue
		}
		v, err := getXattr(fd, n)
		if errors.Is(err, unix.ENODATA) {
			continue // removed meanwhile
		}
		if err != nil {
			return nil, fmt.Errorf("read xattr %s: %w", n, err)
		}
		a.Xattrs = append(a.Xattrs, Xattr{n, v})
	}
	slices.SortFunc(a.Xattrs, func(x, y Xattr) int { return strings.Compare(x.Name, y.Name) })
	return a, nil
}

// SameModeOwner reports whether a and b have the same mode and owner.
func (a *RootAttrs) SameModeOwner(b *RootAttrs) bool {
	return a.Mode == b.Mode && a.Uid == b.Uid && a.Gid == b.Gid
}

// Upper is what a checkpoint reads of the upper it is about to freeze.
type Upper struct {
	Empty bool       // no entries: no change below "/"
	Root  *RootAttrs // "/"'s attributes, which the next upper must get
	Has   bool       // it holds an entry named one of the names asked for
}

// ReadUpper reads upper directory p, and whether it holds one of names, with one open
// and a few fd-based calls: it is on the checkpoint's critical path (see Freeze).
func ReadUpper(p string, names ...string) (*Upper, error) {
	fd, err := openDir(p)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", p, err)
	}
	defer unix.Close(fd)
	first, err := dirNames(fd, 1)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", p, err)
	}
	u := &Upper{Empty: len(first) == 0}
	if u.Root, err = readRootAttrs(fd); err != nil {
		return nil, fmt.Errorf("read %s: %w", p, err)
	}
	var st unix.Stat_t
	for _, n := range names {
		if !u.Empty && unix.Fstatat(fd, n, &st, unix.AT_SYMLINK_NOFOLLOW) == nil {
			u.Has = true
			break
		}
	}
	return u, nil
}

// SetRootAttrs gives directory p (an upper's root, made empty, or mounted and unused
// yet) the root attributes a, changing only what differs: mode, owner, the sandbox's
// xattrs (those p has and a has not are removed; overlayfs's own on p are kept), and
// atime and mtime, last (an xattr change moves neither, but keeps the order safe).
func SetRootAttrs(p string, a *RootAttrs) error {
	fd, err := openDir(p)
	if err != nil {
		return fmt.Errorf("open %s: %w", p, err)
	}
	defer unix.Close(fd)
	cur, err := readRootAttrs(fd)
	if err != nil {
		return err
	}
	if cur.Uid != a.Uid || cur.Gid != a.Gid {
		if err := unix.Fchown(fd, int(a.Uid), int(a.Gid)); err != nil {
			return err
		}
	}
	if cur.Mode != a.Mode || cur.Uid != a.Uid || cur.Gid != a.Gid { // chown clears setgid
		if err := unix.Fchmod(fd, a.Mode); err != nil {
			return err
		}
	}
	for _, x := range cur.Xattrs {
		if !slices.ContainsFunc(a.Xattrs, func(y Xattr) bool { return y.Name == x.Name }) {
			if err := unix.Fremovexattr(fd, x.Name); err != nil && !errors.Is(err, unix.ENODATA) {
				return fmt.Errorf("remove xattr %s: %w", x.Name, err)
			}
		}
	}
	for _, x := range a.Xattrs {
		i := slices.IndexFunc(cur.Xattrs, func(y Xattr) bool { return y.Name == x.Name })
		if i >= 0 && bytes.Equal(cur.Xattrs[i].Value, x.Value) {
			continue
		}
		if err := unix.Fsetxattr(fd, x.Name, x.Value, 0); err != nil {
			return fmt.Errorf("set xattr %s: %w", x.Name, err)
		}
	}
	if cur.Atime != a.Atime || cur.Mtime != a.Mtime {
		if err := futimens(fd, a.Atime, a.Mtime); err != nil {
			return err
		}
	}
	return nil
}

// CopyRootAttrs gives directory to the root attributes of directory from.
func CopyRootAttrs(from, to string) error {
	a, err := ReadRootAttrs(from)
	if err != nil {
		return err
	}
	return SetRootAttrs(to, a)
}

func futimens(fd int, atime, mtime unix.Timespec) error {
	return unix.UtimesNanoAt(fd, "", []unix.Timespec{atime, mtime}, unix.AT_EMPTY_PATH)
}

// listXattrs lists the names of the xattrs of fd (none where the filesystem has none).
func listXattrs(fd int) ([]string, error) {
	buf := make([]byte, 1024)
	for {
		n, err := unix.Flistxattr(fd, buf)
		switch {
		case errors.Is(err, unix.ENOTSUP):
			return nil, nil
		case errors.Is(err, unix.ERANGE):
			sz, err := unix.Flistxattr(fd, nil)
			if err != nil {
				return nil, err
			}
			buf = make([]byte, sz+1024)
			continue
		case err != nil:
			return nil, err
		}
		return splitNul(buf[:n]), nil
	}
}

func getXattr(fd int, name string) ([]byte, error) {
	buf := make([]byte, 256)
	for {
		n, err := unix.Fgetxattr(fd, name, buf)
		if errors.Is(err, unix.ERANGE) {
			sz, err := unix.Fgetxattr(fd, name, nil)
			if err != nil {
				return nil, err
			}
			buf = make([]byte, sz+256)
			continue
		}
		if err != nil {
			return nil, err
		}
		return buf[:n], nil
	}
}
