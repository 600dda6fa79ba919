package fastpath

import (
	"fmt"

	"golang.org/x/sys/unix"

	"deltabox/internal/remote"
)

// Closed TCP sockets. A process that made requests through the daemon's network proxy
// (internal/netproxy) keeps its keep-alive connections' sockets; at a checkpoint the
// proxy resets the idle ones, which leaves each in TCP_CLOSE: no peer, no timer, nothing
// a fork would share that either side could still change, except by connect() again on
// the same socket. So the fast path takes such a socket, and each process that goes on
// live (the checkpoint's, a restore's child) gets a fresh unconnected socket of the same
// family at that fd instead: its next send fails (EPIPE) and poll reports POLLHUP, which
// HTTP clients (urllib3, httpx) read as a dropped connection and reconnect. The template
// keeps the dead one. Any other socket (connected, bound, listening, UDP, unix) still
// refuses. What the fresh socket lacks is the old one's options (TCP_NODELAY...): a
// client sets them again on the connection it makes next.

// closedTCP returns the address family of fd n of host process pid when it is a TCP
// socket in TCP_CLOSE, else 0. The process is stopped (inspect runs on held processes).
func closedTCP(pid, n int) int {
	pfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return 0
	}
	defer unix.Close(pfd)
	fd, err := unix.PidfdGetfd(pfd, n, 0)
	if err != nil {
		return 0
	}
	defer unix.Close(fd)
	dom, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_DOMAIN)
	if err != nil || (dom != unix.AF_INET && dom != unix.AF_INET6) {
		return 0
	}
	if typ, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_TYPE); err != nil || typ != unix.SOCK_STREAM {
		return 0
	}
	if proto, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_PROTOCOL); err != nil || proto != unix.IPPROTO_TCP {
		return 0
	}
	info, err := unix.GetsockoptTCPInfo(fd, unix.IPPROTO_TCP, unix.TCP_INFO)
	if err != nil || info.State != unix.BPF_TCP_CLOSE {
		return 0
	}
	if info.Segs_out > 0 {
		return dom // it was a connection, and it is over
	}
	// Never connected: only a socket bound to no port is like a fresh one. One bound by
	// the process (a server not listening yet) would lose its port: refused.
	sa, err := unix.Getsockname(fd)
	if err != nil {
		return 0
	}
	switch a := sa.(type) {
	case *unix.SockaddrInet4:
		if a.Port != 0 {
			return 0
		}
	case *unix.SockaddrInet6:
		if a.Port != 0 {
			return 0
		}
	default:
		return 0
	}
	return dom
}

// sockCalls appends the calls that put a fresh unconnected TCP socket at f's number,
// with f's O_NONBLOCK and close-on-exec.
func sockCalls(b *remote.Batch, f FD) {
	typ := unix.SOCK_STREAM
	if f.Flags&unix.O_NONBLOCK != 0 {
		typ |= unix.SOCK_NONBLOCK
	}
	nfd := b.Add(fmt.Sprintf("a fresh socket for fd %d (a closed connection)", f.Num), unix.SYS_SOCKET, f.Domain, typ, 0)
	b.Add(fmt.Sprintf("dup3 fd %d", f.Num), unix.SYS_DUP3, nfd, f.Num, f.Flags&unix.O_CLOEXEC)
	b.Close("close", nfd)
}
