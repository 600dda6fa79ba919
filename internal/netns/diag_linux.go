package netns

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"

	"golang.org/x/sys/unix"
)

// Diag is a sock_diag netlink socket in a sandbox's network namespace: it reads what
// the sandbox's own TCP sockets hold, which the proxy's end of a connection cannot see.
// The case it is for: an answer the proxy has relayed whole sits in the receive queue
// of the sandbox's socket until the process reads it. A checkpoint that took the
// connection for idle then reset it, and the fast path gave the process a fresh socket
// at that fd (internal/fastpath/deadsock.go): the unread answer was lost, and the
// client's next recv failed with ENOTCONN (TestNetCheckpointWaitsForRequests, 1 run in
// 5 at load 12-15).
type Diag struct{ fd int }

// NewDiag opens a sock_diag socket in the namespace nsFD.
func NewDiag(nsFD int) (*Diag, error) {
	var fd int
	err := In(nsFD, func() (err error) {
		fd, err = unix.Socket(unix.AF_NETLINK, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, unix.NETLINK_SOCK_DIAG)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("sock_diag socket: %w", err)
	}
	return &Diag{fd: fd}, nil
}

// Close closes the socket.
func (d *Diag) Close() { _ = unix.Close(d.fd) } // a netlink socket: nothing to flush

// Unread returns the bytes the namespace's TCP socket from local to remote (as that
// socket names them: its own address first) has received and its process not read
// (inet_diag_msg's idiag_rqueue), and whether the peer's FIN came and the socket is
// still open (TCP_CLOSE_WAIT: its process has not yet read the end of the stream, or
// read it and not closed yet), by an exact lookup (no dump). A socket that is gone, or
// closed (unhashed), is not found: 0, false, nil. The caller serializes calls.
func (d *Diag) Unread(local, remote netip.AddrPort) (n uint32, peerClosed bool, err error) {
	if !local.Addr().Is4() || !remote.Addr().Is4() {
		return 0, false, errors.New("sock_diag: IPv4 only (the only family the proxy redirects)")
	}
	// nlmsghdr (16 bytes), then inet_diag_req_v2 (56): family, protocol, ext, pad,
	// states, and the socket's id: sport, dport (big-endian), src[4], dst[4] (32-bit
	// words, network order), interface, cookie (INET_DIAG_NOCOOKIE: any).
	const reqLen = 16 + 56
	b := make([]byte, reqLen)
	ne := binary.NativeEndian
	ne.PutUint32(b[0:], reqLen)
	ne.PutUint16(b[4:], unix.SOCK_DIAG_BY_FAMILY)
	ne.PutUint16(b[6:], unix.NLM_F_REQUEST)
	b[16], b[17] = unix.AF_INET, unix.IPPROTO_TCP
	ne.PutUint32(b[20:], ^uint32(0)) // every state
	binary.BigEndian.PutUint16(b[24:], local.Port())
	binary.BigEndian.PutUint16(b[26:], remote.Port())
	la, ra := local.Addr().As4(), remote.Addr().As4()
	copy(b[28:], la[:])
	copy(b[44:], ra[:])
	ne.PutUint32(b[64:], ^uint32(0))
	ne.PutUint32(b[68:], ^uint32(0))
	if err := unix.Sendto(d.fd, b, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return 0, false, fmt.Errorf("sock_diag request: %w", err)
	}
	r := make([]byte, 4096)
	got, _, err := unix.Recvfrom(d.fd, r, 0)
	if err != nil {
		return 0, false, fmt.Errorf("sock_diag answer: %w", err)
	}
	r = r[:got]
	if len(r) < 16 {
		return 0, false, errors.New("sock_diag: short answer")
	}
	switch ne.Uint16(r[4:]) {
	case unix.NLMSG_ERROR:
		if len(r) < 20 {
			return 0, false, errors.New("sock_diag: short error")
		}
		if e := unix.Errno(-int32(ne.Uint32(r[16:]))); e != unix.ENOENT && e != 0 {
			return 0, false, fmt.Errorf("sock_diag: %w", e)
		}
		return 0, false, nil
	case unix.SOCK_DIAG_BY_FAMILY:
		// inet_diag_msg: family, state, timer, retrans, id (48), expires, rqueue...
		if len(r) < 16+60 {
			return 0, false, errors.New("sock_diag: short message")
		}
		const tcpCloseWait = 8 // include/net/tcp_states.h
		return ne.Uint32(r[16+56:]), r[16+1] == tcpCloseWait, nil
	}
	return 0, false, fmt.Errorf("sock_diag: answer of type %d", ne.Uint16(r[4:]))
}
