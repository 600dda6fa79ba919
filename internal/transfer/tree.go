package transfer

import (
	"archive/tar"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"sort"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// paxSparse is the PAX record of a file written with its holes left out: the file's
// size, then the offset and length of each data segment, in order
// ("SIZE OFF:LEN OFF:LEN ..."); the entry's data is the segments' bytes, concatenated.
// Go's archive/tar writes no sparse entries of its own, and GNU's sparse formats would
// bring their parser's corner cases to the importer.
const paxSparse = "DELTABOX.sparse"

// TreeStats counts what WriteTree wrote.
type TreeStats struct {
	Entries int64
	Bytes   int64 // regular files' apparent bytes
	Holes   int64 // bytes of holes left out of the archive
	Sockets int   // sockets skipped (a tar has no type for them; nothing listens after a move)
}

// WriteTree writes the tree under dir as a tar to w, in a form that depends only on the
// tree: entries sorted by name, parents first, the root as "."; owners as numbers, no
// user or group names, no access or change times, xattrs as SCHILY.xattr PAX records;
// hard links to the first name of their inode; holes of sparse files left out
// (paxSparse). Two writes of an unchanged tree give the same bytes, so a layer's digest
// names its content. Character devices are written only as overlayfs whiteouts (0/0);
// any other device is refused; sockets are skipped and counted.
//
// dir is read as the daemon, so it must be a tree no sandbox can write (a frozen layer,
// an image directory): no path is followed through a symbolic link, and files are
// opened with O_NOFOLLOW.
func WriteTree(w io.Writer, dir string) (TreeStats, error) {
	tw := tar.NewWriter(w)
	tw2 := &treeWriter{tw: tw, root: dir, links: map[[2]uint64]string{}}
	if err := tw2.walk("."); err != nil {
		return tw2.st, err
	}
	if err := tw.Close(); err != nil {
		return tw2.st, err
	}
	return tw2.st, nil
}

// Digest is the sha256 digest ("sha256:HEX") and length of what WriteTree writes for dir.
func Digest(dir string) (digest string, size int64, st TreeStats, err error) {
	h := sha256.New()
	cw := &countWriter{w: h}
	st, err = WriteTree(cw, dir)
	if err != nil {
		return "", 0, st, err
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil)), cw.n, st, nil
}

type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

type treeWriter struct {
	tw    *tar.Writer
	root  string
	links map[[2]uint64]string // (dev, ino) of a file with several links -> its first name
	st    TreeStats
	buf   []byte
}

func (t *treeWriter) full(rel string) string { return path.Join(t.root, rel) }

func (t *treeWriter) walk(rel string) error {
	full := t.full(rel)
	var st unix.Stat_t
	if err := unix.Lstat(full, &st); err != nil {
		return &os.PathError{Op: "lstat", Path: full, Err: err}
	}
	h := &tar.Header{Name: rel, Mode: int64(st.Mode & 0o7777), Uid: int(st.Uid), Gid: int(st.Gid),
		ModTime: timeOf(st.Mtim), Format: tar.FormatPAX}
	xs, err := readXattrs(full)
	if err != nil {
		return err
	}
	for k, v := range xs {
		if !keepXattr(k) {
			continue
		}
		if h.PAXRecords == nil {
			h.PAXRecords = map[string]string{}
		}
		h.PAXRecords["SCHILY.xattr."+k] = v
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFDIR:
		h.Typeflag = tar.TypeDir
		if err := t.header(h); err != nil {
			return err
		}
		names, err := readNames(full)
		if err != nil {
			return err
		}
		for _, n := range names {
			if err := t.walk(path.Join(rel, n)); err != nil {
				return err
			}
		}
		return nil
	case unix.S_IFREG:
		if st.Nlink > 1 {
			key := [2]uint64{st.Dev, st.Ino}
			if first, ok := t.links[key]; ok {
				return t.header(&tar.Header{Name: rel, Typeflag: tar.TypeLink, Linkname: first, Format: tar.FormatPAX})
			}
			t.links[key] = rel
		}
		return t.file(h, full, st.Size)
	case unix.S_IFLNK:
		target, err := os.Readlink(full)
		if err != nil {
			return err
		}
		if target == "" || symlinkClimbs(rel, target) {
			return fmt.Errorf("/%s is a symbolic link to %q, which climbs above / (an importer refuses such links: replace it by an absolute target, ln -sfn /PATH): %w", rel, target, ErrRefused)
		}
		h.Typeflag, h.Linkname = tar.TypeSymlink, target
		return t.header(h)
	case unix.S_IFCHR:
		if st.Rdev != 0 {
			return fmt.Errorf("%s is a character device %d:%d, not an overlayfs whiteout (0:0): a layer holds no other device: %w",
				rel, unix.Major(st.Rdev), unix.Minor(st.Rdev), ErrRefused)
		}
		h.Typeflag = tar.TypeChar
		return t.header(h)
	case unix.S_IFIFO:
		h.Typeflag = tar.TypeFifo
		return t.header(h)
	case unix.S_IFSOCK:
		t.st.Sockets++
		return nil
	default:
		return fmt.Errorf("%s is a block device: a layer holds none: %w", rel, ErrRefused)
	}
}

func (t *treeWriter) header(h *tar.Header) error {
	t.st.Entries++
	if err := t.tw.WriteHeader(h); err != nil {
		return fmt.Errorf("%s: %w", h.Name, err)
	}
	return nil
}

// file writes a regular file, its holes left out when it has any.
func (t *treeWriter) file(h *tar.Header, full string, size int64) error {
	f, err := os.OpenFile(full, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_NOATIME, 0)
	if errors.Is(err, unix.EPERM) { // O_NOATIME: only the owner or CAP_FOWNER
		f, err = os.OpenFile(full, os.O_RDONLY|unix.O_NOFOLLOW, 0)
	}
	if err != nil {
		return err
	}
	defer f.Close()
	segs, err := dataSegments(f, size)
	if err != nil {
		return fmt.Errorf("%s: %w", full, err)
	}
	h.Typeflag, h.Size = tar.TypeReg, size
	var data int64
	for _, s := range segs {
		data += s[1]
	}
	if data < size {
		var b strings.Builder
		b.WriteString(strconv.FormatInt(size, 10))
		for _, s := range segs {
			fmt.Fprintf(&b, " %d:%d", s[0], s[1])
		}
		if h.PAXRecords == nil {
			h.PAXRecords = map[string]string{}
		}
		h.PAXRecords[paxSparse] = b.String()
		h.Size = data
		t.st.Holes += size - data
	}
	if err := t.header(h); err != nil {
		return err
	}
	t.st.Bytes += size
	for _, s := range segs {
		if _, err := f.Seek(s[0], io.SeekStart); err != nil {
			return err
		}
		if n, err := io.CopyN(t.tw, f, s[1]); err != nil {
			return fmt.Errorf("%s: %d of %d bytes at %d: %w (the file changed while it was read)", full, n, s[1], s[0], err)
		}
	}
	return nil
}

// dataSegments lists the [offset, length] of f's data (SEEK_DATA, SEEK_HOLE); a file
// without holes is one segment.
func dataSegments(f *os.File, size int64) ([][2]int64, error) {
	if size == 0 {
		return nil, nil
	}
	var segs [][2]int64
	fd := int(f.Fd())
	for off := int64(0); off < size; {
		d, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if err == unix.ENXIO {
			break // a hole to the end
		}
		if err == unix.EINVAL || err == unix.EOPNOTSUPP {
			return [][2]int64{{0, size}}, nil
		}
		if err != nil {
			return nil, err
		}
		e, err := unix.Seek(fd, d, unix.SEEK_HOLE)
		if err != nil {
			return nil, err
		}
		e = min(e, size)
		if e > d {
			segs = append(segs, [2]int64{d, e - d})
		}
		off = e
	}
	return segs, nil
}

func timeOf(ts unix.Timespec) time.Time { return time.Unix(ts.Sec, ts.Nsec) }

// readNames lists a directory's entries, sorted.
func readNames(dir string) ([]string, error) {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: dir, Err: err}
	}
	f := os.NewFile(uintptr(fd), dir)
	defer f.Close()
	names, err := f.Readdirnames(-1)
	if err != nil {
		return nil, err
	}
	sort.Strings(names)
	return names, nil
}

// readXattrs reads every extended attribute of p (not following a link).
func readXattrs(p string) (map[string]string, error) {
	sz, err := unix.Llistxattr(p, nil)
	if err != nil || sz == 0 {
		if err == unix.ENOTSUP {
			err = nil
		}
		return nil, err
	}
	buf := make([]byte, sz)
	if sz, err = unix.Llistxattr(p, buf); err != nil {
		return nil, fmt.Errorf("list xattrs of %s: %w", p, err)
	}
	out := map[string]string{}
	for _, k := range strings.Split(strings.TrimRight(string(buf[:sz]), "\x00"), "\x00") {
		if k == "" {
			continue
		}
		vsz, err := unix.Lgetxattr(p, k, nil)
		if err != nil {
			return nil, fmt.Errorf("xattr %s of %s: %w", k, p, err)
		}
		v := make([]byte, vsz)
		if vsz, err = unix.Lgetxattr(p, k, v); err != nil {
			return nil, fmt.Errorf("xattr %s of %s: %w", k, p, err)
		}
		out[k] = string(v[:vsz])
	}
	return out, nil
}
