package netns

import (
	"encoding/binary"
	"fmt"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// LockTable is the nftables table Lock makes (family inet: IPv4 and IPv6).
const LockTable = "deltabox-lock"

// SOCCRMark is the packet mark of what CRIU's libsoccr sends itself (soccr/soccr.h).
const SOCCRMark = 0xC114

// Lock drops every TCP packet that enters or leaves the namespace nsFD until Unlock:
// CRIU's network lock, which DeltaBox takes itself (CRIU runs with --network-lock
// skip: its own would run iptables or its nftables table in whatever namespace CRIU's
// restore runs in, the host's).
//
// Why a checkpoint's CRIU dump needs it: CRIU reads a connected TCP socket's state and
// queues in repair mode (TCP_REPAIR) and leaves it so once the tree is dumped and left
// stopped. A socket in repair mode still takes in segments and acknowledges them, so
// bytes that arrive after its dump (from a tree dumped later, from the daemon's end of
// a proxied or forwarded connection, or a retransmission) would be acknowledged and
// then lost, as the restore rebuilds the socket from the image. Dropped instead, they
// are sent again by the peer's kernel once the lock is gone (its retransmission timer:
// 200 ms at least, doubling), and the restored socket, whose sequence numbers are the
// image's, takes them.
//
// A lock left by a daemon that died is removed by the next Configure (at adoption).
func Lock(nsFD int) error {
	c, err := nftables.New(nftables.WithNetNSFd(nsFD))
	if err != nil {
		return fmt.Errorf("nftables in the sandbox's namespace: %w", err)
	}
	defer c.CloseLasting()
	t := c.AddTable(&nftables.Table{Family: nftables.TableFamilyINet, Name: LockTable})
	// CRIU's restore sends the FIN of a connection restored in a closing state
	// (FIN_WAIT1, LAST_ACK, CLOSING) on a raw socket marked SOCCR_MARK, which CRIU's own
	// lock lets through (criu/net.c): so does this one.
	soccrMark := []expr.Any{
		&expr.Meta{Key: expr.MetaKeyMARK, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binary.NativeEndian.AppendUint32(nil, SOCCRMark)},
		&expr.Verdict{Kind: expr.VerdictAccept},
	}
	dropTCP := []expr.Any{
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.IPPROTO_TCP}},
		&expr.Verdict{Kind: expr.VerdictDrop},
	}
	// At raw priority, before conntrack and the nat chains: a dropped packet leaves no
	// conntrack entry or NAT binding behind.
	prio := nftables.ChainPriorityRaw
	for name, hook := range map[string]*nftables.ChainHook{"lock_in": nftables.ChainHookInput, "lock_out": nftables.ChainHookOutput} {
		ch := c.AddChain(&nftables.Chain{Name: name, Table: t, Type: nftables.ChainTypeFilter, Hooknum: hook, Priority: prio})
		c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: soccrMark})
		c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: dropTCP})
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("lock the sandbox's TCP traffic (nftables): %w", err)
	}
	return nil
}

// Unlock removes Lock's table from the namespace nsFD; none there is not an error.
func Unlock(nsFD int) error {
	c, err := nftables.New(nftables.WithNetNSFd(nsFD))
	if err != nil {
		return fmt.Errorf("nftables in the sandbox's namespace: %w", err)
	}
	defer c.CloseLasting()
	if ok, err := locked(c); err != nil || !ok {
		return err
	}
	c.DelTable(&nftables.Table{Family: nftables.TableFamilyINet, Name: LockTable})
	if err := c.Flush(); err != nil {
		return fmt.Errorf("unlock the sandbox's TCP traffic (nftables): %w", err)
	}
	return nil
}

// Locked says whether Lock's table is in the namespace nsFD.
func Locked(nsFD int) (bool, error) {
	c, err := nftables.New(nftables.WithNetNSFd(nsFD))
	if err != nil {
		return false, fmt.Errorf("nftables in the sandbox's namespace: %w", err)
	}
	defer c.CloseLasting()
	return locked(c)
}

func locked(c *nftables.Conn) (bool, error) {
	ts, err := c.ListTablesOfFamily(nftables.TableFamilyINet)
	if err != nil {
		return false, fmt.Errorf("list the sandbox's nftables tables: %w", err)
	}
	for _, t := range ts {
		if t.Name == LockTable {
			return true, nil
		}
	}
	return false, nil
}
