package netns

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"strings"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// Locks on TCP connections, while CRIU holds them in repair mode (TCP_REPAIR). A socket
// in repair mode still takes in segments and acknowledges them, so bytes that arrive
// between its dump and its restore (from a peer in a tree dumped later or restored
// earlier, from the daemon's end of a forwarded port, a retransmission) would be
// acknowledged and then lost, as the restore rebuilds the socket from the image; and a
// connection restored before its peer answers the peer's next segment with a reset.
// Dropped instead, they are sent again by the peer's kernel once the lock is gone (its
// retransmission timer: 200 ms at least, doubling).
//
// A checkpoint's dump has CRIU lock each connection itself (--network-lock nftables:
// CRIU runs in the sandbox's namespace, and adds each connection to a set of a table
// "inet CRIU-<run id>" there before it switches the socket to repair mode), and
// leaves the table when the dump leaves its tree stopped. A lock taken before the dump
// instead, on all the namespace's TCP traffic, hung CRIU: when its kernel-features
// cache is missing or stale (after a boot, or an upgrade of CRIU), a dump first
// connects a TCP socket to itself in the namespace it runs in. A restore's CRIU runs in
// the host's namespace, where its lock would land: DeltaBox locks a restore's
// connections itself (Lock). Unlock ends both.

// LockTable is the nftables table Lock makes (family inet: IPv4 and IPv6).
const LockTable = "deltabox-lock"

// criuTablePrefix starts the names of the tables CRIU's nftables lock makes.
const criuTablePrefix = "CRIU-"

// SOCCRMark is the packet mark of what CRIU's libsoccr sends itself (soccr/soccr.h):
// the FIN of a connection restored in FIN_WAIT1, LAST_ACK or CLOSING, on a raw socket,
// which CRIU's lock lets through, and so does Lock ("Unable to send a fin packet ...
// Operation not permitted" without it).
const SOCCRMark = 0xC114

// Tuple is a TCP connection as one of its ends names it: its own address first.
type Tuple struct{ Local, Remote netip.AddrPort }

// Lock drops, in the namespace nsFD, every TCP packet of the connections tuples (either
// way) until Unlock, but those CRIU's restore marks. It adds to a lock already there.
// The rules go in batches of lockBatch connections: a netlink batch of four rules a
// connection answered ENOBUFS past about 35 connections (with the rules in, the caller
// told otherwise), and EMSGSIZE past about 90 (none in).
func Lock(nsFD int, tuples []Tuple) error {
	if len(tuples) == 0 {
		return nil
	}
	c, err := nftables.New(nftables.WithNetNSFd(nsFD))
	if err != nil {
		return fmt.Errorf("nftables in the sandbox's namespace: %w", err)
	}
	defer c.CloseLasting()
	have, err := locked(c, func(name string) bool { return name == LockTable })
	if err != nil {
		return err
	}
	t := &nftables.Table{Family: nftables.TableFamilyINet, Name: LockTable}
	chains := map[string]*nftables.ChainHook{"lock_in": nftables.ChainHookInput, "lock_out": nftables.ChainHookOutput}
	var chs []*nftables.Chain
	for name, hook := range chains {
		chs = append(chs, &nftables.Chain{Name: name, Table: t, Type: nftables.ChainTypeFilter, Hooknum: hook, Priority: nftables.ChainPriorityRaw})
	}
	if !have {
		// At raw priority, before conntrack and the nat chains: a dropped packet leaves
		// no conntrack entry or NAT binding behind. CRIU's marked packets first.
		c.AddTable(t)
		for _, ch := range chs {
			c.AddChain(ch)
			c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: []expr.Any{
				&expr.Meta{Key: expr.MetaKeyMARK, Register: 1},
				&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binary.NativeEndian.AppendUint32(nil, SOCCRMark)},
				&expr.Verdict{Kind: expr.VerdictAccept},
			}})
		}
		if err := c.Flush(); err != nil {
			return fmt.Errorf("lock the sandbox's TCP connections (nftables): %w", err)
		}
	}
	for len(tuples) > 0 {
		n := min(len(tuples), lockBatch)
		for _, ch := range chs {
			for _, tu := range tuples[:n] {
				for _, dir := range [][2]netip.AddrPort{{tu.Local, tu.Remote}, {tu.Remote, tu.Local}} {
					c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: dropFlow(dir[0], dir[1])})
				}
			}
		}
		if err := c.Flush(); err != nil {
			return fmt.Errorf("lock the sandbox's TCP connections (nftables): %w", err)
		}
		tuples = tuples[n:]
	}
	return nil
}

// lockBatch is how many connections' rules Lock sends in one netlink batch.
const lockBatch = 8

// dropFlow matches the TCP packets from src to dst, and drops them. An IPv4-mapped
// IPv6 address matches the IPv4 packets a dual-stack socket sends.
func dropFlow(src, dst netip.AddrPort) []expr.Any {
	sa, da := src.Addr().Unmap(), dst.Addr().Unmap()
	// The family, and where its header holds the addresses.
	proto, saddr, daddr, alen := byte(unix.NFPROTO_IPV4), uint32(12), uint32(16), uint32(4)
	if !sa.Is4() {
		proto, saddr, daddr, alen = unix.NFPROTO_IPV6, 8, 24, 16
	}
	field := func(base expr.PayloadBase, off, n uint32, want []byte) []expr.Any {
		return []expr.Any{
			&expr.Payload{DestRegister: 1, Base: base, Offset: off, Len: n},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: want},
		}
	}
	e := []expr.Any{
		&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{proto}},
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.IPPROTO_TCP}},
	}
	e = append(e, field(expr.PayloadBaseNetworkHeader, saddr, alen, sa.AsSlice())...)
	e = append(e, field(expr.PayloadBaseNetworkHeader, daddr, alen, da.AsSlice())...)
	e = append(e, field(expr.PayloadBaseTransportHeader, 0, 2, be16(src.Port()))...)
	e = append(e, field(expr.PayloadBaseTransportHeader, 2, 2, be16(dst.Port()))...)
	return append(e, &expr.Verdict{Kind: expr.VerdictDrop})
}

// Unlock removes, from the namespace nsFD, Lock's table and the tables of CRIU's dumps
// (all of them: the caller holds the sandbox's operations); none there is not an error.
func Unlock(nsFD int) error {
	return dropTables(nsFD, func(name string) bool { return name == LockTable || strings.HasPrefix(name, criuTablePrefix) })
}

// CRIUTables names the tables of CRIU's dumps in the namespace nsFD.
func CRIUTables(nsFD int) ([]string, error) {
	ts, err := tables(nsFD)
	var out []string
	for _, t := range ts {
		if strings.HasPrefix(t, criuTablePrefix) {
			out = append(out, t)
		}
	}
	return out, err
}

// UnlockCRIU removes the tables of CRIU's dumps in the namespace nsFD that are not in
// keep: those of a dump that DeltaBox refused after CRIU was done.
func UnlockCRIU(nsFD int, keep []string) error {
	return dropTables(nsFD, func(name string) bool {
		if !strings.HasPrefix(name, criuTablePrefix) {
			return false
		}
		for _, k := range keep {
			if k == name {
				return false
			}
		}
		return true
	})
}

// locked says whether a table match names is in c's namespace.
func locked(c *nftables.Conn, match func(name string) bool) (bool, error) {
	ts, err := c.ListTablesOfFamily(nftables.TableFamilyINet)
	if err != nil {
		return false, fmt.Errorf("list the sandbox's nftables tables: %w", err)
	}
	for _, t := range ts {
		if match(t.Name) {
			return true, nil
		}
	}
	return false, nil
}

func tables(nsFD int) ([]string, error) {
	c, err := nftables.New(nftables.WithNetNSFd(nsFD))
	if err != nil {
		return nil, fmt.Errorf("nftables in the sandbox's namespace: %w", err)
	}
	defer c.CloseLasting()
	ts, err := c.ListTablesOfFamily(nftables.TableFamilyINet)
	if err != nil {
		return nil, fmt.Errorf("list the sandbox's nftables tables: %w", err)
	}
	var out []string
	for _, t := range ts {
		out = append(out, t.Name)
	}
	return out, nil
}

func dropTables(nsFD int, drop func(name string) bool) error {
	c, err := nftables.New(nftables.WithNetNSFd(nsFD))
	if err != nil {
		return fmt.Errorf("nftables in the sandbox's namespace: %w", err)
	}
	defer c.CloseLasting()
	ts, err := c.ListTablesOfFamily(nftables.TableFamilyINet)
	if err != nil {
		return fmt.Errorf("list the sandbox's nftables tables: %w", err)
	}
	n := 0
	for _, t := range ts {
		if drop(t.Name) {
			c.DelTable(t)
			n++
		}
	}
	if n == 0 {
		return nil
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("unlock the sandbox's TCP connections (nftables): %w", err)
	}
	return nil
}
