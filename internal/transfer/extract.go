package transfer

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/image"
)

// ErrRefused marks an archive refused for what it holds (errdefs maps it: the caller
// wraps it with errdefs.ErrInvalid).
var ErrRefused = errors.New("refused")

func refuse(format string, args ...any) error {
	return fmt.Errorf(format+": %w", append(args, ErrRefused)...)
}

// keepXattr says which extended attributes a layer carries. Overlayfs's own
// trusted.overlay.* are its layer format (opaque directories, renamed directories'
// redirects, the impure and nlink marks, and a sandbox's own trusted.overlay.* escaped
// as trusted.overlay.overlay.*) and travel as they are; origin, upper and uuid hold file
// handles and the filesystem's uuid of the machine that wrote them, meaningless
// elsewhere (overlayfs treats a missing origin as none), and metacopy never occurs
// (metacopy=off). Other trusted.* are not a layer's. Everything else (user.*, security.*,
// ACLs) is the sandbox's own and kept.
func keepXattr(name string) bool {
	rest, ok := strings.CutPrefix(name, "trusted.")
	if !ok {
		return true
	}
	switch rest {
	case "overlay.opaque", "overlay.redirect", "overlay.impure", "overlay.nlink":
		return true
	}
	return strings.HasPrefix(rest, "overlay.overlay.")
}

// Limits bound an extraction. Used, when set, is shared by several extractions (the
// trees of one archive): what each wrote counts against the others.
type Limits struct {
	MaxBytes   int64 // data bytes written (holes not counted)
	MaxEntries int64
	Used       *Used
}

// Used is what extractions under one Limits wrote.
type Used struct{ Bytes, Entries int64 }

// ExtractTree writes the tar WriteTree made into dir, which must exist and be empty,
// confined to it. It refuses, naming the entry: names that are absolute, climb with
// "..", or come before their directory; an entry written twice; anything created
// through a symbolic link (every parent is opened with openat2 RESOLVE_BENEATH |
// RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV from dir); a symbolic link whose relative
// target climbs above the root; a hard link to anything but a file the archive wrote
// before; devices other than whiteouts (character 0:0), block devices and unknown
// types; trusted.* xattrs other than overlayfs's layer format (keepXattr); and more
// bytes or entries than lim. Owners, modes (setuid included: a layer's owners are the
// sandbox's, seen only through its user namespace), times, xattrs and holes are
// restored. On error, dir holds a partial tree: the caller removes it.
func ExtractTree(ctx context.Context, r io.Reader, dir string, lim Limits) error {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return &os.PathError{Op: "open", Path: dir, Err: err}
	}
	defer unix.Close(fd)
	x := &extractor{ctx: ctx, root: fd, lim: lim, dirTimes: map[string]time.Time{}}
	if lim.Used != nil {
		x.bytes, x.entries = lim.Used.Bytes, lim.Used.Entries
		defer func() { lim.Used.Bytes, lim.Used.Entries = x.bytes, x.entries }()
	}
	tr := tar.NewReader(r)
	for first := true; ; first = false {
		h, err := tr.Next()
		if err == io.EOF {
			if first {
				return refuse("the tree is empty (no root entry)")
			}
			break
		}
		if err != nil {
			return refuse("the archive is damaged or truncated: a tree in it does not read as a tar (%v)", err)
		}
		if err := x.entry(h, tr, first); err != nil {
			return err
		}
	}
	return x.finish()
}

type extractor struct {
	ctx      context.Context
	root     int
	lim      Limits
	bytes    int64
	entries  int64
	dirTimes map[string]time.Time
}

var beneath = unix.OpenHow{
	Flags:   unix.O_RDONLY | unix.O_DIRECTORY | unix.O_CLOEXEC,
	Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV,
}

// cleanName turns an entry's name into a clean relative path ("" is the root), or
// refuses it (image.CleanEntryName's rules).
func cleanName(name string) (string, error) {
	rel, why := image.CleanEntryName(name, "the layer's root")
	if why != "" {
		return "", refuse("%s", why)
	}
	return rel, nil
}

func split(rel string) (dir, base string) {
	if i := strings.LastIndexByte(rel, '/'); i >= 0 {
		return rel[:i], rel[i+1:]
	}
	return "", rel
}

// symlinkClimbs reports whether a relative target, resolved lexically from the
// directory of the link at rel, climbs above the root.
func symlinkClimbs(rel, target string) bool {
	if strings.HasPrefix(target, "/") {
		return false
	}
	dir, _ := split(rel)
	depth := 0
	if dir != "" {
		depth = strings.Count(dir, "/") + 1
	}
	for _, c := range strings.Split(target, "/") {
		switch c {
		case "", ".":
		case "..":
			if depth--; depth < 0 {
				return true
			}
		default:
			depth++
		}
	}
	return false
}

// openDir opens directory rel of the tree, never through a link.
func (x *extractor) openDir(rel, entry string) (int, error) {
	if rel == "" {
		return unix.FcntlInt(uintptr(x.root), unix.F_DUPFD_CLOEXEC, 0)
	}
	fd, err := unix.Openat2(x.root, rel, &beneath)
	switch err {
	case nil:
		return fd, nil
	case unix.ELOOP:
		return -1, refuse("entry %q: the path %q goes through a symbolic link (nothing is created through a link)", entry, rel)
	case unix.EXDEV:
		return -1, refuse("entry %q: the path %q leaves the layer", entry, rel)
	case unix.ENOENT:
		return -1, refuse("entry %q: its directory %q is not earlier in the archive", entry, rel)
	case unix.ENOTDIR:
		return -1, refuse("entry %q: %q is not a directory", entry, rel)
	}
	return -1, fmt.Errorf("entry %q: open %s: %w", entry, rel, err)
}

func (x *extractor) entry(h *tar.Header, body io.Reader, first bool) error {
	if err := x.ctx.Err(); err != nil {
		return err
	}
	if x.entries++; x.entries > x.lim.MaxEntries {
		return refuse("over %d entries: refused as an archive bomb", x.lim.MaxEntries)
	}
	rel, err := cleanName(h.Name)
	if err != nil {
		return err
	}
	if first != (rel == "") {
		return refuse("entry %q: the root directory must come first, and once", h.Name)
	}
	mode := uint32(h.Mode) & 0o7777
	xattrs := map[string]string{}
	for k, v := range h.PAXRecords {
		if name, ok := strings.CutPrefix(k, "SCHILY.xattr."); ok {
			if !keepXattr(name) {
				return refuse("entry %q: extended attribute %q is not part of a layer (only overlayfs's layer format among trusted.*)", h.Name, name)
			}
			xattrs[name] = v
		}
	}
	if rel == "" {
		if h.Typeflag != tar.TypeDir {
			return refuse("entry %q: the root must be a directory", h.Name)
		}
		x.dirTimes[""] = h.ModTime
		return setAttrs(x.root, h, mode, xattrs)
	}
	dir, base := split(rel)
	pfd, err := x.openDir(dir, h.Name)
	if err != nil {
		return err
	}
	defer unix.Close(pfd)
	exists := func(err error) error {
		if err == unix.EEXIST {
			return refuse("entry %q: written twice", h.Name)
		}
		return fmt.Errorf("entry %q: %w", h.Name, err)
	}
	switch h.Typeflag {
	case tar.TypeDir:
		if err := unix.Mkdirat(pfd, base, 0o700); err != nil {
			return exists(err)
		}
		fd, err := unix.Openat(pfd, base, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("entry %q: %w", h.Name, err)
		}
		defer unix.Close(fd)
		x.dirTimes[rel] = h.ModTime
		return setAttrs(fd, h, mode, xattrs)
	case tar.TypeReg:
		fd, err := unix.Openat(pfd, base, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
		if err != nil {
			return exists(err)
		}
		f := os.NewFile(uintptr(fd), base)
		defer f.Close()
		if err := x.writeData(f, h, body); err != nil {
			return err
		}
		if err := setAttrs(fd, h, mode, xattrs); err != nil {
			return err
		}
	case tar.TypeSymlink:
		if h.Linkname == "" || symlinkClimbs(rel, h.Linkname) {
			return refuse("entry %q: symbolic link target %q escapes the layer (a relative target may not climb above /)", h.Name, h.Linkname)
		}
		if err := unix.Symlinkat(h.Linkname, pfd, base); err != nil {
			return exists(err)
		}
		if err := unix.Fchownat(pfd, base, h.Uid, h.Gid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return fmt.Errorf("entry %q: chown: %w", h.Name, err)
		}
		// lsetxattr by the parent's descriptor: /proc/self/fd/N is the confined
		// directory, and the last component is not followed.
		for k, v := range xattrs {
			if err := unix.Lsetxattr(fmt.Sprintf("/proc/self/fd/%d/%s", pfd, base), k, []byte(v), 0); err != nil {
				return fmt.Errorf("entry %q: set xattr %s: %w", h.Name, k, err)
			}
		}
	case tar.TypeLink:
		target, err := cleanName(h.Linkname)
		if err != nil || target == "" {
			return refuse("entry %q: hard link to %q, which is not a file of the layer", h.Name, h.Linkname)
		}
		tdir, tbase := split(target)
		tfd, err := x.openDir(tdir, h.Name)
		if err != nil {
			return err
		}
		var st unix.Stat_t
		err = unix.Fstatat(tfd, tbase, &st, unix.AT_SYMLINK_NOFOLLOW)
		if err == nil && st.Mode&unix.S_IFMT != unix.S_IFREG {
			unix.Close(tfd)
			return refuse("entry %q: hard link to %q, which is not a regular file", h.Name, h.Linkname)
		}
		if err == nil {
			err = unix.Linkat(tfd, tbase, pfd, base, 0)
		}
		unix.Close(tfd)
		if err == unix.ENOENT {
			return refuse("entry %q: hard link to %q, which is not earlier in the archive", h.Name, h.Linkname)
		}
		if err != nil {
			return exists(err)
		}
		return nil
	case tar.TypeChar:
		if h.Devmajor != 0 || h.Devminor != 0 {
			return refuse("entry %q is a character device %d:%d: a layer holds none but overlayfs whiteouts (0:0)", h.Name, h.Devmajor, h.Devminor)
		}
		if err := unix.Mknodat(pfd, base, unix.S_IFCHR|mode, 0); err != nil {
			return exists(err)
		}
		if err := x.pathAttrs(pfd, base, h, mode, xattrs); err != nil {
			return err
		}
	case tar.TypeFifo:
		if err := unix.Mknodat(pfd, base, unix.S_IFIFO|mode, 0); err != nil {
			return exists(err)
		}
		if err := x.pathAttrs(pfd, base, h, mode, xattrs); err != nil {
			return err
		}
	case tar.TypeBlock:
		return refuse("entry %q is a block device: a layer holds none", h.Name)
	default:
		return refuse("entry %q has a type (%q) a layer does not hold", h.Name, h.Typeflag)
	}
	ts := []unix.Timespec{unix.NsecToTimespec(h.ModTime.UnixNano()), unix.NsecToTimespec(h.ModTime.UnixNano())}
	if err := unix.UtimesNanoAt(pfd, base, ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("entry %q: set times: %w", h.Name, err)
	}
	return nil
}

// pathAttrs sets the attributes of a node that cannot be opened for them (a whiteout,
// a fifo: opening one would block), through O_PATH and /proc/self/fd.
func (x *extractor) pathAttrs(pfd int, base string, h *tar.Header, mode uint32, xattrs map[string]string) error {
	if err := unix.Fchownat(pfd, base, h.Uid, h.Gid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("entry %q: chown: %w", h.Name, err)
	}
	if err := unix.Fchmodat(pfd, base, mode, 0); err != nil {
		return fmt.Errorf("entry %q: chmod: %w", h.Name, err)
	}
	for k, v := range xattrs {
		if err := unix.Lsetxattr(fmt.Sprintf("/proc/self/fd/%d/%s", pfd, base), k, []byte(v), 0); err != nil {
			return fmt.Errorf("entry %q: set xattr %s: %w", h.Name, k, err)
		}
	}
	return nil
}

// writeData writes a regular file's content: the entry's bytes, or its data segments
// at their offsets with the holes between them (paxSparse).
func (x *extractor) writeData(f *os.File, h *tar.Header, body io.Reader) error {
	segs := [][2]int64{{0, h.Size}}
	size := h.Size
	if sp, ok := h.PAXRecords[paxSparse]; ok {
		var err error
		if size, segs, err = parseSparse(sp, h.Size); err != nil {
			return refuse("entry %q: bad sparse map: %v", h.Name, err)
		}
	}
	if h.Size < 0 || x.bytes+h.Size > x.lim.MaxBytes {
		return refuse("entry %q (%d bytes) brings the layer over the import's cap of %d bytes", h.Name, h.Size, x.lim.MaxBytes)
	}
	x.bytes += h.Size
	if err := f.Truncate(size); err != nil {
		return err
	}
	for _, s := range segs {
		if s[1] == 0 {
			continue
		}
		if _, err := f.Seek(s[0], io.SeekStart); err != nil {
			return err
		}
		if n, err := io.CopyN(f, body, s[1]); err != nil {
			if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
				return refuse("entry %q: the archive ends %d bytes into a %d-byte segment (truncated)", h.Name, n, s[1])
			}
			return fmt.Errorf("entry %q: %w", h.Name, err)
		}
	}
	return nil
}

// parseSparse reads paxSparse's value: the segments must be in order, apart, inside
// the file, and their lengths must add up to the entry's size.
func parseSparse(v string, data int64) (int64, [][2]int64, error) {
	f := strings.Fields(v)
	if len(f) == 0 {
		return 0, nil, errors.New("empty")
	}
	size, err := strconv.ParseInt(f[0], 10, 64)
	if err != nil || size < 0 {
		return 0, nil, fmt.Errorf("size %q", f[0])
	}
	var segs [][2]int64
	var end, sum int64
	for _, s := range f[1:] {
		a, b, ok := strings.Cut(s, ":")
		off, err1 := strconv.ParseInt(a, 10, 64)
		n, err2 := strconv.ParseInt(b, 10, 64)
		if !ok || err1 != nil || err2 != nil || off < end || n <= 0 || off+n > size || off+n < off {
			return 0, nil, fmt.Errorf("segment %q", s)
		}
		segs = append(segs, [2]int64{off, n})
		end, sum = off+n, sum+n
	}
	if sum != data {
		return 0, nil, fmt.Errorf("segments hold %d bytes, the entry %d", sum, data)
	}
	return size, segs, nil
}

// setAttrs sets owner, then mode (chown clears setuid), then xattrs on an open fd.
func setAttrs(fd int, h *tar.Header, mode uint32, xattrs map[string]string) error {
	if err := unix.Fchown(fd, h.Uid, h.Gid); err != nil {
		return fmt.Errorf("entry %q: chown: %w", h.Name, err)
	}
	if err := unix.Fchmod(fd, mode); err != nil {
		return fmt.Errorf("entry %q: chmod: %w", h.Name, err)
	}
	for k, v := range xattrs {
		if err := unix.Fsetxattr(fd, k, []byte(v), 0); err != nil {
			return fmt.Errorf("entry %q: set xattr %s: %w", h.Name, k, err)
		}
	}
	return nil
}

// finish sets the directories' times, last, since writing into them changed them.
func (x *extractor) finish() error {
	for rel, t := range x.dirTimes {
		ts := []unix.Timespec{unix.NsecToTimespec(t.UnixNano()), unix.NsecToTimespec(t.UnixNano())}
		if rel == "" {
			if err := unix.UtimesNanoAt(x.root, ".", ts, 0); err != nil {
				return err
			}
			continue
		}
		fd, err := unix.Openat2(x.root, rel, &beneath)
		if err != nil {
			return fmt.Errorf("set the times of %s: %w", rel, err)
		}
		err = unix.UtimesNanoAt(fd, ".", ts, 0)
		unix.Close(fd)
		if err != nil {
			return fmt.Errorf("set the times of %s: %w", rel, err)
		}
	}
	return nil
}
