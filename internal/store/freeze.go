package store

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

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

// Freeze moves layer id's upper content into frozen/ (made here, or beforehand by
// PrepareFrozen). The root directory's mode, owner and xattrs are copied first. On
// failure it moves back what it moved.
// Precondition: nothing writes to the layer (the sandbox's processes are stopped).
func (s *Store) Freeze(id uint64) error {
	diff, frozen := s.LayerDiff(id), s.LayerFrozen(id)
	var st unix.Stat_t
	if err := unix.Lstat(diff, &st); err != nil {
		return fmt.Errorf("freeze layer %d: %w", id, err)
	}
	made := false
	if err := unix.Mkdir(frozen, st.Mode&0o7777); err == nil {
		made = true
	} else if !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("freeze layer %d: %w", id, err)
	}
	if err := copyRootAttrs(diff, frozen, &st); err != nil {
		if made {
			unix.Rmdir(frozen)
		}
		return fmt.Errorf("freeze layer %d: %w", id, err)
	}
	if err := moveEntries(diff, frozen); err != nil {
		if uerr := moveEntries(frozen, diff); uerr == nil && made {
			unix.Rmdir(frozen)
		}
		return fmt.Errorf("freeze layer %d: %w", id, err)
	}
	return nil
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
	return copyRootAttrs(diff, frozen, &st)
}

// DropPreparedFrozen removes an unused (empty) frozen/ of a layer that is still an upper.
func (s *Store) DropPreparedFrozen(id uint64) error { return unix.Rmdir(s.LayerFrozen(id)) }

// Unfreeze undoes Freeze (a failed checkpoint, or the startup repair of one that a
// crash interrupted): entries go back to diff/ and frozen/ is removed.
func (s *Store) Unfreeze(id uint64) error {
	diff, frozen := s.LayerDiff(id), s.LayerFrozen(id)
	if err := moveEntries(frozen, diff); err != nil {
		return fmt.Errorf("unfreeze layer %d: %w", id, err)
	}
	if err := os.Remove(frozen); err != nil {
		return fmt.Errorf("unfreeze layer %d: %w", id, err)
	}
	return nil
}

// DropUpperDirs removes diff/ and work/ of a frozen layer (after its last overlay as
// an upper is gone).
func (s *Store) DropUpperDirs(id uint64) {
	RemoveAll(s.LayerDiff(id))
	RemoveAll(s.LayerWork(id))
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

func moveEntries(from, to string) error {
	f, err := os.Open(from)
	if err != nil {
		return err
	}
	names, err := f.Readdirnames(-1)
	f.Close()
	if err != nil {
		return err
	}
	ffd, err := unix.Open(from, unix.O_DIRECTORY|unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(ffd)
	tfd, err := unix.Open(to, unix.O_DIRECTORY|unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(tfd)
	for _, n := range names {
		// RENAME_NOREPLACE: never clobber; a name present on both sides is a bug.
		if err := unix.Renameat2(ffd, n, tfd, n, unix.RENAME_NOREPLACE); err != nil {
			return fmt.Errorf("move %s: %w", n, err)
		}
	}
	return nil
}

func copyRootAttrs(from, to string, st *unix.Stat_t) error {
	if err := unix.Lchown(to, int(st.Uid), int(st.Gid)); err != nil {
		return err
	}
	if err := unix.Chmod(to, st.Mode&0o7777); err != nil { // mkdir applied the umask
		return err
	}
	// Drop what the target has and the source no longer has (a prepared frozen/ was
	// made from an earlier state of the root).
	tbuf := make([]byte, 4096)
	if tn, err := unix.Llistxattr(to, tbuf); err == nil {
		for _, name := range splitNul(tbuf[:tn]) {
			if _, err := unix.Lgetxattr(from, name, nil); errors.Is(err, unix.ENODATA) {
				unix.Lremovexattr(to, name)
			}
		}
	}
	buf := make([]byte, 4096)
	n, err := unix.Llistxattr(from, buf)
	if errors.Is(err, unix.ENOTSUP) {
		return nil
	}
	if err != nil {
		return err
	}
	val := make([]byte, 64<<10)
	for _, name := range splitNul(buf[:n]) {
		vn, err := unix.Lgetxattr(from, name, val)
		if err != nil {
			return fmt.Errorf("read xattr %s: %w", name, err)
		}
		if err := unix.Lsetxattr(to, name, val[:vn], 0); err != nil {
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
