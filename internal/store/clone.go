package store

import (
	"io"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// CloneFile copies the regular file src (not followed if it is a symlink) into a new
// file dst (0600; an existing dst is an error): by reflink (FICLONE: dst shares src's
// extents, copy-on-write, whatever its size, in one call) where both are on one reflink
// filesystem, as the store is (XFS with reflink=1), and else by a copy of its bytes
// (FICLONE fails with EXDEV across filesystems and EOPNOTSUPP or EINVAL where they cannot
// share extents). dst is closed, and its close checked, before CloneFile returns.
func CloneFile(src, dst string) error {
	in, err := os.OpenFile(src, os.O_RDONLY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return err
	}
	defer func() { _ = in.Close() }() // read-only, after the copy
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	defer func() { _ = out.Close() }() // the success path closes it and checks; this one is for the errors
	if unix.IoctlFileClone(int(out.Fd()), int(in.Fd())) != nil {
		if _, err := io.Copy(out, in); err != nil {
			return err
		}
	}
	return out.Close()
}

// CloneDir copies the regular files of src (one level; anything else is left out) that
// keep accepts by name (nil: all) into a new directory dst (0700), each by CloneFile and
// then given mode perm (0: CloneFile's 0600).
func CloneDir(src, dst string, keep func(name string) bool, perm os.FileMode) error {
	if err := os.Mkdir(dst, 0o700); err != nil {
		return err
	}
	ents, err := os.ReadDir(src)
	if err != nil {
		return err
	}
	for _, e := range ents {
		if !e.Type().IsRegular() || (keep != nil && !keep(e.Name())) {
			continue
		}
		to := filepath.Join(dst, e.Name())
		if err := CloneFile(filepath.Join(src, e.Name()), to); err != nil {
			return err
		}
		if perm != 0 {
			if err := os.Chmod(to, perm); err != nil {
				return err
			}
		}
	}
	return nil
}
