package store

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Room kept so that the index always commits, even when a sandbox has filled the store
// (the disk quota's watcher acts a tick after the fact, and every sandbox's writes
// share one filesystem):
//
//   - index.db's own headroom: IndexHeadroom bytes allocated past its end
//     (fallocate KEEP_SIZE). bbolt grows its file by ftruncate, which leaves a hole;
//     over preallocated blocks the growth and the page writes that follow need no new
//     space, so no writer can take that room between a release and the commit that
//     needed it.
//   - ROOT/reserve, ReserveBytes allocated in a file of its own, which the committer
//     deletes when a commit fails with ENOSPC (ReleaseReserve), then tries again at
//     once: room for what the headroom does not cover (a larger batch, syncfs's
//     writeback, the directories of the next checkpoint). Released, it is logged and
//     reported (Index.Warning) until TopUp makes it again, once the store has twice
//     that much free.
const (
	ReserveBytes  = 64 << 20
	IndexHeadroom = 32 << 20
)

func (s *Store) reservePath() string { return filepath.Join(s.Root, "reserve") }

// TopUp makes the reserve and index.db's headroom whatever is missing of them, when the
// store has room for that and as much again. It reports what it could not do; nil when
// both are whole.
func (s *Store) TopUp() error {
	free, err := s.FreeBytes()
	if err != nil {
		return err
	}
	if free < 2*ReserveBytes+2*IndexHeadroom {
		// XFS frees an unlinked file's blocks in the background (inode inactivation
		// is deferred to a per-CPU worker since 5.19), and statfs only nudges that
		// worker: right after a large delete the space is not yet counted as free.
		// syncfs waits for it. Only paid when short of room.
		if free, err = s.settledFreeBytes(); err != nil {
			return err
		}
	}
	var errs []error
	if fi, err := os.Stat(s.reservePath()); err != nil || fi.Size() < ReserveBytes {
		if free < 2*ReserveBytes {
			errs = append(errs, fmt.Errorf("the store's reserve is missing and only %d MiB are free: delete sandboxes or nodes", free>>20))
		} else if err := fallocate(s.reservePath(), 0, ReserveBytes, false); err != nil {
			errs = append(errs, fmt.Errorf("make the store's reserve: %w", err))
		} else {
			free -= ReserveBytes
		}
	}
	if err := s.indexHeadroom(free); err != nil {
		errs = append(errs, err)
	}
	if len(errs) == 0 {
		s.reserveUsed.Store(false)
	}
	return errors.Join(errs...)
}

// indexHeadroom allocates IndexHeadroom bytes past index.db's end when they are not.
func (s *Store) indexHeadroom(free int64) error {
	p := filepath.Join(s.Root, "index.db")
	var st unix.Stat_t
	if err := unix.Stat(p, &st); err != nil {
		return err
	}
	allocated := st.Blocks * 512
	if allocated >= st.Size+IndexHeadroom {
		return nil
	}
	if free < 2*IndexHeadroom {
		return fmt.Errorf("index.db has %d MiB of headroom and only %d MiB are free: delete sandboxes or nodes", max(0, allocated-st.Size)>>20, free>>20)
	}
	return fallocate(p, st.Size, IndexHeadroom, true)
}

// ReleaseReserve deletes the reserve, freeing its room; false when there was none.
func (s *Store) ReleaseReserve() bool {
	return os.Remove(s.reservePath()) == nil
}

// releaseForIndex is the committer's OnNoSpace.
func (s *Store) releaseForIndex() bool {
	if !s.ReleaseReserve() {
		return false
	}
	s.reserveUsed.Store(true)
	return true
}

// Warning says, until TopUp has made the reserve again, that the store ran out of room
// (what the API adds to its answers); "" when all is well.
func (s *Store) Warning() string {
	if !s.reserveUsed.Load() {
		return ""
	}
	free, _ := s.FreeBytes()
	return fmt.Sprintf("the store ran out of space (%d MiB free now) and the index used its reserve: delete sandboxes, nodes or files; DeltaBox makes the reserve again when %d MiB are free", free>>20, 2*ReserveBytes>>20)
}

// Space is the store's free bytes (FreeBytes) and its used bytes (statfs, ~2 µs).
func (s *Store) Space() (free, used int64, err error) {
	var st unix.Statfs_t
	if err := unix.Statfs(s.Root, &st); err != nil {
		return 0, 0, err
	}
	return int64(st.Bavail) * st.Bsize, int64(st.Blocks-st.Bfree) * st.Bsize, nil
}

// FreeBytes is what an unprivileged writer may still allocate on the store.
func (s *Store) FreeBytes() (int64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(s.Root, &st); err != nil {
		return 0, err
	}
	return int64(st.Bavail) * st.Bsize, nil
}

// settledFreeBytes is FreeBytes once the blocks of deleted files are counted free.
//
// syncfs alone is not enough: since Linux 6.0 XFS's sync_fs only queues the
// inode-inactivation workers (xfs_inodegc_push) and does not wait for them, and CI
// saw a store 8 MiB free after syncfs when a 141 MiB file had just been deleted.
// XFS_IOC_FREE_EOFBLOCKS ends in xfs_blockgc_free_space, which waits for those
// workers (xfs_inodegc_flush); as a scan it also trims speculative preallocation past
// files' ends, as XFS itself does before it answers ENOSPC. Files with fallocated
// extents (index.db's headroom, the reserve) keep theirs.
func (s *Store) settledFreeBytes() (int64, error) {
	fd, err := unix.Open(s.Root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, err
	}
	defer unix.Close(fd)
	if err := unix.Syncfs(fd); err != nil {
		return 0, fmt.Errorf("syncfs %s: %w", s.Root, err)
	}
	if err := freeEOFBlocks(fd); err != nil {
		return 0, fmt.Errorf("XFS_IOC_FREE_EOFBLOCKS on %s: %w", s.Root, err)
	}
	return s.FreeBytes()
}

// xfsFsEOFBlocks is struct xfs_fs_eofblocks (linux/fs/xfs/libxfs/xfs_fs.h).
type xfsFsEOFBlocks struct {
	Version     uint32
	Flags       uint32
	UID         uint32
	GID         uint32
	Prid        uint32
	Limit       uint32
	MinFileSize uint64
	_           [12]uint64
}

const (
	xfsIocFreeEOFBlocks = 0x8080583a // _IOR('X', 58, struct xfs_fs_eofblocks)
	xfsEOFBlocksVersion = 1
	xfsEOFFlagsSync     = 1 << 0 // wait for each inode rather than skip a busy one
)

// freeEOFBlocks runs XFS's blockgc scan over the filesystem of fd and waits for the
// inode-inactivation workers, so that deleted files' blocks are free when it returns.
func freeEOFBlocks(fd int) error {
	arg := xfsFsEOFBlocks{Version: xfsEOFBlocksVersion, Flags: xfsEOFFlagsSync}
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), xfsIocFreeEOFBlocks, uintptr(unsafe.Pointer(&arg)))
	if errno != 0 {
		return errno
	}
	return nil
}

func fallocate(p string, off, n int64, keepSize bool) error {
	f, err := os.OpenFile(p, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return err
	}
	defer func() { _ = f.Close() }() // nothing written through it: fallocate's error is returned
	mode := uint32(0)
	if keepSize {
		mode = unix.FALLOC_FL_KEEP_SIZE
	}
	for {
		err = unix.Fallocate(int(f.Fd()), mode, off, n)
		if err != unix.EINTR {
			break
		}
	}
	if err != nil {
		return fmt.Errorf("fallocate %s: %w", p, err)
	}
	return nil
}
