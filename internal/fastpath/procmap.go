package fastpath

import (
	"errors"
	"os"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Reading /proc/PID/maps formats every mapping of the process: 180 us for a python
// holding 50 MB on these VMs, on a checkpoint's critical path, to find the one or two
// shared mappings a checkpoint cares about. The PROCMAP_QUERY ioctl on the maps file
// (Linux 6.11) returns the next mapping matching given flags, so a walk asking for
// shared mappings only visits those. Older kernels answer ENOTTY and the text is read.

// procmapQuery is struct procmap_query of include/uapi/linux/fs.h (not in x/sys/unix).
type procmapQuery struct {
	Size        uint64
	QueryFlags  uint64
	QueryAddr   uint64
	VmaStart    uint64
	VmaEnd      uint64
	VmaFlags    uint64
	VmaPageSize uint64
	VmaOffset   uint64
	Inode       uint64
	DevMajor    uint32
	DevMinor    uint32
	VmaNameSize uint32
	BuildIDSize uint32
	VmaNameAddr uint64
	BuildIDAddr uint64
}

const (
	procmapQueryIoctl = 0xc0686611 // _IOWR('f', 17, struct procmap_query): 104 bytes

	procmapReadable       = 0x01
	procmapWritable       = 0x02
	procmapExecutable     = 0x04
	procmapShared         = 0x08
	procmapCoveringOrNext = 0x10
)

// sharedMapsLines returns the shared mappings (VM_MAYSHARE: "s" in maps) of process
// base (/proc/PID) as maps lines, with PROCMAP_QUERY where the kernel has it.
func sharedMapsLines(base string) ([]mapsLine, error) {
	fd, err := unix.Open(base+"/maps", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: base + "/maps", Err: err}
	}
	defer unix.Close(fd)
	out, err := queryShared(fd)
	if !errors.Is(err, unix.ENOTTY) && !errors.Is(err, unix.EINVAL) {
		return out, err
	}
	b, err := os.ReadFile(base + "/maps")
	if err != nil {
		return nil, err
	}
	out = nil
	for _, m := range parseMaps(b) {
		m.tooLong = len(m.path) >= unix.PathMax
		if m.perms[3] == 's' {
			out = append(out, m)
		}
	}
	return out, nil
}

// queryShared walks the shared mappings of the maps file fd with PROCMAP_QUERY. (name is
// written by the kernel during the ioctl; a goroutine's stack does not move while it is
// in a syscall.)
func queryShared(fd int) ([]mapsLine, error) {
	var out []mapsLine
	name := make([]byte, unix.PathMax+64)
	var addr uint64
	for {
		q := procmapQuery{
			Size:        uint64(unsafe.Sizeof(procmapQuery{})),
			QueryFlags:  procmapCoveringOrNext | procmapShared,
			QueryAddr:   addr,
			VmaNameSize: uint32(len(name)),
			VmaNameAddr: uint64(uintptr(unsafe.Pointer(&name[0]))),
		}
		_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), procmapQueryIoctl, uintptr(unsafe.Pointer(&q)))
		tooLong := errno == unix.ENAMETOOLONG
		if tooLong {
			// The name is over PATH_MAX (the text of maps would show it, but no open
			// could use it): the same query without the name, for the range.
			q.VmaNameSize, q.VmaNameAddr = 0, 0
			_, _, errno = unix.Syscall(unix.SYS_IOCTL, uintptr(fd), procmapQueryIoctl, uintptr(unsafe.Pointer(&q)))
		}
		if errno == unix.ENOENT {
			return out, nil // no mapping at or after addr
		}
		if errno != 0 {
			return nil, errno
		}
		perms := []byte("---s")
		if q.VmaFlags&procmapReadable != 0 {
			perms[0] = 'r'
		}
		if q.VmaFlags&procmapWritable != 0 {
			perms[1] = 'w'
		}
		if q.VmaFlags&procmapExecutable != 0 {
			perms[2] = 'x'
		}
		m := mapsLine{start: q.VmaStart, end: q.VmaEnd, perms: string(perms), offset: int64(q.VmaOffset), tooLong: tooLong}
		if q.VmaNameSize > 0 && !tooLong {
			m.path = string(name[:q.VmaNameSize-1]) // the size counts the NUL
		}
		out = append(out, m)
		addr = q.VmaEnd
	}
}

// The ioctl number encodes the struct's size: a wrong layout is ENOTTY, not a misread.
var _ [104]byte = [unsafe.Sizeof(procmapQuery{})]byte{}
