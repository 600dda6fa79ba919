package image

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"strings"

	"golang.org/x/sys/unix"
)

// tree writes entries into an image's rootfs, confined to it (see the package doc).
type tree struct {
	ctx  context.Context
	root int // O_DIRECTORY descriptor of the rootfs
	opts Options

	bytes   int64 // regular-file bytes written so far
	entries int64
	skipped int // special files skipped under dev/

	// layer holds the paths the current layer wrote (and their ancestors), nil when
	// the source is not layered (then .wh.* names are ordinary names).
	layer    map[string]bool
	dirTimes map[string][2]unix.Timespec
}

// member is one entry to write: a tar header and, for a regular file, its content
// from body or (directory sources) from src, which is cloned when possible.
type member struct {
	hdr  *tar.Header
	body io.Reader
	src  *os.File
}

func openTree(ctx context.Context, rootfs string, opts Options) (*tree, error) {
	fd, err := unix.Open(rootfs, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: rootfs, Err: err}
	}
	return &tree{ctx: ctx, root: fd, opts: opts, dirTimes: map[string][2]unix.Timespec{}}, nil
}

func (t *tree) close() { unix.Close(t.root) }

// beginLayer starts a layer: whiteouts apply to what earlier layers wrote.
func (t *tree) beginLayer() { t.layer = map[string]bool{} }

func (t *tree) markLayer(rel string) {
	if t.layer == nil {
		return
	}
	for rel != "" && !t.layer[rel] {
		t.layer[rel] = true
		rel = parentOf(rel)
	}
}

func parentOf(rel string) string {
	if i := strings.LastIndexByte(rel, '/'); i >= 0 {
		return rel[:i]
	}
	return ""
}

func baseOf(rel string) string { return rel[strings.LastIndexByte(rel, '/')+1:] }

// cleanName turns an archive name into a clean relative path ("" is the root), or
// refuses it.
func cleanName(name string) (string, error) {
	rel, why := CleanEntryName(name, "the image root")
	if why != "" {
		return "", refuse("%s", why)
	}
	return rel, nil
}

// CleanEntryName turns an archive entry's name into a clean relative path ("" is the
// root), or says why it is refused (why != ""): empty, absolute, a NUL byte, a ".."
// component, a component over 255 bytes. root names what entries are relative to, for
// the message. Shared by the image imports and the node archives (internal/transfer),
// which wrap why in their own error class.
func CleanEntryName(name, root string) (rel, why string) {
	if name == "" {
		return "", "an entry has an empty name"
	}
	if strings.HasPrefix(name, "/") {
		return "", fmt.Sprintf("entry %q: absolute path (entries must be relative to %s)", name, root)
	}
	if strings.IndexByte(name, 0) >= 0 {
		return "", fmt.Sprintf("entry %q: NUL byte in the name", name)
	}
	var out []string
	for _, c := range strings.Split(name, "/") {
		switch c {
		case "", ".":
			continue
		case "..":
			return "", fmt.Sprintf("entry %q: \"..\" component (entries may not climb out of %s)", name, root)
		}
		if len(c) > 255 {
			return "", fmt.Sprintf("entry %q: a name component is over 255 bytes", name)
		}
		out = append(out, c)
	}
	return strings.Join(out, "/"), ""
}

// how opens a directory of the rootfs. No O_NOFOLLOW: RESOLVE_NO_SYMLINKS already
// refuses a link in any component, the last included, and says so (ELOOP) where
// O_NOFOLLOW|O_DIRECTORY would say ENOTDIR.
var how = unix.OpenHow{
	Flags:   unix.O_RDONLY | unix.O_DIRECTORY | unix.O_CLOEXEC,
	Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV,
}

// errNoDir: a directory on the way does not exist (and was not to be created).
var errNoDir = errors.New("no such directory")

// openDir opens directory rel of the rootfs without following any symlink, creating
// missing directories (0755, root) when create is set. The caller closes the fd.
func (t *tree) openDir(rel, entry string, create bool) (int, error) {
	if rel == "" {
		return unix.FcntlInt(uintptr(t.root), unix.F_DUPFD_CLOEXEC, 0)
	}
	fd, err := unix.Openat2(t.root, rel, &how)
	if err == nil {
		return fd, nil
	}
	if err != unix.ENOENT || !create {
		return -1, t.dirErr(err, rel, entry)
	}
	cur, err := unix.FcntlInt(uintptr(t.root), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	done := ""
	for _, c := range strings.Split(rel, "/") {
		done = path.Join(done, c)
		fd, err := unix.Openat2(cur, c, &how)
		if err == unix.ENOENT {
			if err = unix.Mkdirat(cur, c, 0o755); err == nil {
				err = unix.Fchmodat(cur, c, 0o755, 0) // the umask may have taken bits off
				t.markLayer(done)
			}
			if err == nil || err == unix.EEXIST {
				fd, err = unix.Openat2(cur, c, &how)
			}
		}
		unix.Close(cur)
		if err != nil {
			return -1, t.dirErr(err, done, entry)
		}
		cur = fd
	}
	return cur, nil
}

func (t *tree) dirErr(err error, rel, entry string) error {
	switch err {
	case unix.ELOOP:
		return refuse("entry %q: the path %q goes through a symbolic link (the importer never follows links; name the link's target instead)", entry, rel)
	case unix.ENOTDIR:
		return refuse("entry %q: %q is not a directory", entry, rel)
	case unix.EXDEV:
		return refuse("entry %q: the path %q leaves the image", entry, rel)
	case unix.ENOENT:
		return errNoDir
	}
	return fmt.Errorf("entry %q: open %s: %w", entry, rel, err)
}

// removeAllAt removes name in dirfd and, if it is a directory, everything under it,
// never following a symlink.
func removeAllAt(dirfd int, name string) error {
	err := unix.Unlinkat(dirfd, name, 0)
	if err == nil || err == unix.ENOENT {
		return nil
	}
	if err != unix.EISDIR && err != unix.EPERM {
		return err
	}
	fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	f := os.NewFile(uintptr(fd), name)
	defer f.Close()
	for {
		names, err := f.Readdirnames(1024)
		for _, n := range names {
			if err := removeAllAt(fd, n); err != nil {
				return err
			}
		}
		if err == io.EOF || len(names) == 0 {
			break
		}
		if err != nil {
			return err
		}
	}
	return unix.Unlinkat(dirfd, name, unix.AT_REMOVEDIR)
}

// removeLower removes, under directory rel (open as fd), every entry the current
// layer did not write, descending into the directories it did write.
func (t *tree) removeLower(fd int, rel string) error {
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return err
	}
	f := os.NewFile(uintptr(dup), rel)
	names, err := f.Readdirnames(-1)
	f.Close()
	if err != nil {
		return err
	}
	for _, n := range names {
		p := path.Join(rel, n)
		if !t.layer[p] {
			if err := removeAllAt(fd, n); err != nil {
				return err
			}
			continue
		}
		sub, err := unix.Openat(fd, n, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			continue // not a directory: this layer's file stays
		}
		err = t.removeLower(sub, p)
		unix.Close(sub)
		if err != nil {
			return err
		}
	}
	return nil
}

// whiteout applies "dir/.wh.NAME" (remove NAME of the lower layers) or
// "dir/.wh..wh..opq" (dir is opaque: remove what lower layers put in it).
func (t *tree) whiteout(entry, dir, base string) error {
	if base == ".wh..wh..opq" {
		fd, err := t.openDir(dir, entry, false)
		if err == errNoDir {
			return nil
		}
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		t.markLayer(dir)
		if err := t.removeLower(fd, dir); err != nil {
			return fmt.Errorf("entry %q: opaque directory: %w", entry, err)
		}
		return nil
	}
	if strings.HasPrefix(base, ".wh..wh.") {
		return nil // other aufs metadata (.wh..wh.plnk, ...): nothing to apply
	}
	name := strings.TrimPrefix(base, ".wh.")
	if name == "" || name == "." || name == ".." {
		return refuse("entry %q: whiteout of %q (a whiteout names one entry of its directory)", entry, name)
	}
	fd, err := t.openDir(dir, entry, false)
	if err == errNoDir {
		return nil
	}
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	target := path.Join(dir, name)
	if !t.layer[target] {
		err = removeAllAt(fd, name)
	} else if sub, oerr := unix.Openat(fd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0); oerr == nil {
		// The layer wrote target itself: a whiteout only hides what lower layers had.
		err = t.removeLower(sub, target)
		unix.Close(sub)
	}
	if err != nil {
		return fmt.Errorf("entry %q: whiteout: %w", entry, err)
	}
	return nil
}

// symlinkEscapes reports whether a relative target, resolved lexically against the
// directory of the link at rel, climbs above the image root.
func symlinkEscapes(rel, target string) bool {
	if strings.HasPrefix(target, "/") {
		return false
	}
	depth := 0
	if d := parentOf(rel); d != "" {
		depth = strings.Count(d, "/") + 1
	}
	for _, c := range strings.Split(target, "/") {
		switch c {
		case "", ".":
		case "..":
			depth--
			if depth < 0 {
				return true
			}
		default:
			depth++
		}
	}
	return false
}

func underDev(rel string) bool { return rel == "dev" || strings.HasPrefix(rel, "dev/") }

// apply writes one entry.
func (t *tree) apply(m member) error {
	if err := t.ctx.Err(); err != nil {
		return err
	}
	h := m.hdr
	t.entries++
	if t.entries > t.opts.MaxEntries {
		return refuse("over %d entries: refused as an archive bomb (raise max_entries if the image is really this big)", t.opts.MaxEntries)
	}
	if h.Typeflag == tar.TypeXGlobalHeader {
		return nil
	}
	rel, err := cleanName(h.Name)
	if err != nil {
		return err
	}
	dir, base := parentOf(rel), baseOf(rel)
	if t.layer != nil && strings.HasPrefix(base, ".wh.") {
		return t.whiteout(h.Name, dir, base)
	}
	mode := uint32(h.Mode) & 0o7777
	switch h.Typeflag {
	case tar.TypeDir:
	case tar.TypeReg, tar.TypeGNUSparse:
		if h.Size < 0 || h.Size > t.opts.MaxBytes {
			return refuse("entry %q declares %d bytes, over the import's cap of %d bytes: refused as a size bomb (raise it with max_bytes, deltabox image import --max-bytes)", h.Name, h.Size, t.opts.MaxBytes)
		}
		if t.bytes+h.Size > t.opts.MaxBytes {
			return refuse("entry %q (%d bytes) brings the extracted total over the import's cap of %d bytes: refused as a size bomb (raise it with max_bytes, deltabox image import --max-bytes)", h.Name, h.Size, t.opts.MaxBytes)
		}
		if !t.opts.AllowSetuid && mode&(unix.S_ISUID|unix.S_ISGID) != 0 {
			what := "setuid"
			if mode&unix.S_ISUID == 0 {
				what = "setgid"
			}
			return refuse("entry %q is a %s file (mode %04o): refused unless allow_setuid (--allow-setuid)", h.Name, what, mode)
		}
	case tar.TypeSymlink:
		if h.Linkname == "" {
			return refuse("entry %q: symbolic link with an empty target", h.Name)
		}
		if symlinkEscapes(rel, h.Linkname) {
			return refuse("entry %q: symbolic link target %q escapes the image root (a relative target may not climb above /)", h.Name, h.Linkname)
		}
	case tar.TypeLink:
		if strings.HasPrefix(h.Linkname, "/") {
			return refuse("entry %q: hard link to %q: absolute link target escapes the archive (hard links name another entry)", h.Name, h.Linkname)
		}
		for _, c := range strings.Split(h.Linkname, "/") {
			if c == ".." {
				return refuse("entry %q: hard link to %q: target escapes the image root through \"..\"", h.Name, h.Linkname)
			}
		}
	case tar.TypeChar, tar.TypeBlock, tar.TypeFifo, typeSocket:
		if underDev(rel) {
			t.skipped++
			return nil
		}
		kind := map[byte]string{tar.TypeChar: "character device", tar.TypeBlock: "block device", tar.TypeFifo: "fifo", typeSocket: "socket"}[h.Typeflag]
		return refuse("entry %q is a %s: device nodes, fifos and sockets are refused outside /dev (every sandbox gets its own /dev)", h.Name, kind)
	default:
		return refuse("entry %q has an unsupported type %q", h.Name, h.Typeflag)
	}
	xattrs, err := t.xattrs(h)
	if err != nil {
		return err
	}
	ts := []unix.Timespec{unix.NsecToTimespec(h.ModTime.UnixNano()), unix.NsecToTimespec(h.ModTime.UnixNano())}
	if !h.AccessTime.IsZero() {
		ts[0] = unix.NsecToTimespec(h.AccessTime.UnixNano())
	}
	if h.ModTime.IsZero() {
		ts[0], ts[1] = unix.Timespec{Nsec: unix.UTIME_OMIT}, unix.Timespec{Nsec: unix.UTIME_OMIT}
	}

	if rel == "" { // the image root itself
		if h.Typeflag != tar.TypeDir {
			return refuse("entry %q: the image root must be a directory", h.Name)
		}
		if err := t.setAttrs(t.root, h, mode, xattrs); err != nil {
			return fmt.Errorf("entry %q: %w", h.Name, err)
		}
		t.dirTimes[""] = [2]unix.Timespec{ts[0], ts[1]}
		return nil
	}
	if h.Typeflag == tar.TypeLink && path.Clean(h.Linkname) == rel {
		return nil // a link to itself: nothing to do
	}
	t.markLayer(rel)
	pfd, err := t.openDir(dir, h.Name, true)
	if err != nil {
		return err
	}
	defer unix.Close(pfd)
	isDir, err := t.prepare(pfd, base, h.Typeflag == tar.TypeDir)
	if err != nil {
		return fmt.Errorf("entry %q: replace the existing entry: %w", h.Name, err)
	}
	switch h.Typeflag {
	case tar.TypeDir:
		if !isDir {
			if err := unix.Mkdirat(pfd, base, 0o700); err != nil {
				return fmt.Errorf("entry %q: mkdir: %w", h.Name, err)
			}
		}
		fd, err := unix.Openat(pfd, base, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("entry %q: %w", h.Name, err)
		}
		err = t.setAttrs(fd, h, mode, xattrs)
		unix.Close(fd)
		if err != nil {
			return fmt.Errorf("entry %q: %w", h.Name, err)
		}
		t.dirTimes[rel] = [2]unix.Timespec{ts[0], ts[1]}
		return nil
	case tar.TypeReg, tar.TypeGNUSparse:
		if err := t.writeFile(pfd, base, m, mode, xattrs); err != nil {
			return fmt.Errorf("entry %q: %w", h.Name, err)
		}
	case tar.TypeSymlink:
		if err := unix.Symlinkat(h.Linkname, pfd, base); err != nil {
			return fmt.Errorf("entry %q: symlink: %w", h.Name, err)
		}
		if err := unix.Fchownat(pfd, base, h.Uid, h.Gid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return fmt.Errorf("entry %q: chown: %w", h.Name, err)
		}
	case tar.TypeLink:
		target, err := cleanName(h.Linkname)
		if err != nil || target == "" {
			return refuse("entry %q: hard link to %q, which is not a file of the image", h.Name, h.Linkname)
		}
		tfd, err := t.openDir(parentOf(target), h.Name, false)
		if err == errNoDir {
			return refuse("entry %q: hard link to %q, which does not exist (earlier in the archive)", h.Name, h.Linkname)
		}
		if err != nil {
			return err
		}
		err = unix.Linkat(tfd, baseOf(target), pfd, base, 0)
		unix.Close(tfd)
		if err == unix.ENOENT {
			return refuse("entry %q: hard link to %q, which does not exist (earlier in the archive)", h.Name, h.Linkname)
		}
		if err == unix.EPERM {
			return refuse("entry %q: hard link to %q, which is a directory", h.Name, h.Linkname)
		}
		if err != nil {
			return fmt.Errorf("entry %q: link: %w", h.Name, err)
		}
		return nil // the link shares the target's inode, attributes included
	}
	if err := unix.UtimesNanoAt(pfd, base, ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("entry %q: set times: %w", h.Name, err)
	}
	return nil
}

// typeSocket is a pseudo tar type the directory walker uses for sockets.
const typeSocket byte = 0xfe

// prepare clears the way for a new entry base in pfd: an existing non-directory is
// removed; an existing directory is kept for a directory (merge) and removed with its
// content otherwise. It reports whether a directory is there to merge into.
func (t *tree) prepare(pfd int, base string, dir bool) (bool, error) {
	var st unix.Stat_t
	err := unix.Fstatat(pfd, base, &st, unix.AT_SYMLINK_NOFOLLOW)
	if err == unix.ENOENT {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	if st.Mode&unix.S_IFMT == unix.S_IFDIR {
		if dir {
			return true, nil
		}
		return false, removeAllAt(pfd, base)
	}
	return false, unix.Unlinkat(pfd, base, 0)
}

// xattrs returns the extended attributes of h to keep (see the package doc).
func (t *tree) xattrs(h *tar.Header) (map[string]string, error) {
	var out map[string]string
	for k, v := range h.PAXRecords {
		name, ok := strings.CutPrefix(k, "SCHILY.xattr.")
		if !ok {
			continue
		}
		switch {
		case name == "security.capability":
			if !t.opts.AllowSetuid {
				return nil, refuse("entry %q has file capabilities (security.capability): refused unless allow_setuid (--allow-setuid)", h.Name)
			}
		case strings.HasPrefix(name, "user."):
		default:
			continue
		}
		if h.Typeflag == tar.TypeSymlink || h.Typeflag == tar.TypeLink {
			continue
		}
		if out == nil {
			out = map[string]string{}
		}
		out[name] = v
	}
	return out, nil
}

// setAttrs sets owner, then mode (chown clears setuid), then xattrs on an open fd.
func (t *tree) setAttrs(fd int, h *tar.Header, mode uint32, xattrs map[string]string) error {
	if err := unix.Fchown(fd, h.Uid, h.Gid); err != nil {
		return fmt.Errorf("chown: %w", err)
	}
	if err := unix.Fchmod(fd, mode); err != nil {
		return fmt.Errorf("chmod: %w", err)
	}
	for k, v := range xattrs {
		if err := unix.Fsetxattr(fd, k, []byte(v), 0); err != nil {
			return fmt.Errorf("set xattr %s: %w", k, err)
		}
	}
	return nil
}

// writeFile creates base in pfd with the content of m (cloned from m.src if it can be).
func (t *tree) writeFile(pfd int, base string, m member, mode uint32, xattrs map[string]string) error {
	fd, err := unix.Openat(pfd, base, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("create: %w", err)
	}
	f := os.NewFile(uintptr(fd), base)
	defer f.Close()
	size := m.hdr.Size
	switch {
	case m.src != nil && size > 0:
		if err := unix.IoctlFileClone(fd, int(m.src.Fd())); err != nil {
			if _, err := m.src.Seek(0, io.SeekStart); err != nil {
				return err
			}
			if err := t.copyN(f, m.src, size); err != nil {
				return err
			}
		}
	case m.body != nil && size > 0:
		if err := t.copyN(f, m.body, size); err != nil {
			return err
		}
	}
	t.bytes += size
	if err := t.setAttrs(fd, m.hdr, mode, xattrs); err != nil {
		return err
	}
	return f.Close()
}

// copyN copies exactly n bytes, checking for cancellation between chunks.
func (t *tree) copyN(dst *os.File, src io.Reader, n int64) error {
	for n > 0 {
		if err := t.ctx.Err(); err != nil {
			return err
		}
		chunk := min(n, 8<<20)
		w, err := io.CopyN(dst, src, chunk)
		n -= w
		if err == io.EOF {
			return fmt.Errorf("the data ends %d bytes short of the declared size", n)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// ensureMountPoints makes the directories every sandbox mounts onto or expects.
func (t *tree) ensureMountPoints() error {
	for _, d := range []struct {
		rel      string
		mode     uint32
		required bool // mountns.CheckImage needs a directory there
	}{
		{"dev", 0o755, true}, {"proc", 0o555, true}, {"dev/shm", 0o1777, true},
		{"sys", 0o555, false}, {"run", 0o755, false}, {"tmp", 0o1777, false},
		{"var/tmp", 0o1777, false}, {"workspace", 0o755, false},
	} {
		err := t.mountPoint(d.rel, d.mode, d.required)
		if err != nil && d.required {
			return fmt.Errorf("make the mount point /%s: %w", d.rel, err)
		}
	}
	return nil
}

func (t *tree) mountPoint(rel string, mode uint32, replace bool) error {
	pfd, err := t.openDir(parentOf(rel), rel, true)
	if err != nil {
		return err
	}
	defer unix.Close(pfd)
	base := baseOf(rel)
	var st unix.Stat_t
	err = unix.Fstatat(pfd, base, &st, unix.AT_SYMLINK_NOFOLLOW)
	if err == nil && (st.Mode&unix.S_IFMT == unix.S_IFDIR || !replace) {
		return nil
	}
	if err == nil {
		if err := removeAllAt(pfd, base); err != nil {
			return err
		}
	} else if err != unix.ENOENT {
		return err
	}
	if err := unix.Mkdirat(pfd, base, 0o700); err != nil {
		return err
	}
	return unix.Fchmodat(pfd, base, mode, 0)
}

// finish sets the directories' times, last, as writing into them changed them.
func (t *tree) finish() {
	for rel, ts := range t.dirTimes {
		if ts[1].Nsec == unix.UTIME_OMIT {
			continue
		}
		if rel == "" {
			unix.UtimesNanoAt(t.root, ".", ts[:], 0)
			continue
		}
		pfd, err := t.openDir(parentOf(rel), rel, false)
		if err != nil {
			continue // removed by a later layer, or behind a link: keep the time it has
		}
		unix.UtimesNanoAt(pfd, baseOf(rel), ts[:], unix.AT_SYMLINK_NOFOLLOW)
		unix.Close(pfd)
	}
}
