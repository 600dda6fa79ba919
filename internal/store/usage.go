package store

import (
	"errors"
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Usage is what the inodes of one XFS project hold.
type Usage struct {
	Bytes  int64 // allocated: blocks, delayed allocations included, times the block size
	Inodes int64
}

// xfsBulkIreq is struct xfs_bulk_ireq of <xfs/xfs_fs.h>, the header of a bulkstat request.
type xfsBulkIreq struct {
	Ino      uint64
	Flags    uint32
	Icount   uint32
	Ocount   uint32
	Agno     uint32
	Reserved [5]uint64
}

// xfsBulkstat is struct xfs_bulkstat (192 bytes), one inode of the answer.
type xfsBulkstat struct {
	Ino        uint64
	Size       uint64
	Blocks     uint64
	Xflags     uint64
	Atime      int64
	Mtime      int64
	Ctime      int64
	Btime      int64
	Gen        uint32
	Uid        uint32
	Gid        uint32
	Projectid  uint32
	AtimeNsec  uint32
	MtimeNsec  uint32
	CtimeNsec  uint32
	BtimeNsec  uint32
	Blksize    uint32
	Rdev       uint32
	Cowextsize uint32
	Extsize    uint32
	Nlink      uint32
	Extents    uint32
	Aextents   uint32
	Version    uint16
	Forkoff    uint16
	Sick       uint16
	Checked    uint16
	Mode       uint16
	Pad2       uint16
	Extents64  uint64
	Pad        [6]uint64
}

const (
	xfsIocBulkstat = 0x8040587f // _IOR('X', 127, struct xfs_bulkstat_req)
	bulkBatch      = 4096       // inodes per ioctl: 768 KiB of answers
)

// ErrNoBulkstat: the store is not XFS (btrfs): usage is measured by a walk instead.
var ErrNoBulkstat = errors.New("XFS_IOC_BULKSTAT not supported")

// ProjectUsage reads every inode of the store's filesystem with XFS_IOC_BULKSTAT and
// sums blocks and inodes per project id (project.go). Other stores on the filesystem
// have ids of other ranges (projrange.go), so an upper's id sums its inodes alone. One
// pass serves every sandbox. It counts what a walk of an upper cannot
// see: files unlinked but still open, and overlayfs's copy-ups in progress in work/.
// Blocks shared by reflink (a copy-up) count in full in each inode, as an XFS project
// quota charges them, and so does XFS's speculative preallocation past the end of a
// file being appended to (delayed blocks, up to as much again as the file's size: 32
// MiB appended 1 MiB at a time held 64 MiB; TestProjectUsagePrealloc), which a quota
// charges too and which XFS trims once the file is closed or, for files written in
// repeated open-append-close steps, by its background scan
// (fs.xfs.speculative_prealloc_lifetime, 300 s). It cannot be told apart here: bs_size
// is the on-disk size, which lags writeback (measured 27 of 32 MiB a moment after the
// writes), so capping blocks by it would undercount a fast writer. Cost: about 1 µs per
// inode of the filesystem (measured: docs/API.md, Disk; TestBulkstatCost), images and
// other stores on it included: bulkstat cannot be limited to a directory. Needs
// CAP_SYS_ADMIN.
func (s *Store) ProjectUsage() (map[uint32]Usage, error) {
	out := map[uint32]Usage{}
	err := s.bulkstat(func(b *xfsBulkstat) {
		if b.Projectid == 0 {
			return
		}
		u := out[b.Projectid]
		u.Bytes += int64(b.Blocks) * int64(b.Blksize)
		u.Inodes++
		out[b.Projectid] = u
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// bulkstat calls fn with every inode of the store's filesystem.
func (s *Store) bulkstat(fn func(*xfsBulkstat)) error {
	fd, err := openDir(s.Root)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	hdr := int(unsafe.Sizeof(xfsBulkIreq{}))
	one := int(unsafe.Sizeof(xfsBulkstat{}))
	buf := make([]byte, hdr+bulkBatch*one)
	req := (*xfsBulkIreq)(unsafe.Pointer(&buf[0]))
	for {
		req.Icount, req.Ocount, req.Flags = bulkBatch, 0, 0
		_, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), xfsIocBulkstat, uintptr(unsafe.Pointer(&buf[0])))
		if e == unix.EINTR {
			continue
		}
		if e == unix.ENOTTY || e == unix.EOPNOTSUPP || e == unix.EINVAL {
			return fmt.Errorf("%s: %w", s.Root, ErrNoBulkstat)
		}
		if e != 0 {
			return fmt.Errorf("bulkstat %s: %w", s.Root, e)
		}
		if req.Ocount == 0 {
			return nil
		}
		for i := range int(req.Ocount) {
			fn((*xfsBulkstat)(unsafe.Pointer(&buf[hdr+i*one])))
		}
		// The kernel moved req.Ino past the last inode it returned.
	}
}

// xfsIocFsGeometry is XFS_IOC_FSGEOMETRY: _IOR('X', 126, struct xfs_fsop_geom), 256 bytes,
// whose seventh 32-bit field is the inode size.
const xfsIocFsGeometry = 0x8100587e

// InodeBytes is the on-disk size of one of the store's inodes (xfs_fsop_geom.inodesize:
// 512 on a store made by mkfs.xfs's defaults), which an inode holds in the store whatever
// its blocks. An empty file's blocks are 0, so ProjectUsage's bytes alone let 300,000
// empty files count 13.8 MB (their directories' blocks) where the store lost 160 MB.
// 0 when the store is not XFS.
func (s *Store) InodeBytes() int64 {
	fd, err := openDir(s.Root)
	if err != nil {
		return 0
	}
	defer unix.Close(fd)
	var geom [64]uint32
	for range projectIoctlAttempt {
		_, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), xfsIocFsGeometry, uintptr(unsafe.Pointer(&geom[0])))
		if e == unix.EINTR {
			continue
		}
		if e != 0 {
			return 0
		}
		return int64(geom[6])
	}
	return 0
}
