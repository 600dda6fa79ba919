package durable

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"strconv"
	"strings"

	tcpstream "github.com/checkpoint-restore/go-criu/v7/crit/images/tcp-stream"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"deltabox/internal/netns"
)

// TCP connections through CRIU (--tcp-established), for a checkpoint's trees.
//
// CRIU reads a connection's state, sequence numbers, options and both queues in repair
// mode (TCP_REPAIR, which needs CAP_NET_ADMIN over the socket's network namespace: the
// sandbox's, owned by its user namespace, whose owner the daemon or its unprivileged
// CRIU is), and its restore makes the socket again in repair mode with the same
// addresses, ports and sequence numbers, so that the peer sees nothing but a pause. What
// DeltaBox adds around it, measured on this kernel (6.18):
//
//   - A dump that leaves its tree stopped (a checkpoint's) leaves every connection it
//     read in repair mode (CRIU turns repair off only on a failed dump or one that
//     leaves the tree running). The checkpoint then ends the tree, and a socket closed in
//     repair mode goes without a FIN or RST, as CRIU's own dump-and-kill does, and comes
//     back from the image. A tree that runs on without that (the checkpoint failed
//     before, or kept the sandbox's state) gets repair mode turned off by RepairOff,
//     which would otherwise break its sockets (recv: EPERM).
//   - Between the dump and the restore, segments to a socket in repair mode are taken in
//     and acknowledged, then lost with the socket: the dump has CRIU lock each connection
//     in the sandbox's namespace (netns/lock_linux.go), which the caller removes just
//     before the tree runs again (netns.Unlock); a restore of trees with connections is
//     locked by the caller (netns.Lock), as CRIU's restore runs in the host's namespace.
//   - A restore that follows the end of the same connection (a rollback ends the
//     sandbox's processes, whose connections close normally) finds its address held by
//     the closed end, in TIME_WAIT for a minute; the kernel gives a repaired socket that
//     address only a second after the closed end's last timestamp. Restore destroys such
//     orphans of the image's connections first (netns.Diag.DestroyOrphan).
//
// A connection to the daemon (the network proxy's, reset at every checkpoint, or a
// forwarded port's) comes back as the process left it; the daemon's end may be gone by
// a later restore, and the process then gets a reset at its next send
// (docs/design/criu-files.md).

// Conn is a TCP connection of an image: a socket with a peer, in any state but
// listening.
type Conn struct {
	Ino           uint32 // the socket's inode at the dump (sockfs)
	Local, Remote netip.AddrPort
	State         string // as the kernel names it: ESTABLISHED, CLOSE_WAIT...
}

// imageConns reads the TCP connections of the image in dir (files.img).
func imageConns(dir string) ([]Conn, error) {
	files, err := imageFiles(dir)
	if err != nil {
		return nil, err
	}
	var out []Conn
	for _, f := range files {
		i := f.GetIsk()
		if i == nil || i.GetProto() != unix.IPPROTO_TCP || i.GetDstPort() == 0 || i.GetState() == tcpListen {
			continue
		}
		local, err1 := imageAddrPort(i.GetSrcAddr(), i.GetSrcPort())
		remote, err2 := imageAddrPort(i.GetDstAddr(), i.GetDstPort())
		if err := errors.Join(err1, err2); err != nil {
			return nil, fmt.Errorf("%s: TCP socket %d: %w", dir, i.GetIno(), err)
		}
		out = append(out, Conn{Ino: i.GetIno(), Local: local, Remote: remote, State: tcpState(i.GetState())})
	}
	return out, nil
}

// imageAddrPort is an address of the image (32-bit words in network order, 1 or 4 of
// them) with its port. An IPv4-mapped IPv6 address stays IPv6: a dual-stack socket's
// addresses are so in the kernel's tables.
func imageAddrPort(a []uint32, port uint32) (netip.AddrPort, error) {
	var b []byte
	for _, w := range a {
		b = append(b, byte(w), byte(w>>8), byte(w>>16), byte(w>>24))
	}
	ip, ok := netip.AddrFromSlice(b)
	if !ok || port > 0xffff {
		return netip.AddrPort{}, fmt.Errorf("address %x port %d", b, port)
	}
	return netip.AddrPortFrom(ip, uint16(port)), nil
}

// RepairOff turns repair mode off on every TCP socket of tree (host PIDs) that is in it,
// as CRIU does when a tree runs on after its dump (CRIU also puts back the socket's
// SO_REUSEADDR, which turning repair off clears; this does not: on a connected socket
// it no longer matters, a bound one is not in repair): a checkpoint's tree that runs on
// without being ended and restored, or whose dump failed after CRIU took its sockets
// (DeltaBox's checks, or CRIU killed at its deadline). It takes each socket by
// pidfd_getfd (the daemon has CAP_NET_ADMIN over the sandbox's namespace) and reads
// TCP_REPAIR first: only CRIU sets it (the sandbox's processes lack CAP_NET_ADMIN), and
// turning it off sends a window probe. A socket is found from its fd's link (readlink:
// nothing in the sandbox is opened or followed).
func RepairOff(tree []int) error {
	var errs []error
	done := map[string]bool{}
	for _, p := range tree {
		dir := fmt.Sprintf("/proc/%d/fd", p)
		ents, err := os.ReadDir(dir)
		if err != nil {
			continue // ended (a tree that was killed meanwhile has nothing to repair)
		}
		for _, e := range ents {
			n, err := strconv.Atoi(e.Name())
			if err != nil {
				continue
			}
			l, err := os.Readlink(dir + "/" + e.Name())
			if err != nil || !strings.HasPrefix(l, "socket:[") || done[l] {
				continue
			}
			done[l] = true
			if err := repairOff(p, n); err != nil {
				errs = append(errs, fmt.Errorf("process %d fd %d (%s): turn TCP repair mode off: %w", sandboxPid(p), n, l, err))
			}
		}
	}
	return errors.Join(errs...)
}

// repairOff turns repair mode off on fd n of process pid if it is a TCP socket in it.
func repairOff(pid, n int) error {
	pfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return nil // ended
	}
	defer unix.Close(pfd)
	fd, err := unix.PidfdGetfd(pfd, n, 0)
	if err != nil {
		return nil // closed since, or ended
	}
	defer unix.Close(fd)
	if proto, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_PROTOCOL); err != nil || proto != unix.IPPROTO_TCP {
		return nil
	}
	if on, err := unix.GetsockoptInt(fd, unix.SOL_TCP, unix.TCP_REPAIR); err != nil || on == 0 {
		return err
	}
	// TCP_REPAIR_OFF (0): out of repair mode, with a window probe to the peer, as
	// CRIU's libsoccr_resume.
	return unix.SetsockoptInt(fd, unix.SOL_TCP, unix.TCP_REPAIR, 0)
}

// Tuples are conns as netns names them, for Lock.
func Tuples(conns []Conn) []netns.Tuple {
	var out []netns.Tuple
	for _, c := range conns {
		out = append(out, netns.Tuple{Local: c.Local, Remote: c.Remote})
	}
	return out
}

// destroyOrphans destroys, in the network namespace nsFD, the closed ends (no process
// holds them) of the image's connections: see the comment at the top of this file.
func destroyOrphans(nsFD int, conns []Conn) error {
	d, err := netns.NewDiag(nsFD)
	if err != nil {
		return err
	}
	defer d.Close()
	for _, c := range conns {
		// Both ends: the peer's closed end, orphaned when its process was ended (in
		// this tree or another), would answer the restored socket's first segment, or
		// send it its FIN again, and reset it (CRIU: "Can't restore not-sent send queue
		// data ... Broken pipe"). An end a process holds (the daemon's) is left.
		for _, e := range [][2]netip.AddrPort{{c.Local, c.Remote}, {c.Remote, c.Local}} {
			if _, err := d.DestroyOrphan(e[0], e[1]); err != nil {
				return fmt.Errorf("the closed end of TCP connection %s to %s: %w", e[0], e[1], err)
			}
		}
	}
	return nil
}

// tcpStreamMagic is CRIU's magic of tcp-stream-INO.img (criu/include/magic.h): one
// TcpStreamEntry, then the queues' bytes, raw.
const tcpStreamMagic = 0x51465506

// queueRoom is the share of a socket's largest buffer (twice net.core.wmem_max or
// rmem_max: what SO_SNDBUF and SO_RCVBUF can set) that a restore may fill with a queue.
// The kernel counts an skb's overhead against the buffer (truesize), and CRIU's
// restore makes its own skbs: a send queue of 8,284,464 bytes that the process had
// queued under an 8 MiB buffer failed to go back into one (zdtm socket-tcpbuf6:
// "Can't restore not-sent send queue data ... Resource temporarily unavailable"). A
// quarter is left for the overhead.
const queueRoom = 0.75

// bigQueues refuses a connection of the image in dir whose queue a restore into the
// sandbox cannot put back, read before the tree is ended: CRIU makes the socket's
// buffers as large as it can to restore the queues, and in the sandbox's user namespace
// that is SO_SNDBUF and SO_RCVBUF, capped by the host's net.core.wmem_max and rmem_max
// (SO_SNDBUFFORCE needs CAP_NET_ADMIN in the host's user namespace: scripts/criu/0006),
// while the process's own socket may have grown larger (receive autotuning goes up to
// net.ipv4.tcp_rmem's maximum).
func bigQueues(dir string, conns []Conn) error {
	wmax, err1 := sysctlInt("/proc/sys/net/core/wmem_max")
	rmax, err2 := sysctlInt("/proc/sys/net/core/rmem_max")
	if err := errors.Join(err1, err2); err != nil {
		return err
	}
	var why []string
	for _, c := range conns {
		p := fmt.Sprintf("%s/tcp-stream-%x.img", dir, c.Ino)
		b, err := readFirstEntry(p, tcpStreamMagic)
		if errors.Is(err, os.ErrNotExist) {
			continue // no queues (a connection CRIU closes, or one with nothing queued)
		}
		if err != nil {
			return err
		}
		var e tcpstream.TcpStreamEntry
		if err := proto.Unmarshal(b, &e); err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		if out, room := e.GetOutqLen(), int64(queueRoom*2*float64(wmax)); int64(out) > room {
			why = append(why, fmt.Sprintf("TCP connection %s to %s holds %d bytes not yet acknowledged by its peer, more than a restore in the sandbox can queue again (%d: 3/4 of twice net.core.wmem_max, %d); let the peer read them, or raise net.core.wmem_max on the host", c.Local, c.Remote, out, room, wmax))
		}
		if in, room := e.GetInqLen(), int64(queueRoom*2*float64(rmax)); int64(in) > room {
			why = append(why, fmt.Sprintf("TCP connection %s to %s holds %d bytes its process has not read, more than a restore in the sandbox can queue again (%d: 3/4 of twice net.core.rmem_max, %d); read them, or raise net.core.rmem_max on the host", c.Local, c.Remote, in, room, rmax))
		}
	}
	if len(why) > 0 {
		return errors.New(strings.Join(why, "; "))
	}
	return nil
}

func sysctlInt(path string) (int64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
}

// readFirstEntry reads the first entry of a CRIU image file, for images whose entry is
// followed by raw data (tcp-stream: the queues).
func readFirstEntry(path string, magic uint32) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer func() { _ = f.Close() }() // read-only
	var h [3]uint32                  // the two magics, the entry's length
	if err := binary.Read(f, binary.LittleEndian, &h); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if h[0] != imgCommonMagic || h[1] != magic {
		return nil, fmt.Errorf("%s: magic %#x %#x, want %#x %#x", path, h[0], h[1], imgCommonMagic, magic)
	}
	if h[2] > 1<<20 {
		return nil, fmt.Errorf("%s: an entry of %d bytes", path, h[2])
	}
	b := make([]byte, h[2])
	if _, err := io.ReadFull(f, b); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return b, nil
}
