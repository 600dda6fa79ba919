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
	msg, err := d.lookup(local, remote)
	if msg == nil || err != nil {
		return 0, false, err
	}
	const tcpCloseWait = 8 // include/net/tcp_states.h
	return binary.NativeEndian.Uint32(msg[56:]), msg[1] == tcpCloseWait, nil
}

// Open reports whether the namespace's TCP socket from local to remote is still open
// (hashed: not yet in TCP_CLOSE, which a reset puts it in at once). The caller
// serializes calls.
func (d *Diag) Open(local, remote netip.AddrPort) (bool, error) {
	msg, err := d.lookup(local, remote)
	return msg != nil, err
}

// DestroyOrphan destroys (SOCK_DESTROY, as `ss -K`) the namespace's TCP socket from
// local to remote when no process holds it: an orphan (TIME_WAIT, FIN_WAIT2, LAST_ACK
// after its process closed it, or was killed). It says whether it destroyed one; a
// socket that a process holds is left, and reported by CRIU when the restore finds its
// address taken.
//
// Why: a restore ends the sandbox's processes, and their connections close (FIN) into
// those states for up to a minute; the kernel lets a repaired socket (CRIU's restore of
// a connection) take a TIME_WAIT socket's address only a second after that socket's
// last timestamp (tcp_twsk_unique), so a restore right after the end of a connection
// with the same address and ports failed (CRIU: "Can't connect inet socket back").
func (d *Diag) DestroyOrphan(local, remote netip.AddrPort) (bool, error) {
	msg, err := d.lookup(local, remote)
	if msg == nil || err != nil {
		return false, err
	}
	if inode := binary.NativeEndian.Uint32(msg[68:]); inode != 0 {
		return false, nil
	}
	// The socket as found, by its cookie: not another that took its place since.
	var cookie [8]byte
	copy(cookie[:], msg[44:52])
	if _, err := d.request(unix.SOCK_DESTROY, local, remote, cookie); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return false, nil
		}
		return false, err
	}
	return true, nil
}

// nocookie is INET_DIAG_NOCOOKIE twice: any socket of the address.
var nocookie = [8]byte{255, 255, 255, 255, 255, 255, 255, 255}

// lookup finds the namespace's TCP socket from local to remote by an exact lookup (no
// dump) and returns its inet_diag_msg, or nil if there is none. A socket that is gone,
// or closed (unhashed), is not found.
func (d *Diag) lookup(local, remote netip.AddrPort) ([]byte, error) {
	r, err := d.request(unix.SOCK_DIAG_BY_FAMILY, local, remote, nocookie)
	if errors.Is(err, unix.ENOENT) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	// inet_diag_msg: family, state, timer, retrans, id (48: sport, dport, src[16],
	// dst[16], if, cookie[8]), expires, rqueue, wqueue, uid, inode.
	if len(r) < 72 {
		return nil, errors.New("sock_diag: short message")
	}
	return r, nil
}

// request sends one sock_diag request of type typ (SOCK_DIAG_BY_FAMILY, SOCK_DESTROY)
// for the TCP socket from local to remote (as that socket names them: its own address
// first) and returns the answer's payload (after nlmsghdr); an error answer is the
// errno (ENOENT: no such socket). The caller serializes calls.
func (d *Diag) request(typ uint16, local, remote netip.AddrPort, cookie [8]byte) ([]byte, error) {
	if local.Addr().Is4() != remote.Addr().Is4() {
		return nil, fmt.Errorf("sock_diag: %s and %s are not of one family", local, remote)
	}
	// nlmsghdr (16 bytes), then inet_diag_req_v2 (56): family, protocol, ext, pad,
	// states, and the socket's id: sport, dport (big-endian), src[4], dst[4] (32-bit
	// words, network order), interface, cookie.
	const reqLen = 16 + 56
	b := make([]byte, reqLen)
	ne := binary.NativeEndian
	ne.PutUint32(b[0:], reqLen)
	ne.PutUint16(b[4:], typ)
	flags := uint16(unix.NLM_F_REQUEST)
	if typ == unix.SOCK_DESTROY {
		flags |= unix.NLM_F_ACK
	}
	ne.PutUint16(b[6:], flags)
	b[16], b[17] = unix.AF_INET, unix.IPPROTO_TCP
	if !local.Addr().Is4() {
		b[16] = unix.AF_INET6
	}
	ne.PutUint32(b[20:], ^uint32(0)) // every state
	binary.BigEndian.PutUint16(b[24:], local.Port())
	binary.BigEndian.PutUint16(b[26:], remote.Port())
	la, ra := local.Addr().AsSlice(), remote.Addr().AsSlice()
	copy(b[28:], la)
	copy(b[44:], ra)
	copy(b[64:], cookie[:])
	if err := unix.Sendto(d.fd, b, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return nil, fmt.Errorf("sock_diag request: %w", err)
	}
	r := make([]byte, 4096)
	got, _, err := unix.Recvfrom(d.fd, r, 0)
	if err != nil {
		return nil, fmt.Errorf("sock_diag answer: %w", err)
	}
	r = r[:got]
	if len(r) < 16 {
		return nil, errors.New("sock_diag: short answer")
	}
	switch ne.Uint16(r[4:]) {
	case unix.NLMSG_ERROR:
		if len(r) < 20 {
			return nil, errors.New("sock_diag: short error")
		}
		if e := unix.Errno(-int32(ne.Uint32(r[16:]))); e != 0 {
			return nil, fmt.Errorf("sock_diag: %w", e)
		}
		return nil, nil // the ACK of a request that succeeded
	case unix.SOCK_DIAG_BY_FAMILY:
		return r[16:], nil
	}
	return nil, fmt.Errorf("sock_diag: answer of type %d", ne.Uint16(r[4:]))
}
