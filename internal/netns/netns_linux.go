// Package netns plumbs a sandbox's network namespace to the daemon's proxy: a route
// that lets connect() start, netfilter rules that send every outgoing TCP connection
// and DNS datagram to the daemon's listeners inside that namespace and drop the rest,
// and sockets opened in the namespace by the daemon (listeners for the proxy, dials
// for exposed ports).
//
// Kernel facts it rests on (checked on this kernel, 6.18, see docs/design/network.md):
//
//   - A socket keeps the network namespace it was created in. A thread that setns'd
//     into the sandbox's namespace creates the listener there; the daemon's proxy then
//     accepts from it and dials upstream from the host's namespace, on other threads.
//   - connect() to an address needs a route before netfilter sees a packet (else
//     ENETUNREACH). The kernel has no dummy driver (CONFIG_DUMMY is off), so the route
//     is "default dev lo src 127.0.0.1": packets that no rule redirects loop back, meet
//     a foreign destination with forwarding off, and are dropped.
//   - An OUTPUT nat rule "redirect" rewrites a locally made connection to 127.0.0.1:port
//     and the listener reads the original destination with SO_ORIGINAL_DST.
//   - Raw (CAP_NET_RAW is in the sandbox's set) and UDP sockets' packets cross the same
//     OUTPUT hook: the filter chain drops them (sendto fails with EPERM). Packet
//     sockets bypass netfilter but can only send on lo, back into the namespace.
//   - The namespace is owned by the sandbox's user namespace, whose bounding set lacks
//     CAP_NET_ADMIN (sbinit: dropCapabilities) and which cannot make a new user
//     namespace (seccomp): nothing inside can change the route or the rules.
package netns

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"runtime"
	"strings"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/vishvananda/netlink"
	vnetns "github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Table is the name of the nftables tables Configure makes (one per family).
const Table = "deltabox"

// Configure makes the namespace behind nsFD send every TCP connection to
// 127.0.0.1:tcpPort and every UDP datagram to port 53 to 127.0.0.1:dnsPort, and drop
// every other packet that leaves for an address outside 127.0.0.0/8 and ::1. It
// replaces rules of an earlier call.
func Configure(nsFD int, tcpPort, dnsPort uint16) error {
	h, err := netlink.NewHandleAt(vnetns.NsHandle(nsFD))
	if err != nil {
		return fmt.Errorf("netlink in the sandbox's namespace: %w", err)
	}
	defer h.Close()
	lo, err := h.LinkByName("lo")
	if err != nil {
		return fmt.Errorf("find lo: %w", err)
	}
	if err := h.LinkSetUp(lo); err != nil {
		return fmt.Errorf("bring lo up: %w", err)
	}
	rt := &netlink.Route{LinkIndex: lo.Attrs().Index, Family: netlink.FAMILY_V4, Scope: netlink.SCOPE_LINK, Src: net.IPv4(127, 0, 0, 1)}
	if err := h.RouteReplace(rt); err != nil {
		return fmt.Errorf("default route via lo: %w", err)
	}

	c, err := nftables.New(nftables.WithNetNSFd(nsFD))
	if err != nil {
		return fmt.Errorf("nftables in the sandbox's namespace: %w", err)
	}
	defer c.CloseLasting()
	// Delete and add in one batch: the namespace is never without rules.
	t4 := &nftables.Table{Family: nftables.TableFamilyIPv4, Name: Table}
	t6 := &nftables.Table{Family: nftables.TableFamilyIPv6, Name: Table}
	// A lock's table (Lock's, or a CRIU dump's) is one a daemon that died left
	// (Configure runs at adoption).
	if ts, err := c.ListTables(); err == nil {
		for _, t := range ts {
			if t.Name == Table || t.Name == LockTable || strings.HasPrefix(t.Name, criuTablePrefix) {
				c.DelTable(t)
			}
		}
	}
	c.AddTable(t4)
	c.AddTable(t6)
	drop := nftables.ChainPolicyDrop
	nat := c.AddChain(&nftables.Chain{Name: "nat_out", Table: t4, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookOutput, Priority: nftables.ChainPriorityNATDest})
	filt := c.AddChain(&nftables.Chain{Name: "filter_out", Table: t4, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookOutput, Priority: nftables.ChainPriorityFilter, Policy: &drop})
	filt6 := c.AddChain(&nftables.Chain{Name: "filter_out", Table: t6, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookOutput, Priority: nftables.ChainPriorityFilter, Policy: &drop})

	// ip daddr 127.0.0.0/8: the sandbox's own services stay its own.
	loop4 := []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 16, Len: 4},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: []byte{255, 0, 0, 0}, Xor: []byte{0, 0, 0, 0}},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{127, 0, 0, 0}},
	}
	accept := &expr.Verdict{Kind: expr.VerdictAccept}
	c.AddRule(&nftables.Rule{Table: t4, Chain: nat, Exprs: append(append([]expr.Any{}, loop4...), accept)})
	// meta l4proto tcp redirect to :tcpPort
	c.AddRule(&nftables.Rule{Table: t4, Chain: nat, Exprs: []expr.Any{
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.IPPROTO_TCP}},
		&expr.Immediate{Register: 1, Data: be16(tcpPort)},
		&expr.Redir{RegisterProtoMin: 1},
	}})
	// udp dport 53 redirect to :dnsPort
	c.AddRule(&nftables.Rule{Table: t4, Chain: nat, Exprs: []expr.Any{
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.IPPROTO_UDP}},
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: be16(53)},
		&expr.Immediate{Register: 1, Data: be16(dnsPort)},
		&expr.Redir{RegisterProtoMin: 1},
	}})
	// The filter runs after nat: redirected packets go to 127.0.0.1 and pass.
	c.AddRule(&nftables.Rule{Table: t4, Chain: filt, Exprs: append(append([]expr.Any{}, loop4...), accept)})
	c.AddRule(&nftables.Rule{Table: t6, Chain: filt6, Exprs: []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 24, Len: 16},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: net.IPv6loopback.To16()},
		accept,
	}})
	if err := c.Flush(); err != nil {
		return fmt.Errorf("nftables rules in the sandbox's namespace: %w", err)
	}
	return nil
}

func be16(v uint16) []byte { return binary.BigEndian.AppendUint16(nil, v) }

// In runs f on a thread that has entered the network namespace nsFD, and discards
// that thread afterwards (its goroutine ends locked). Sockets f creates stay in the
// namespace for their life, whatever thread uses them later.
func In(nsFD int, f func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread's namespace is not the process's
		if err := unix.Setns(nsFD, unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("enter the sandbox's network namespace: %w", err)
			return
		}
		errc <- f()
	}()
	return <-errc
}

// ListenTCP opens a TCP listener on 127.0.0.1 (an ephemeral port) in nsFD's namespace.
func ListenTCP(nsFD int) (*net.TCPListener, error) {
	var l *net.TCPListener
	err := In(nsFD, func() (err error) {
		l, err = net.ListenTCP("tcp4", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
		return err
	})
	return l, err
}

// ListenUDP opens a UDP socket on 127.0.0.1 (an ephemeral port) in nsFD's namespace.
func ListenUDP(nsFD int) (*net.UDPConn, error) {
	var l *net.UDPConn
	err := In(nsFD, func() (err error) {
		l, err = net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
		return err
	})
	return l, err
}

// DialLoopback connects to 127.0.0.1:port inside nsFD's namespace: a service the
// sandbox listens on, reached without giving the sandbox any route to the host.
func DialLoopback(ctx context.Context, nsFD int, port uint16) (net.Conn, error) {
	var c net.Conn
	err := In(nsFD, func() (err error) {
		var d net.Dialer
		c, err = d.DialContext(ctx, "tcp4", netip.AddrPortFrom(netip.AddrFrom4([4]byte{127, 0, 0, 1}), port).String())
		return err
	})
	return c, err
}

// OriginalDst is the destination a redirected connection was made to
// (SO_ORIGINAL_DST, IPv4: the only family Configure redirects).
func OriginalDst(c *net.TCPConn) (netip.AddrPort, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return netip.AddrPort{}, err
	}
	var ap netip.AddrPort
	var serr error
	err = rc.Control(func(fd uintptr) {
		var sa unix.RawSockaddrInet4
		size := uint32(unix.SizeofSockaddrInet4)
		serr = getsockopt(int(fd), unix.SOL_IP, unix.SO_ORIGINAL_DST, &sa, &size)
		if serr == nil {
			port := binary.BigEndian.Uint16((*[2]byte)(unsafePointer(&sa.Port))[:])
			ap = netip.AddrPortFrom(netip.AddrFrom4(sa.Addr), port)
		}
	})
	if err == nil {
		err = serr
	}
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("SO_ORIGINAL_DST: %w", err)
	}
	return ap, nil
}
