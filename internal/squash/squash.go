// Package squash flattens a stack of overlayfs layers into one layer, so that a node
// thousands of checkpoints deep still mounts a short stack.
//
// Why: every checkpoint adds a frozen layer under the sandbox's next upper, and a
// restore mounts the node's whole stack. Each lower costs the mount a path lookup and
// every later lookup in the sandbox a probe per layer (a restore at depth 400 took
// 1.7x one at depth 1), and overlayfs stacks at most 500 lowers (OVL_MAX_STACK), so a
// chain could not pass depth 499. A squashed layer stands for a node's whole stack: the
// node's later restores and its descendants' mount it instead of the layers under it.
//
// The mechanism: Build walks a read-only overlay of the layers over the image (the
// "view": exactly what the node's sandbox saw) beside the image alone (the "base"), and
// writes into an empty directory the smallest layer L such that L over the base shows
// the view:
//
//   - an entry the view has and the base has as the same inode (overlayfs on one
//     filesystem reports a lower entry's real inode number) is left out: the base shows
//     it;
//   - any other non-directory is written: regular files by reflink (FICLONE) of the real
//     file in a layer or the image, found by inode number (a copy of its bytes if not
//     found), symlinks, device nodes, fifos and sockets as they are; hard links stay
//     links;
//   - a directory is written when the base lacks it, its attributes differ, or
//     something under it is written;
//   - an entry the base has and the view does not becomes a whiteout (a 0/0 character
//     device, overlayfs's own format), so deletions of the image's files stay deleted.
//     No opaque directories and no redirects are needed: every difference is spelt out.
//
// Owners, modes (after the owner: chown clears set-id bits), extended attributes (but
// overlayfs's own trusted.overlay.*) and times are copied; times last, a directory's
// after its entries.
//
// Kernel facts relied on: overlayfs with every layer on one filesystem reports the real
// inode number of a lower non-directory (ovl_getattr, "samefs"); Build checks that the
// layers and the base share a device and refuses otherwise. FICLONE between files of
// one XFS shares extents, so a squash costs metadata, not data.
//
// Safety: the view, the layers and the image are immutable while Build runs (frozen
// layers and an image are never written; the view is a read-only mount nobody else
// holds), and every path is resolved from a directory fd with RESOLVE_BENEATH and
// RESOLVE_NO_SYMLINKS, so that no symlink a sandbox made is ever followed with the
// daemon's privileges.
package squash

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"

	"golang.org/x/sys/unix"
)

// IdlePriority puts the calling thread at the lowest CPU priority (nice 19) and in the
// idle I/O class: a squash walks a whole tree and must not slow the sandboxes' answers.
// The caller has locked its goroutine to the thread and lets the thread end with it.
func IdlePriority() {
	const (
		ioprioWhoProcess = 1 // IOPRIO_WHO_PROCESS: a thread id
		ioprioClassIdle  = 3 // IOPRIO_CLASS_IDLE
		ioprioClassShift = 13
	)
	tid := unix.Gettid()
	unix.Setpriority(unix.PRIO_PROCESS, tid, 19)
	unix.Syscall(unix.SYS_IOPRIO_SET, ioprioWhoProcess, uintptr(tid), ioprioClassIdle<<ioprioClassShift)
}

// Stats counts what a squash wrote.
type Stats struct {
	Files     int   `json:"files"`     // regular files written (reflinked or copied)
	Copied    int   `json:"copied"`    // of which copied byte by byte (no reflink source found)
	Links     int   `json:"links"`     // hard links
	Dirs      int   `json:"dirs"`      // directories written
	Others    int   `json:"others"`    // symlinks, devices, fifos, sockets
	Whiteouts int   `json:"whiteouts"` // base entries deleted in the view
	Bytes     int64 `json:"bytes"`     // apparent size of the regular files written
}

var (
	howDir = unix.OpenHow{
		Flags:   unix.O_RDONLY | unix.O_DIRECTORY | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV,
	}
	howFile = unix.OpenHow{
		Flags:   unix.O_RDONLY | unix.O_NOFOLLOW | unix.O_CLOEXEC | unix.O_NOCTTY | unix.O_NONBLOCK,
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV,
	}
)

// Build writes into out (an empty directory on the layers' filesystem) a layer that,
// over base, shows what view shows. view is the root fd of a read-only overlay of
// layers over base (a detached mount fd will do); layers are the real directories of
// that overlay's lowers above base. Build does not close view.
func Build(view int, base string, layers []string, out string) (*Stats, error) {
	b := &builder{st: &Stats{}, links: map[uint64]string{}}
	defer b.close()
	var err error
	if b.base, err = unix.Open(base, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0); err != nil {
		return nil, fmt.Errorf("squash: open the image %s: %w", base, err)
	}
	var bst unix.Stat_t
	if err := unix.Fstat(b.base, &bst); err != nil {
		return nil, fmt.Errorf("squash: %w", err)
	}
	for _, l := range layers {
		fd, err := unix.Open(l, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return nil, fmt.Errorf("squash: open layer %s: %w", l, err)
		}
		b.roots = append(b.roots, fd)
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil {
			return nil, fmt.Errorf("squash: %w", err)
		}
		if st.Dev != bst.Dev {
			return nil, fmt.Errorf("squash: layer %s and the image %s are on different filesystems (overlayfs then reports no real inode numbers)", l, base)
		}
	}
	// Every path a layer holds, and the directories whose lookup leaves their own path:
	// the walk visits only these (the rest of the view is the image's, untouched).
	b.touched, b.whole = map[string]bool{}, map[string]bool{}
	b.inos = map[uint64]source{}
	for i, fd := range b.roots {
		if lookupMoves(fd) {
			b.whole[""] = true
		}
		if err := b.scanLayer(fd, fd, ""); err != nil {
			return nil, fmt.Errorf("squash: read layer %s: %w", layers[i], err)
		}
	}
	b.scanned = len(b.roots)
	b.roots = append(b.roots, b.base) // last: the image, scanned only if a file is not found above
	o, err := unix.Open(out, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("squash: open %s: %w", out, err)
	}
	root := &outDir{fd: o}
	defer root.close()
	// A detached mount's fd is an O_PATH one: reopened to read its attributes.
	if view, err = unix.Openat(view, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0); err != nil {
		return nil, fmt.Errorf("squash: open the view: %w", err)
	}
	defer unix.Close(view)
	var vst unix.Stat_t
	if err := unix.Fstat(view, &vst); err != nil {
		return nil, fmt.Errorf("squash: %w", err)
	}
	if _, err := b.dir(view, b.base, root, "", b.whole[""]); err != nil {
		return nil, err
	}
	// The root directory always carries the view's attributes: overlayfs takes "/"'s
	// from the topmost layer that has it.
	if err := copyAttrs(view, root.fd, &vst, true); err != nil {
		return nil, fmt.Errorf("squash: attributes of /: %w", err)
	}
	return b.st, nil
}

type builder struct {
	st    *Stats
	base  int   // the image's root
	roots []int // the layers' roots, then the image's (base): sources for reflinks
	// inos: a regular file's source by inode number, filled a root at a time.
	inos    map[uint64]source
	scanned int // roots scanned into inos so far
	// touched: every path some layer holds (a file, a directory, a whiteout); whole:
	// directories some layer makes opaque or redirects, whose view is walked whole. A
	// path neither touched nor below a whole directory is the image's own, and skipped.
	touched, whole map[string]bool
	links          map[uint64]string // view inode -> path written in out (hard links)
}

type source struct {
	root int
	rel  string
}

func (b *builder) close() {
	for _, fd := range b.roots {
		unix.Close(fd)
	}
}

// outDir is a directory of out, made only once something must go into it.
type outDir struct {
	parent *outDir
	name   string
	fd     int // -1 until made
}

func (d *outDir) close() {
	if d.fd >= 0 {
		unix.Close(d.fd)
		d.fd = -1
	}
}

// ensure makes d (and its parents) in out.
func (d *outDir) ensure() error {
	if d.fd >= 0 {
		return nil
	}
	if err := d.parent.ensure(); err != nil {
		return err
	}
	if err := unix.Mkdirat(d.parent.fd, d.name, 0o700); err != nil {
		return err
	}
	fd, err := unix.Openat2(d.parent.fd, d.name, &howDir)
	if err != nil {
		return err
	}
	d.fd = fd
	return nil
}

// dir squashes the view's directory vdir (rel) against the base's bdir (-1: the base
// has no directory there) into od. wrote reports whether anything was written in od.
// Unless whole (rel or a parent is opaque or redirected in a layer), only the names a
// layer holds are looked at: overlayfs shows any other name as the image has it.
func (b *builder) dir(vdir, bdir int, od *outDir, rel string, whole bool) (wrote bool, err error) {
	names, err := readNames(vdir)
	if err != nil {
		return false, fmt.Errorf("squash: list %q: %w", "/"+rel, err)
	}
	var bnames []string
	if bdir >= 0 {
		if bnames, err = readNames(bdir); err != nil {
			return false, fmt.Errorf("squash: list %q in the image: %w", "/"+rel, err)
		}
	}
	seen := make(map[string]bool, len(names))
	for _, name := range names {
		seen[name] = true
		if !whole && !b.touched[join(rel, name)] {
			continue
		}
		w, err := b.entry(vdir, bdir, od, rel, name, whole)
		if err != nil {
			return false, err
		}
		wrote = wrote || w
	}
	for _, name := range bnames {
		if seen[name] || (!whole && !b.touched[join(rel, name)]) {
			continue
		}
		if err := od.ensure(); err != nil {
			return false, fmt.Errorf("squash: make %q: %w", "/"+rel, err)
		}
		if err := unix.Mknodat(od.fd, name, unix.S_IFCHR, 0); err != nil {
			return false, fmt.Errorf("squash: whiteout %q: %w", join(rel, name), err)
		}
		b.st.Whiteouts++
		wrote = true
	}
	return wrote, nil
}

// entry squashes one name of the view's directory vdir.
func (b *builder) entry(vdir, bdir int, od *outDir, rel, name string, whole bool) (bool, error) {
	p := join(rel, name)
	var vst, bst unix.Stat_t
	if err := unix.Fstatat(vdir, name, &vst, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return false, fmt.Errorf("squash: stat %q: %w", "/"+p, err)
	}
	inBase := false
	if bdir >= 0 {
		switch err := unix.Fstatat(bdir, name, &bst, unix.AT_SYMLINK_NOFOLLOW); {
		case err == nil:
			inBase = true
		case !errors.Is(err, unix.ENOENT):
			return false, fmt.Errorf("squash: stat %q in the image: %w", "/"+p, err)
		}
	}
	if vst.Mode&unix.S_IFMT == unix.S_IFDIR {
		return b.subdir(vdir, bdir, od, p, name, &vst, inBase && bst.Mode&unix.S_IFMT == unix.S_IFDIR, &bst, whole || b.whole[p])
	}
	if inBase && bst.Ino == vst.Ino && bst.Mode&unix.S_IFMT == vst.Mode&unix.S_IFMT {
		return false, nil // the image's own entry, unchanged
	}
	if err := od.ensure(); err != nil {
		return false, fmt.Errorf("squash: make %q: %w", "/"+rel, err)
	}
	if err := b.nondir(vdir, od, p, name, &vst); err != nil {
		return false, fmt.Errorf("squash: %q: %w", "/"+p, err)
	}
	return true, nil
}

// subdir squashes a directory of the view; baseDir tells whether the base has a
// directory there (bst its attributes).
func (b *builder) subdir(vdir, bdir int, od *outDir, p, name string, vst *unix.Stat_t, baseDir bool, bst *unix.Stat_t, whole bool) (bool, error) {
	vfd, err := unix.Openat2(vdir, name, &howDir)
	if err != nil {
		return false, fmt.Errorf("squash: open %q: %w", "/"+p, err)
	}
	defer unix.Close(vfd)
	bfd := -1
	if baseDir {
		if bfd, err = unix.Openat2(bdir, name, &howDir); err != nil {
			return false, fmt.Errorf("squash: open %q in the image: %w", "/"+p, err)
		}
		defer unix.Close(bfd)
	}
	child := &outDir{parent: od, name: name, fd: -1}
	defer child.close()
	wrote, err := b.dir(vfd, bfd, child, p, whole)
	if err != nil {
		return false, err
	}
	if !wrote && baseDir {
		same, err := sameDirAttrs(vfd, bfd, vst, bst)
		if err != nil {
			return false, fmt.Errorf("squash: attributes of %q: %w", "/"+p, err)
		}
		if same {
			return false, nil
		}
	}
	if err := child.ensure(); err != nil {
		return false, fmt.Errorf("squash: make %q: %w", "/"+p, err)
	}
	if err := copyAttrs(vfd, child.fd, vst, true); err != nil {
		return false, fmt.Errorf("squash: attributes of %q: %w", "/"+p, err)
	}
	b.st.Dirs++
	return true, nil
}

// nondir writes the view's non-directory name (path p) into od.
func (b *builder) nondir(vdir int, od *outDir, p, name string, vst *unix.Stat_t) error {
	if vst.Nlink > 1 && vst.Mode&unix.S_IFMT != unix.S_IFDIR {
		if first, ok := b.links[vst.Ino]; ok {
			root := od
			for root.parent != nil {
				root = root.parent
			}
			if err := unix.Linkat(root.fd, first, od.fd, name, 0); err != nil {
				return fmt.Errorf("link to %q: %w", "/"+first, err)
			}
			b.st.Links++
			return nil
		}
		b.links[vst.Ino] = p
	}
	switch vst.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		return b.file(vdir, od, name, vst)
	case unix.S_IFLNK:
		target, err := readlinkat(vdir, name)
		if err != nil {
			return err
		}
		if err := unix.Symlinkat(target, od.fd, name); err != nil {
			return err
		}
	default: // character and block devices, fifos, sockets
		if err := unix.Mknodat(od.fd, name, vst.Mode&unix.S_IFMT|0o600, int(vst.Rdev)); err != nil {
			return err
		}
	}
	b.st.Others++
	return copyAttrsAt(vdir, od.fd, name, vst)
}

// file writes a regular file: a reflink of its real file, else a copy of its bytes.
func (b *builder) file(vdir int, od *outDir, name string, vst *unix.Stat_t) error {
	dst, err := unix.Openat(od.fd, name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return err
	}
	defer unix.Close(dst)
	if !b.reflink(dst, vst) {
		src, err := unix.Openat2(vdir, name, &howFile)
		if err != nil {
			return err
		}
		err = copyBytes(dst, src)
		unix.Close(src)
		if err != nil {
			return err
		}
		b.st.Copied++
	}
	b.st.Files++
	b.st.Bytes += vst.Size
	vfd, err := unix.Openat2(vdir, name, &howFile)
	if err != nil {
		return err
	}
	defer unix.Close(vfd)
	return copyAttrs(vfd, dst, vst, false)
}

// reflink clones into dst the real file whose inode the view reports, if one of the
// roots has it (scanning roots into the inode map as needed).
func (b *builder) reflink(dst int, vst *unix.Stat_t) bool {
	for {
		if s, ok := b.inos[vst.Ino]; ok {
			src, err := unix.Openat2(s.root, s.rel, &howFile)
			if err != nil {
				return false
			}
			defer unix.Close(src)
			var st unix.Stat_t
			if unix.Fstat(src, &st) != nil || st.Ino != vst.Ino || st.Size != vst.Size {
				return false
			}
			return unix.IoctlFileClone(dst, src) == nil
		}
		if b.scanned == len(b.roots) {
			return false
		}
		root := b.roots[b.scanned]
		b.scanned++
		scanFiles(root, root, "", b.inos)
	}
}

// scanLayer records what layer root holds under dir (rel): every path (touched), the
// directories whose lookup leaves their path (whole), the regular files' inodes (first
// seen kept: layers are scanned top first). Unlike the image's scan it fails on any
// error: a path it missed would be squashed as the image's.
func (b *builder) scanLayer(root, dir int, rel string) error {
	names, err := readNames(dir)
	if err != nil {
		return fmt.Errorf("list %q: %w", "/"+rel, err)
	}
	for _, name := range names {
		p := join(rel, name)
		b.touched[p] = true
		var st unix.Stat_t
		if err := unix.Fstatat(dir, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return fmt.Errorf("stat %q: %w", "/"+p, err)
		}
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFREG:
			if _, ok := b.inos[st.Ino]; !ok {
				b.inos[st.Ino] = source{root, p}
			}
		case unix.S_IFDIR:
			fd, err := unix.Openat2(dir, name, &howDir)
			if err != nil {
				return fmt.Errorf("open %q: %w", "/"+p, err)
			}
			if lookupMoves(fd) {
				b.whole[p] = true
			}
			err = b.scanLayer(root, fd, p)
			unix.Close(fd)
			if err != nil {
				return err
			}
		}
	}
	return nil
}

// lookupMoves reports whether a layer's directory makes overlayfs look elsewhere below
// it: opaque (the lower directories are hidden) or redirected (a renamed directory's
// lower content is at another path).
func lookupMoves(fd int) bool {
	for _, k := range []string{"trusted.overlay.opaque", "trusted.overlay.redirect", "user.overlay.opaque", "user.overlay.redirect"} {
		if _, err := unix.Fgetxattr(fd, k, nil); err == nil || errors.Is(err, unix.ERANGE) {
			return true
		}
	}
	return false
}

// scanFiles adds the regular files under dir (rel, of root) to m, first seen kept.
// Errors only leave files out (they are then copied, not reflinked).
func scanFiles(root, dir int, rel string, m map[uint64]source) {
	names, err := readNames(dir)
	if err != nil {
		return
	}
	for _, name := range names {
		var st unix.Stat_t
		if unix.Fstatat(dir, name, &st, unix.AT_SYMLINK_NOFOLLOW) != nil {
			continue
		}
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFREG:
			if _, ok := m[st.Ino]; !ok {
				m[st.Ino] = source{root, join(rel, name)}
			}
		case unix.S_IFDIR:
			fd, err := unix.Openat2(dir, name, &howDir)
			if err != nil {
				continue
			}
			scanFiles(root, fd, join(rel, name), m)
			unix.Close(fd)
		}
	}
}

// sameDirAttrs reports whether two directories have the same mode, owner, mtime and
// extended attributes.
func sameDirAttrs(a, b int, ast, bst *unix.Stat_t) (bool, error) {
	if ast.Mode != bst.Mode || ast.Uid != bst.Uid || ast.Gid != bst.Gid || ast.Mtim != bst.Mtim {
		return false, nil
	}
	ax, err := xattrs(a)
	if err != nil {
		return false, err
	}
	bx, err := xattrs(b)
	if err != nil {
		return false, err
	}
	if len(ax) != len(bx) {
		return false, nil
	}
	for k, v := range ax {
		if w, ok := bx[k]; !ok || string(v) != string(w) {
			return false, nil
		}
	}
	return true, nil
}

// copyAttrs gives dst (an open file or directory) src's owner, mode, extended
// attributes and times.
func copyAttrs(src, dst int, st *unix.Stat_t, times bool) error {
	if err := unix.Fchown(dst, int(st.Uid), int(st.Gid)); err != nil {
		return err
	}
	if err := unix.Fchmod(dst, st.Mode&0o7777); err != nil {
		return err
	}
	x, err := xattrs(src)
	if err != nil {
		return err
	}
	for k, v := range x {
		if err := unix.Fsetxattr(dst, k, v, 0); err != nil {
			return fmt.Errorf("set %s: %w", k, err)
		}
	}
	ts := []unix.Timespec{st.Atim, st.Mtim}
	return unix.UtimesNanoAt(dst, "", ts, unix.AT_EMPTY_PATH)
}

// copyAttrsAt gives od's name (a symlink or special file, not opened) the owner, mode,
// extended attributes and times of the view's vdir/name.
func copyAttrsAt(vdir, odir int, name string, st *unix.Stat_t) error {
	if err := unix.Fchownat(odir, name, int(st.Uid), int(st.Gid), unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFLNK {
		if err := unix.Fchmodat(odir, name, st.Mode&0o7777, 0); err != nil {
			return err
		}
	}
	// By path through the directory fds' /proc links: the last component is never
	// followed (l*xattr), the directory fds were opened beneath their roots.
	src := fmt.Sprintf("/proc/self/fd/%d/%s", vdir, name)
	dst := fmt.Sprintf("/proc/self/fd/%d/%s", odir, name)
	names, err := listxattr(func(b []byte) (int, error) { return unix.Llistxattr(src, b) })
	if err != nil {
		return err
	}
	for _, k := range names {
		v, err := getxattr(func(b []byte) (int, error) { return unix.Lgetxattr(src, k, b) })
		if err != nil {
			return err
		}
		if err := unix.Lsetxattr(dst, k, v, 0); err != nil {
			return fmt.Errorf("set %s: %w", k, err)
		}
	}
	return unix.UtimesNanoAt(odir, name, []unix.Timespec{st.Atim, st.Mtim}, unix.AT_SYMLINK_NOFOLLOW)
}

// xattrs reads fd's extended attributes but overlayfs's own.
func xattrs(fd int) (map[string][]byte, error) {
	names, err := listxattr(func(b []byte) (int, error) { return unix.Flistxattr(fd, b) })
	if err != nil {
		return nil, err
	}
	out := make(map[string][]byte, len(names))
	for _, k := range names {
		v, err := getxattr(func(b []byte) (int, error) { return unix.Fgetxattr(fd, k, b) })
		if err != nil {
			return nil, err
		}
		out[k] = v
	}
	return out, nil
}

// overlayXattr: overlayfs's private attributes (whiteouts, opaque, redirects), which
// a squashed layer never needs: it spells every difference out.
func overlayXattr(k string) bool {
	return strings.HasPrefix(k, "trusted.overlay.") || strings.HasPrefix(k, "user.overlay.")
}

func listxattr(list func([]byte) (int, error)) ([]string, error) {
	buf := make([]byte, 1024)
	for {
		n, err := list(buf)
		if errors.Is(err, unix.ERANGE) {
			buf = make([]byte, len(buf)*4)
			continue
		}
		if errors.Is(err, unix.ENOTSUP) {
			return nil, nil
		}
		if err != nil {
			return nil, err
		}
		var out []string
		for _, k := range strings.Split(string(buf[:n]), "\x00") {
			if k != "" && !overlayXattr(k) {
				out = append(out, k)
			}
		}
		slices.Sort(out)
		return out, nil
	}
}

func getxattr(get func([]byte) (int, error)) ([]byte, error) {
	buf := make([]byte, 256)
	for {
		n, err := get(buf)
		if errors.Is(err, unix.ERANGE) {
			buf = make([]byte, len(buf)*4)
			continue
		}
		if err != nil {
			return nil, err
		}
		return buf[:n], nil
	}
}

func readlinkat(dir int, name string) (string, error) {
	buf := make([]byte, 256)
	for {
		n, err := unix.Readlinkat(dir, name, buf)
		if err != nil {
			return "", err
		}
		if n < len(buf) {
			return string(buf[:n]), nil
		}
		buf = make([]byte, len(buf)*4)
	}
}

// copyBytes copies src's bytes to dst, both fds left open.
func copyBytes(dst, src int) error {
	buf := make([]byte, 128<<10)
	for {
		n, err := unix.Read(src, buf)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return err
		}
		if n == 0 {
			return nil
		}
		for b := buf[:n]; len(b) > 0; {
			w, err := unix.Write(dst, b)
			if err != nil && !errors.Is(err, unix.EINTR) {
				return err
			}
			b = b[max(w, 0):]
		}
	}
}

// readNames lists a directory fd's names (the fd stays open and is not moved).
func readNames(dir int) ([]string, error) {
	fd, err := unix.Openat(dir, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(fd), ".")
	defer f.Close()
	return f.Readdirnames(-1)
}

func join(rel, name string) string {
	if rel == "" {
		return name
	}
	return rel + "/" + name
}
