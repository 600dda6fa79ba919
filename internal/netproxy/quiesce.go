package netproxy

import (
	"fmt"
	"net/netip"
	"sort"
	"strings"
	"time"

	"deltabox/internal/errdefs"
)

// quietGap is how long a connection must have been silent, after its last answer
// bytes, to count as idle. A response moving through the proxy arrives in segments
// microseconds apart on a loopback-class link; 2 ms tells "still arriving" from "done"
// without making a checkpoint right after a request wait for long. A response streamed
// with longer pauses (a model's tokens, tens of ms apart) looks idle in a pause: a
// checkpoint then resets it, and the client sees the stream cut (docs/design/network.md).
const quietGap = 2 * time.Millisecond

// unreadWindow is how long answer bytes the sandbox's socket holds unread count as an
// answer its process is still reading. A process that waits for its answer reads it
// within milliseconds, a loaded machine's scheduling delays included; bytes older than
// this are ones it is not waiting for (a TLS close_notify on an idle keep-alive
// connection, say), which would otherwise hold every checkpoint: the reset drops them,
// and the client reconnects. The model endpoint's connections carry no unsolicited
// bytes: unread ones always count there.
const unreadWindow = 3 * time.Second

// Quiesce readies the sandbox's connections for a checkpoint, so that its processes
// hold no live socket to the outside and stay on the fast path: it waits up to wait for
// the requests in flight (the sandbox sent bytes after the last answer bytes, answer
// bytes came within quietGap, or the sandbox's socket holds answer bytes its process has
// not read: netns.Diag says why), then resets every connection from the proxy's side (RST:
// the process's socket goes to TCP_CLOSE at once, which the fast path takes:
// internal/fastpath/deadsock.go). Requests still in flight after wait refuse (409,
// naming them), and nothing is closed.
func (s *Sandbox) Quiesce(wait time.Duration) error {
	// Waiting out quietGap is not waiting for a request: it is part of any checkpoint.
	deadline := time.Now().Add(max(wait, quietGap))
	for {
		busy := s.inFlight()
		if len(busy) == 0 {
			break
		}
		if !time.Now().Before(deadline) {
			return fmt.Errorf("network: %d connection(s) through the proxy still carry a request after wait_ms %d (%s): checkpoint when they are done, or give a longer wait_ms: %w",
				len(busy), wait.Milliseconds(), strings.Join(busy, ", "), errdefs.ErrConflict)
		}
		time.Sleep(time.Millisecond)
	}
	s.mu.Lock()
	conns := make([]*pipe, 0, len(s.conns))
	for c := range s.conns {
		conns = append(conns, c)
	}
	s.mu.Unlock()
	// The sandbox's end of each, as its socket names itself, taken before the close.
	ends := make([]netip.AddrPort, 0, len(conns))
	for _, c := range conns {
		if local, err := netip.ParseAddrPort(c.down.RemoteAddr().String()); err == nil {
			ends = append(ends, local, c.dst)
		}
	}
	for _, c := range conns {
		c.close()
	}
	s.awaitResets(ends)
	return nil
}

// resetWait bounds awaitResets.
const resetWait = 200 * time.Millisecond

// awaitResets waits, resetWait at most, until the sandbox's socket of each of conns is
// closed. The proxy's RST reaches it through the sandbox's link, in a softirq that a busy
// machine defers to ksoftirqd: until then the socket is still ESTABLISHED, and the
// checkpoint sends its process to CRIU rather than the fast path
// (TestNetCheckpointKeepsFastPath failed so in 1 of 5 runs of the suite at load 2-3).
// One still open after that goes to CRIU, as before. ends are pairs: the sandbox's
// socket's own address, then its peer's.
func (s *Sandbox) awaitResets(ends []netip.AddrPort) {
	deadline := time.Now().Add(resetWait)
	for i := 0; i+1 < len(ends); i += 2 {
		for {
			s.mu.Lock()
			open, err := s.diag.Open(ends[i], ends[i+1])
			s.mu.Unlock()
			if err != nil || !open || !time.Now().Before(deadline) {
				break
			}
			time.Sleep(100 * time.Microsecond)
		}
	}
}

// inFlight names the connections that carry a request now.
func (s *Sandbox) inFlight() []string {
	now := time.Now().UnixNano()
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for c := range s.conns {
		if c.busy != nil {
			if c.busy() || s.unreadLocked(c) {
				out = append(out, c.what)
			}
			continue
		}
		up, down := c.lastUp.Load(), c.lastDown.Load()
		if up > down || now-down < int64(quietGap) || (now-down < int64(unreadWindow) && s.unreadLocked(c)) {
			out = append(out, c.what)
		}
	}
	sort.Strings(out)
	return out
}

// unreadLocked reports whether the sandbox's socket of c holds answer bytes its process
// has not read yet, or the answer's end (the FIN, which the proxy passes on when the
// server closes) with the socket still open: a process reading an answer to its end
// (HTTP/1.0, a download) has not finished it until it sees the end, and a reset before
// that turns its last read into an error (ENOTCONN after the fast path's move) where
// it would have had the whole answer. A sandbox socket already gone, or one the lookup
// cannot find, holds none. Precondition: s.mu held.
// +checklocks:s.mu
func (s *Sandbox) unreadLocked(c *pipe) bool {
	local, err := netip.ParseAddrPort(c.down.RemoteAddr().String())
	if err != nil {
		return false
	}
	n, peerClosed, err := s.diag.Unread(local, c.dst)
	return err == nil && (n > 0 || peerClosed)
}
