package image

import (
	"archive/tar"
	"context"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// copyDir copies a rootfs directory into t through the same writer and rules as an
// archive: file data is cloned (a reflink when source and store share a filesystem),
// hard links within the source stay hard links, other filesystems mounted below the
// source are not entered (their mount points are copied as empty directories).
func copyDir(ctx context.Context, t *tree, src string, m *meter) error {
	var rootSt unix.Stat_t
	if err := unix.Stat(src, &rootSt); err != nil {
		return err
	}
	var total int64
	filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		if d.Type().IsRegular() {
			if fi, err := d.Info(); err == nil {
				total += fi.Size()
			}
		}
		if d.IsDir() && p != src {
			if fi, err := d.Info(); err == nil {
				if st, ok := fi.Sys().(*unix.Stat_t); ok && st.Dev != rootSt.Dev {
					return filepath.SkipDir
				}
			}
		}
		return ctx.Err()
	})
	m.pass(total, 0, total, total)
	var done int64
	links := map[[2]uint64]string{}
	return filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return fmt.Errorf("read the source: %w", err)
		}
		rel, err := filepath.Rel(src, p)
		if err != nil {
			return err
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return fmt.Errorf("read the source: %w", &os.PathError{Op: "lstat", Path: p, Err: err})
		}
		h := &tar.Header{
			Name:       rel,
			Mode:       int64(st.Mode & 0o7777),
			Uid:        int(st.Uid),
			Gid:        int(st.Gid),
			ModTime:    time.Unix(st.Mtim.Unix()),
			AccessTime: time.Unix(st.Atim.Unix()),
		}
		mb := member{hdr: h}
		skip := false
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFDIR:
			h.Typeflag = tar.TypeDir
			skip = p != src && st.Dev != rootSt.Dev
		case unix.S_IFREG:
			key := [2]uint64{st.Dev, st.Ino}
			if first, ok := links[key]; ok {
				h.Typeflag, h.Linkname = tar.TypeLink, first
				break
			}
			if st.Nlink > 1 {
				links[key] = rel
			}
			h.Typeflag, h.Size = tar.TypeReg, st.Size
			f, err := os.OpenFile(p, os.O_RDONLY|unix.O_NOFOLLOW, 0)
			if err != nil {
				return fmt.Errorf("read the source: %w", err)
			}
			defer f.Close()
			var fst unix.Stat_t
			if err := unix.Fstat(int(f.Fd()), &fst); err != nil || fst.Ino != st.Ino || fst.Mode&unix.S_IFMT != unix.S_IFREG {
				return fmt.Errorf("read the source: %s changed while it was copied", p)
			}
			h.Size = fst.Size
			mb.src = f
		case unix.S_IFLNK:
			target, err := os.Readlink(p)
			if err != nil {
				return fmt.Errorf("read the source: %w", err)
			}
			h.Typeflag, h.Linkname = tar.TypeSymlink, target
		case unix.S_IFCHR:
			h.Typeflag = tar.TypeChar
		case unix.S_IFBLK:
			h.Typeflag = tar.TypeBlock
		case unix.S_IFIFO:
			h.Typeflag = tar.TypeFifo
		case unix.S_IFSOCK:
			h.Typeflag = typeSocket
		}
		if h.Typeflag == tar.TypeReg || h.Typeflag == tar.TypeDir {
			if x := readXattrs(p); len(x) > 0 {
				h.PAXRecords = x
			}
		}
		if err := t.apply(mb); err != nil {
			return err
		}
		if mb.src != nil {
			done += h.Size
			m.at(done)
		}
		if skip {
			return filepath.SkipDir
		}
		return nil
	})
}

// readXattrs returns the extended attributes of p the importer may keep, as the
// PAX records a tar would carry them in.
func readXattrs(p string) map[string]string {
	sz, err := unix.Llistxattr(p, nil)
	if err != nil || sz <= 0 {
		return nil
	}
	buf := make([]byte, sz)
	sz, err = unix.Llistxattr(p, buf)
	if err != nil {
		return nil
	}
	var out map[string]string
	for _, name := range strings.Split(strings.TrimRight(string(buf[:sz]), "\x00"), "\x00") {
		if !strings.HasPrefix(name, "user.") && name != "security.capability" {
			continue
		}
		vsz, err := unix.Lgetxattr(p, name, nil)
		if err != nil {
			continue
		}
		v := make([]byte, vsz)
		if vsz, err = unix.Lgetxattr(p, name, v); err != nil {
			continue
		}
		if out == nil {
			out = map[string]string{}
		}
		out["SCHILY.xattr."+name] = string(v[:vsz])
	}
	return out
}
