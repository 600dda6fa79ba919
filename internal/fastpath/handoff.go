package fastpath

import (
	"encoding/binary"
	"fmt"

	"golang.org/x/sys/unix"

	"deltabox/internal/remote"
)

// A namespace handed over to a tracee (handFD).
//
// No process of the sandbox holds a namespace fd for the fast path to open: one that
// did (init, as /proc/1/fd/N) would have to be reachable by ptrace-access rules from
// every process it serves, and so from the sandbox's own code, which could then enter a
// prepared or warm state, or a template's view, and change it. Instead the fd is handed
// over for the move alone, while the sandbox's code is stopped: a socketpair made in
// the tracee by injection, one end taken by the daemon (pidfd_getfd), one SCM_RIGHTS
// message, received by the first calls of the move's own batch (recvCalls), both ends
// closed there. Measured here: handFD 88 us (mostly the injected socketpair, 35 us,
// and the daemon's pidfd_getfd and sendmsg) and ~27 us for the three calls in the
// batch: about 115 us more per process moved than an open of init's copy (one call),
// 1-2% of a 64 MB python session's checkpoint (bench-results/isolation).
type handed struct {
	rx, tx int     // the socketpair's ends in the tracee
	msg    uintptr // recvmsg's struct msghdr, in the tracee's scratch memory
}

// handFD gives the tracee t a duplicate of fd, one of the daemon's (a state's mount
// namespace): it is queued on the tracee's socket, and the calls that recvCalls adds
// to a batch receive it as fd h.tx. Precondition: on t's tracer thread (inside Do),
// and nothing else opens or closes fds in t before that batch (recvCalls says why).
func handFD(t *remote.Tracee, fd int) (*handed, error) {
	return handFDs(t, []int{fd})
}

// handFDs is handFD for several fds on one socket, one message each, in order: after
// recvCalls' first, each further recvNext receives the next one, again as fd h.tx (the
// lowest free number once the previous one was closed: every lower number is in use).
// One injected socketpair and one batch for all of a placed copy's namespaces, where one
// hand-over each took 8 injected round trips more per copy (fork.md).
func handFDs(t *remote.Tracee, fds []int) (*handed, error) {
	// One scratch area: the socketpair's two ints, then recvmsg's control buffer, one
	// byte of data, a struct iovec {base, len} and a struct msghdr {name, namelen, iov,
	// iovlen, control, controllen, flags} as x86-64 lays them out (unix.Msghdr's layout,
	// written by hand: the pointers are the tracee's, known once the area is placed).
	const svOff, ctlOff, dataOff, iovOff, msgOff = 0, 8, 32, 40, 56
	ctlLen := unix.CmsgSpace(4) // 24
	area, err := t.Scratch(make([]byte, msgOff+unix.SizeofMsghdr))
	if err != nil {
		return nil, err
	}
	le := binary.LittleEndian
	tail := make([]byte, msgOff-iovOff+unix.SizeofMsghdr)
	le.PutUint64(tail[0:], uint64(area+dataOff))
	le.PutUint64(tail[8:], 1)
	msg := tail[msgOff-iovOff:]
	le.PutUint64(msg[16:], uint64(area+iovOff))
	le.PutUint64(msg[24:], 1)
	le.PutUint64(msg[32:], uint64(area+ctlOff))
	le.PutUint64(msg[40:], uint64(ctlLen))
	if err := t.WriteScratch(area+iovOff, tail); err != nil {
		return nil, err
	}
	if _, err := t.Syscall(unix.SYS_SOCKETPAIR, unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0, area+svOff); err != nil {
		return nil, fmt.Errorf("socketpair to hand a namespace over: %w", err)
	}
	b, err := t.ReadMem(area+svOff, 8)
	if err != nil {
		return nil, err
	}
	h := &handed{rx: int(int32(le.Uint32(b))), tx: int(int32(le.Uint32(b[4:]))), msg: area + msgOff}
	if err := sendFDs(t.Pid(), h.tx, fds); err != nil {
		h.cleanup(t)
		return nil, err
	}
	return h, nil
}

// recvCalls appends to b the calls that receive the namespace as fd h.tx: close(tx),
// then recvmsg on rx, which installs the fd at the lowest free number, tx (socketpair
// took the two lowest free numbers, rx < tx, and nothing between opened or closed any),
// then close(rx). The caller's calls after these use h.tx and close it.
func (h *handed) recvCalls(b *remote.Batch) {
	b.Add("close the hand-over socket's sending end", unix.SYS_CLOSE, h.tx)
	b.Add("receive the new state's namespace", unix.SYS_RECVMSG, h.rx, h.msg, unix.MSG_CMSG_CLOEXEC|unix.MSG_DONTWAIT)
	b.Add("close the hand-over socket", unix.SYS_CLOSE, h.rx)
}

// openCalls appends the first of recvCalls' calls alone: close(tx). Each recvNext then
// receives the next fd as h.tx (the caller's calls use and close it before the next),
// and closeRx ends the hand-over.
func (h *handed) openCalls(b *remote.Batch) {
	b.Add("close the hand-over socket's sending end", unix.SYS_CLOSE, h.tx)
}

// recvNext appends the call that receives the next fd handed over, as h.tx.
func (h *handed) recvNext(b *remote.Batch, what string) {
	b.Add("receive "+what, unix.SYS_RECVMSG, h.rx, h.msg, unix.MSG_CMSG_CLOEXEC|unix.MSG_DONTWAIT)
}

// closeRx appends the close of the hand-over socket.
func (h *handed) closeRx(b *remote.Batch) {
	b.Add("close the hand-over socket", unix.SYS_CLOSE, h.rx)
}

// cleanup closes what is left of the hand-over in t after a batch with recvCalls
// failed (or before it ran): the sockets, or the received fd at tx. Either number is
// free or ours: the process's own fds existed before the socketpair, and a failed
// batch closes its temporary ones itself.
func (h *handed) cleanup(t *remote.Tracee) {
	_ = t.Close(h.rx) // a failed injected close kills the tracee (remote)
	_ = t.Close(h.tx)
}

// sendFDs sends each of fds, one message each, over the socket tx of process pid (a
// host PID), taken with pidfd_getfd.
func sendFDs(pid, tx int, fds []int) error {
	pfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return fmt.Errorf("pidfd of %d: %w", pid, err)
	}
	defer unix.Close(pfd)
	s, err := unix.PidfdGetfd(pfd, tx, 0)
	if err != nil {
		return fmt.Errorf("take the tracee's socket: %w", err)
	}
	defer unix.Close(s)
	for _, fd := range fds {
		if err := unix.Sendmsg(s, []byte{0}, unix.UnixRights(fd), nil, 0); err != nil {
			return fmt.Errorf("send the namespace to the tracee: %w", err)
		}
	}
	return nil
}
