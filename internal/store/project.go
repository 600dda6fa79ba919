package store

import (
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Project ids. XFS keeps a 32-bit project id in every inode whether or not quotas are
// on (projid32bit=1, mkfs's default), and a directory with FS_XFLAG_PROJINHERIT gives
// its id to every entry made in it (measured on this kernel's noquota store: a file,
// a directory and a file two levels down all carry it; TestProjectInherited). Each
// layer gets an id of its own, one of its store's range (projrange.go), on diff/,
// work/ and frozen/ alike:
//
//   - what a sandbox's upper holds is then the inodes of its upper's project, which
//     one XFS_IOC_BULKSTAT pass over the store finds (usage.go) without walking the
//     tree, open-but-unlinked files and overlayfs's in-flight copy-ups in work/
//     included, which a walk of diff/ misses;
//   - work/ must have the id too: overlayfs makes a copy-up in work/ and renames it
//     into diff/, and XFS refuses a rename into a PROJINHERIT directory of another
//     project with EXDEV (xfs_rename), which overlayfs would pass on to the writer;
//   - frozen/ must have it for the same reason: Freeze renames diff/'s entries into
//     it (TestFreezeKeepsProject, TestRenameAcrossProjectsFails).
//
// With kernel quotas (a kernel with CONFIG_XFS_QUOTA and the store mounted prjquota),
// the same ids would take a hard block and inode limit per upper (Q_XSETQLIM on the
// upper's project before it is handed out): writes past disk_mb would fail with EDQUOT
// in the writer itself, at once, instead of the watcher's kill a tick later; the
// accounting would be the kernel's, read with Q_XGETQUOTA per project instead of a
// bulkstat pass. This kernel has no XFS quota support ("quota support not available
// in this kernel" at mount -o prjquota), so the daemon measures and enforces itself
// (state/diskquota.go).

// fsxattr is struct fsxattr of <linux/fs.h>.
type fsxattr struct {
	Xflags     uint32
	Extsize    uint32
	Nextents   uint32
	Projid     uint32
	Cowextsize uint32
	Pad        [8]byte
}

const (
	fsIocFsGetXattr     = 0x801c581f // _IOR('X', 31, struct fsxattr)
	fsIocFsSetXattr     = 0x401c5820 // _IOW('X', 32, struct fsxattr)
	fsXflagProjInherit  = 0x00000200
	projectIoctlAttempt = 3 // EINTR retries
)

func fsGetXattr(fd int) (fsxattr, error) {
	var a fsxattr
	var err error
	for range projectIoctlAttempt {
		_, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), fsIocFsGetXattr, uintptr(unsafe.Pointer(&a)))
		if e != unix.EINTR {
			if e != 0 {
				err = e
			}
			break
		}
	}
	return a, err
}

func fsSetXattr(fd int, a *fsxattr) error {
	for range projectIoctlAttempt {
		_, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), fsIocFsSetXattr, uintptr(unsafe.Pointer(a)))
		if e != unix.EINTR {
			if e != 0 {
				return e
			}
			return nil
		}
	}
	return unix.EINTR
}

// setProjectFd gives the directory at fd project id p, inherited by what is made in it.
func setProjectFd(fd int, p uint32) error {
	a, err := fsGetXattr(fd)
	if err != nil {
		return err
	}
	if a.Projid == p && a.Xflags&fsXflagProjInherit != 0 {
		return nil
	}
	a.Projid = p
	a.Xflags |= fsXflagProjInherit
	return fsSetXattr(fd, &a)
}

// SetProject gives directory dir project id p, inherited by every entry made in it
// from then on (entries already there keep theirs).
func SetProject(dir string, p uint32) error {
	fd, err := openDir(dir)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := setProjectFd(fd, p); err != nil {
		return fmt.Errorf("set XFS project %d on %s: %w", p, dir, err)
	}
	return nil
}

// Project reads the project id of path (not following a final symlink) and whether
// new entries inherit it.
func Project(path string) (p uint32, inherit bool, err error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return 0, false, err
	}
	defer unix.Close(fd)
	a, err := fsGetXattr(fd)
	if err != nil {
		return 0, false, err
	}
	return a.Projid, a.Xflags&fsXflagProjInherit != 0, nil
}
