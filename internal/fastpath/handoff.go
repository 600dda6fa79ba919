package fastpath

import (
	"encoding/binary"
	"fmt"

	"golang.org/x/sys/unix"

	"deltabox/internal/remote"
)

// handFD gives the tracee t a duplicate of fd, one of the daemon's (a state's mount
// namespace), and returns its number in t (close-on-exec); the caller's batch closes it.
//
// No process of the sandbox holds a namespace fd for the fast path to open: one that
// did (init, as /proc/1/fd/N) would have to be reachable by ptrace-access rules from
// every process it serves, and so from the sandbox's own code, which could then enter a
// prepared or warm state, or a template's view, and change it. Instead the fd is handed
// over for the move alone, with the sandbox's code stopped: a socketpair made in the
// tracee by injection, one end taken by the daemon (pidfd_getfd), one SCM_RIGHTS
// message, received by injection, both ends closed. Five injected calls: about 30-50 us
// per process moved (bench latency).
//
// Precondition: on t's tracer thread (inside Do).
func handFD(t *remote.Tracee, fd int) (int, error) {
	sv, err := t.Scratch(make([]byte, 8))
	if err != nil {
		return -1, err
	}
	if _, err := t.Syscall(unix.SYS_SOCKETPAIR, unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0, sv); err != nil {
		return -1, fmt.Errorf("socketpair to hand a namespace over: %w", err)
	}
	b, err := t.ReadMem(sv, 8)
	if err != nil {
		return -1, err
	}
	rx, tx := int(int32(binary.LittleEndian.Uint32(b))), int(int32(binary.LittleEndian.Uint32(b[4:])))
	closeBoth := func() {
		t.Close(rx)
		t.Close(tx)
	}
	if err := sendFD(t.Pid(), tx, fd); err != nil {
		closeBoth()
		return -1, err
	}
	// recvmsg's message header, its control buffer and one byte of data, in scratch
	// memory (their addresses known only once placed).
	cmsgLen := unix.CmsgSpace(4)
	ctl, err := t.Scratch(make([]byte, cmsgLen))
	if err != nil {
		closeBoth()
		return -1, err
	}
	data, err := t.Scratch(make([]byte, 8))
	if err != nil {
		closeBoth()
		return -1, err
	}
	// struct iovec {base, len} and struct msghdr {name, namelen, iov, iovlen, control,
	// controllen, flags} as x86-64 lays them out (unix.Msghdr's layout, written by hand:
	// the pointers are the tracee's).
	le := binary.LittleEndian
	iov := le.AppendUint64(le.AppendUint64(nil, uint64(data)), 1)
	iovAddr, err := t.Scratch(iov)
	if err != nil {
		closeBoth()
		return -1, err
	}
	msg := make([]byte, unix.SizeofMsghdr)
	le.PutUint64(msg[16:], uint64(iovAddr))
	le.PutUint64(msg[24:], 1)
	le.PutUint64(msg[32:], uint64(ctl))
	le.PutUint64(msg[40:], uint64(cmsgLen))
	msgAddr, err := t.Scratch(msg)
	if err != nil {
		closeBoth()
		return -1, err
	}
	_, err = t.Syscall(unix.SYS_RECVMSG, uintptr(rx), msgAddr, unix.MSG_CMSG_CLOEXEC|unix.MSG_DONTWAIT)
	closeBoth()
	if err != nil {
		return -1, fmt.Errorf("receive the namespace: %w", err)
	}
	c, err := t.ReadMem(ctl, cmsgLen)
	if err != nil {
		return -1, err
	}
	msgs, err := unix.ParseSocketControlMessage(c)
	if err != nil || len(msgs) != 1 {
		return -1, fmt.Errorf("receive the namespace: no fd came (%v)", err)
	}
	fds, err := unix.ParseUnixRights(&msgs[0])
	if err != nil || len(fds) != 1 {
		return -1, fmt.Errorf("receive the namespace: %d fds came (%v)", len(fds), err)
	}
	return fds[0], nil
}

// sendFD sends fd over the socket tx of process pid (a host PID), taken with
// pidfd_getfd.
func sendFD(pid, tx, fd int) error {
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
	if err := unix.Sendmsg(s, []byte{0}, unix.UnixRights(fd), nil, 0); err != nil {
		return fmt.Errorf("send the namespace to the tracee: %w", err)
	}
	return nil
}
