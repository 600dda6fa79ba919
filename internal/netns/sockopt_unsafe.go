package netns

import (
	"unsafe"

	"golang.org/x/sys/unix"
)

func unsafePointer(p *uint16) unsafe.Pointer { return unsafe.Pointer(p) }

// getsockopt reads a struct sockaddr_in option (x/sys has no typed getter for it).
func getsockopt(fd, level, opt int, sa *unix.RawSockaddrInet4, size *uint32) error {
	_, _, e := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), uintptr(level), uintptr(opt),
		uintptr(unsafe.Pointer(sa)), uintptr(unsafe.Pointer(size)), 0)
	if e != 0 {
		return e
	}
	return nil
}
