package store

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"

	"golang.org/x/sys/unix"
)

// A layer lives in ROOT/layers/ID. While it is a sandbox's upper its files are in
// diff/ (with work/ beside it). Freezing moves them, entry by entry, into a new
// directory frozen/, which from then on is the layer's lower path.
//
// Why not use diff/ itself as the lower: overlayfs marks the root inode of every
// upperdir "in use" until that overlay's superblock is gone, and mounting a lower that
// is still in use logs "is in-use as upperdir/workdir of another mount ... undefined
// behavior". Tearing the old overlay down first costs two expedited RCU grace periods
// (about 0.6 ms here, measured) on the checkpoint's critical path. A new directory has
// a new inode, so the new stack can be mounted at once and the old overlay, whose
// upper is now an empty diff/, is released after the checkpoint has answered. A
// rename is O(1) and moves whole subtrees, so the cost is one rename per top-level
// entry of the upper (a handful: workspace, tmp, root, ...).

// LayerFrozen is the lower path of a frozen layer.
func (s *Store) LayerFrozen(id uint64) string { return filepath.Join(s.LayerDir(id), "frozen") }

// IsFrozen reports whether layer id has been frozen (its frozen/ exists).
func (s *Store) IsFrozen(id uint64) bool {
	_, err := os.Lstat(s.LayerFrozen(id))
	return err == nil
}

// FrozenHasEntries reports whether layer id's frozen/ exists and holds entries: a freeze
// happened (a prepared frozen/, made ahead by PrepareFrozen, is empty until one does).
func (s *Store) FrozenHasEntries(id uint64) bool {
	d, err := os.Open(s.LayerFrozen(id))
	if err != nil {
		return false
	}
	defer func() { _ = d.Close() }() // read-only, after the read
	names, _ := d.Readdirnames(1)
	return len(names) > 0
}

// Freeze moves layer id's upper content into frozen/ (made here, or beforehand by
// PrepareFrozen). The root directory's mode, owner and xattrs are copied first, its
// atime and mtime last (they are "/"'s: see RootAttrs). On failure it moves back what
// it moved, and diff/'s times with it.
//
// It works on directory fds with raw syscalls (about 12 in the usual case of a
// prepared frozen/ and two top-level entries): Freeze is on the checkpoint's critical
// path, where every syscall costs 10-50 us on a vCPU that was idle a moment before
// (measured: the first read of a small /proc file after 50 ms idle takes ~120 us,
// the next one ~12 us), and os.ReadDir alone makes 8 syscalls per directory.
// Precondition: nothing writes to the layer (the sandbox's processes are stopped).
func (s *Store) Freeze(id uint64) error {
	diff, frozen := s.LayerDiff(id), s.LayerFrozen(id)
	dfd, err := openDir(diff)
	if err != nil {
		return fmt.Errorf("freeze layer %d: %w", id, err)
	}
	defer unix.Close(dfd)
	var st unix.Stat_t
	if err := unix.Fstat(dfd, &st); err != nil {
		return fmt.Errorf("freeze layer %d: %w", id, err)
	}
	made := false
	ffd, err := openDir(frozen)
	if errors.Is(err, unix.ENOENT) {
		if err = unix.Mkdir(frozen, st.Mode&0o7777); err == nil {
			made = true
			ffd, err = openDir(frozen)
		}
	}
	if err != nil {
		if made {
			err = undone(err, unix.Rmdir(frozen))
		}
		return fmt.Errorf("freeze layer %d: %w", id, err)
	}
	defer unix.Close(ffd)
	if err := copyRootAttrs(dfd, ffd, &st); err != nil {
		if made {
			err = undone(err, unix.Rmdir(frozen))
		}
		return fmt.Errorf("freeze layer %d: %w", id, err)
	}
	moved, err := moveEntries(dfd, ffd)
	if err == nil {
		// Last: the renames moved frozen/'s times, and diff/'s ("/"'s) are the node's.
		err = futimens(ffd, st.Atim, st.Mtim)
	}
	if err != nil {
		if _, uerr := moveNames(ffd, dfd, moved); uerr != nil {
			err = undone(err, fmt.Errorf("move entries back from %s: %w", frozen, uerr))
		} else {
			err = undone(err, futimens(dfd, st.Atim, st.Mtim))
			if made {
				err = undone(err, unix.Rmdir(frozen))
			}
		}
		return fmt.Errorf("freeze layer %d: %w", id, err)
	}
	return nil
}

// undone is err with what its undo could not put back (uerr, if any): err stays the
// one errors.Is sees.
func undone(err, uerr error) error {
	if uerr == nil {
		return err
	}
	return fmt.Errorf("%w; undoing it: %v", err, uerr)
}

// PrepareFrozen makes layer id's (empty) frozen/ directory ahead of its checkpoint, so
// that the next state's overlay, which lists it as a lower, can be mounted before the
// checkpoint is asked for (see state's prepared next state).
func (s *Store) PrepareFrozen(id uint64) error {
	diff, frozen := s.LayerDiff(id), s.LayerFrozen(id)
	var st unix.Stat_t
	if err := unix.Lstat(diff, &st); err != nil {
		return err
	}
	if err := unix.Mkdir(frozen, st.Mode&0o7777); err != nil {
		return err
	}
	dfd, err := openDir(diff)
	if err != nil {
		return err
	}
	defer unix.Close(dfd)
	ffd, err := openDir(frozen)
	if err != nil {
		return err
	}
	defer unix.Close(ffd)
	return copyRootAttrs(dfd, ffd, &st)
}

// DropPreparedFrozen removes an unused (empty) frozen/ of a layer that is still an upper.
func (s *Store) DropPreparedFrozen(id uint64) error { return unix.Rmdir(s.LayerFrozen(id)) }

// Unfreeze undoes Freeze (a failed checkpoint, or the startup repair of one that a
// crash interrupted): entries go back to diff/, with frozen/'s times (a crash inside
// Freeze, before it set them, leaves "/" the mtime of that moment), and frozen/ is
// removed.
func (s *Store) Unfreeze(id uint64) error {
	diff, frozen := s.LayerDiff(id), s.LayerFrozen(id)
	dfd, err := openDir(diff)
	if err != nil {
		return fmt.Errorf("unfreeze layer %d: %w", id, err)
	}
	defer unix.Close(dfd)
	ffd, err := openDir(frozen)
	if err != nil {
		return fmt.Errorf("unfreeze layer %d: %w", id, err)
	}
	var st unix.Stat_t
	err = unix.Fstat(ffd, &st) // "/"'s times, which Freeze gave frozen/
	if err == nil {
		_, err = moveEntries(ffd, dfd)
	}
	unix.Close(ffd)
	if err == nil {
		err = futimens(dfd, st.Atim, st.Mtim)
	}
	if err != nil {
		return fmt.Errorf("unfreeze layer %d: %w", id, err)
	}
	if err := os.Remove(frozen); err != nil {
		return fmt.Errorf("unfreeze layer %d: %w", id, err)
	}
	return nil
}

// DropUpperDirs removes diff/ and work/ of a frozen layer (after its last overlay as
// an upper is gone). Best effort: what stays is removed again at the next start, which
// drops them for every frozen layer (state's New).
func (s *Store) DropUpperDirs(id uint64) {
	_ = RemoveAll(s.LayerDiff(id))
	_ = RemoveAll(s.LayerWork(id))
}

// ResetWork recreates a layer's overlay workdir. A volatile overlay leaves
// work/incompat/volatile behind and refuses to mount on it again (the kernel's
// guard against reusing an upper that was never synced); the daemon syncs before it
// trusts an upper again, so it clears the guard before remounting an existing upper.
func (s *Store) ResetWork(id uint64) error {
	w := s.LayerWork(id)
	if err := RemoveAll(w); err != nil {
		return err
	}
	return os.Mkdir(w, 0o700)
}

// openDir opens a directory (never following a symlink) for the fd-based calls below.
func openDir(p string) (int, error) {
	for {
		fd, err := unix.Open(p, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != unix.EINTR {
			return fd, err
		}
	}
}

// dirNames lists up to max entries (all if max < 0) of the directory open at fd, from
// its current offset, with getdents64 ("." and ".." left out).
func dirNames(fd, max int) ([]string, error) {
	var names []string
	buf := make([]byte, 8192)
	for max < 0 || len(names) < max {
		n, err := unix.Getdents(fd, buf)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return nil, err
		}
		if n <= 0 {
			break
		}
		want := -1
		if max >= 0 {
			want = max - len(names)
		}
		_, _, names = unix.ParseDirent(buf[:n], want, names)
	}
	return names, nil
}

// moveEntries renames every entry of the directory at from into the one at to, and
// returns the names it moved (all of them, or those before a failure).
func moveEntries(from, to int) ([]string, error) {
	if _, err := unix.Seek(from, 0, 0); err != nil {
		return nil, err
	}
	names, err := dirNames(from, -1)
	if err != nil {
		return nil, err
	}
	return moveNames(from, to, names)
}

// moveNames renames names from the directory at from into the one at to.
func moveNames(from, to int, names []string) ([]string, error) {
	for i, n := range names {
		// RENAME_NOREPLACE: never clobber; a name present on both sides is a bug.
		if err := unix.Renameat2(from, n, to, n, unix.RENAME_NOREPLACE); err != nil {
			return names[:i], fmt.Errorf("move %s: %w", n, err)
		}
	}
	return names, nil
}

// copyRootAttrs gives the directory at to the owner, mode and xattrs st and the
// directory at from have, touching only what differs in owner and mode.
func copyRootAttrs(from, to int, st *unix.Stat_t) error {
	var cur unix.Stat_t
	if err := unix.Fstat(to, &cur); err != nil {
		return err
	}
	if cur.Uid != st.Uid || cur.Gid != st.Gid {
		if err := unix.Fchown(to, int(st.Uid), int(st.Gid)); err != nil {
			return err
		}
	}
	if cur.Mode&0o7777 != st.Mode&0o7777 { // mkdir applied the umask
		if err := unix.Fchmod(to, st.Mode&0o7777); err != nil {
			return err
		}
	}
	names, err := listXattrs(from)
	if err != nil {
		return err
	}
	// Drop what the target has and the source no longer has (a prepared frozen/ was
	// made from an earlier state of the root).
	if tnames, err := listXattrs(to); err == nil {
		for _, name := range tnames {
			if !slices.Contains(names, name) {
				if err := unix.Fremovexattr(to, name); err != nil && !errors.Is(err, unix.ENODATA) {
					return fmt.Errorf("drop xattr %s: %w", name, err)
				}
			}
		}
	}
	for _, name := range names {
		val, err := getXattr(from, name)
		if err != nil {
			return fmt.Errorf("read xattr %s: %w", name, err)
		}
		if err := unix.Fsetxattr(to, name, val, 0); err != nil {
			return fmt.Errorf("copy xattr %s: %w", name, err)
		}
	}
	return nil
}

func splitNul(b []byte) []string {
	var out []string
	start := 0
	for i, c := range b {
		if c == 0 {
			if i > start {
				out = append(out, string(b[start:i]))
			}
			start = i + 1
		}
	}
	return out
}
