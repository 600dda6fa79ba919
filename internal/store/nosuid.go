package store

import (
	"fmt"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// Harden makes the store nosuid and nodev where the host sees it, before any sandbox
// runs (the daemon calls it at start).
//
// A sandbox's files are on the store with the ids they have inside (layers are seen
// through an idmapped mount: overlay.IDMapped), so a file that root of a sandbox made
// setuid is, on the store's own mount, a setuid file of host root, and a device node
// an image carried is a device node of the host. Nothing of a sandbox reaches the
// store's mount, and its directories are root's (0700), but one path given out (a
// directory made searchable, an fd passed, a backup restored elsewhere with the same
// mount options) would make every sandbox's setuid file a host root shell. On a nosuid
// mount exec ignores the set-id bits and file capabilities, and on a nodev mount device
// nodes do not open. Inside a sandbox nothing changes: its files are reached through
// overlays, mounts of their own whose flags are the sandbox's (nodev; setuid programs
// work, as root of the sandbox: docs/SECURITY.md).
//
// When the store is its own filesystem's mount (scripts/setup.sh mounts it so), the
// mount's flags are set in place (mount_setattr). When it is a directory of a larger
// mount (the root filesystem, or the main store for tests' stores), that mount is not
// the daemon's to change: the store is bound onto itself, nosuid and nodev, with what is
// mounted below it, and every path through the store's directory is then the bind's.
// The bind stays when the daemon exits (the next one finds the store hardened); umount
// it to remove the store's directory. A daemon in a mount namespace of its own hardens
// only its own view: run it in the host's.
func Harden(root string) error {
	const want = unix.ST_NOSUID | unix.ST_NODEV
	var st unix.Statfs_t
	if err := unix.Statfs(root, &st); err == unix.ENOENT {
		return nil // Open says what to do
	} else if err != nil {
		return fmt.Errorf("state directory %s: %w", root, err)
	}
	if st.Flags&want == want {
		return nil
	}
	dir, err := filepath.EvalSymlinks(root)
	if err != nil {
		return err
	}
	dir, err = filepath.Abs(dir)
	if err != nil {
		return err
	}
	top, err := isMountRoot(dir)
	if err != nil {
		return err
	}
	attr := unix.MountAttr{Attr_set: unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV}
	if top {
		fd, err := unix.OpenTree(unix.AT_FDCWD, dir, unix.OPEN_TREE_CLOEXEC)
		if err != nil {
			return fmt.Errorf("open the store's mount %s: %w", dir, err)
		}
		defer unix.Close(fd)
		if err := unix.MountSetattr(fd, "", unix.AT_EMPTY_PATH, &attr); err != nil {
			return fmt.Errorf("make the store's mount %s nosuid,nodev: %w (mount it with -o nosuid,nodev)", dir, err)
		}
		return nil
	}
	fd, err := unix.OpenTree(unix.AT_FDCWD, dir, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_RECURSIVE)
	if err != nil {
		return fmt.Errorf("bind the store %s onto itself: %w", dir, err)
	}
	defer unix.Close(fd)
	if err := unix.MountSetattr(fd, "", unix.AT_EMPTY_PATH|unix.AT_RECURSIVE, &attr); err != nil {
		return fmt.Errorf("make the bind of the store %s nosuid,nodev: %w", dir, err)
	}
	if err := unix.MoveMount(fd, "", unix.AT_FDCWD, dir, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("bind the store %s onto itself nosuid,nodev: %w (or mount its filesystem with -o nosuid,nodev)", dir, err)
	}
	return nil
}

// isMountRoot reports whether dir (absolute, no symbolic links) is the root of a mount.
func isMountRoot(dir string) (bool, error) {
	if dir == "/" {
		return true, nil
	}
	id := func(p string) (uint64, error) {
		var st unix.Statx_t
		if err := unix.Statx(unix.AT_FDCWD, p, unix.AT_SYMLINK_NOFOLLOW, unix.STATX_MNT_ID, &st); err != nil {
			return 0, fmt.Errorf("statx %s: %w", p, err)
		}
		return st.Mnt_id, nil
	}
	a, err := id(dir)
	if err != nil {
		return false, err
	}
	b, err := id(filepath.Dir(dir))
	if err != nil {
		return false, err
	}
	return a != b, nil
}
