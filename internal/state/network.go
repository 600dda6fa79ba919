package state

import (
	"context"
	"fmt"
	"net"
	"os"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/errdefs"
	"deltabox/internal/netns"
	"deltabox/internal/netproxy"
	"deltabox/internal/sandbox"
	"deltabox/internal/store"
)

// checkNetwork checks a create's network option (nil: no network).
func checkNetwork(n *apitypes.Network) error {
	if n == nil {
		return nil
	}
	if _, err := netproxy.ParsePolicy(n.AllowOut, n.DenyOut, n.Model != nil); err != nil {
		return fmt.Errorf("%v: %w", err, errdefs.ErrInvalid)
	}
	if n.Model != nil {
		if _, err := netproxy.New(netproxy.Config{}).NewModel(apitypes.ModelHost, n.Model.URL, n.Model.Key); err != nil {
			return fmt.Errorf("%v: %w", err, errdefs.ErrInvalid)
		}
	}
	return nil
}

// redactNet is the network option as the API shows it: the model key never leaves
// the daemon (KeySet says one is kept).
func redactNet(n *apitypes.Network) *apitypes.Network {
	if n == nil || n.Model == nil {
		return n
	}
	c, mc := *n, *n.Model
	mc.KeySet, mc.Key = mc.Key != "", ""
	c.Model = &mc
	return &c
}

// unlockLeftNet removes the locks of TCP connections a daemon that died left in rt's
// network namespace: a checkpoint cut between its CRIU dumps and its trees' resume
// leaves CRIU's (durable/tcp.go), and resumeCutCRIUTrees lets the trees run. A sandbox
// with a network gets the same from attachNet (netns.Configure); one without has only
// this.
func unlockLeftNet(rt *sandbox.Sandbox) error {
	f, err := rt.OpenNetNS()
	if err != nil {
		return err
	}
	defer func() { _ = f.Close() }() // read-only: a namespace fd
	return netns.Unlock(int(f.Fd()))
}

// attachNet serves s's network through the daemon's proxy when its record asks for
// one (netproxy): listeners and rules in its network namespace, which its init holds.
// Called whenever s gets a running init (boot, adoption after a restart: the old
// daemon's listeners went with it, and the rules are replaced to name the new ones).
// +checklocks:s.opMu
func (m *Manager) attachNet(s *sb) error {
	if s.rec.Network == nil || s.rt == nil {
		return nil
	}
	ns, err := m.netFor(s.rec, s.rt)
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.net = ns
	s.mu.Unlock()
	return nil
}

// netFor serves the network of sandbox rec in runtime rt's namespace (nil: rec has
// none): s's runtime, or a spare's, attached before it runs anything (spares.go).
func (m *Manager) netFor(rec store.Sandbox, rt *sandbox.Sandbox) (*netproxy.Sandbox, error) {
	n := rec.Network
	if n == nil {
		return nil, nil
	}
	pol, err := netproxy.ParsePolicy(n.AllowOut, n.DenyOut, n.Model != nil)
	if err != nil {
		return nil, err
	}
	var model *netproxy.Model
	if n.Model != nil {
		if model, err = m.net.NewModel(apitypes.ModelHost, n.Model.URL, n.Model.Key); err != nil {
			return nil, err
		}
	}
	f, err := rt.OpenNetNS()
	if err != nil {
		return nil, fmt.Errorf("network: the sandbox's namespace: %w", err)
	}
	defer func() { _ = f.Close() }() // read-only: a namespace fd
	return m.net.Attach(rec.ID, int(f.Fd()), pol, model)
}

// quiesceNet readies s's connections through the proxy for a checkpoint
// (netproxy.Sandbox.Quiesce): requests in flight are waited for, up to wait, and idle
// connections reset, so that its processes keep no live socket and stay on the fast
// path. Nothing to do without a network.
func (m *Manager) quiesceNet(s *sb, wait time.Duration) error {
	s.mu.Lock()
	ns := s.net
	s.mu.Unlock()
	if ns == nil {
		return nil
	}
	return ns.Quiesce(wait)
}

// detachNet stops serving s's network (its connections are closed).
func (m *Manager) detachNet(s *sb) {
	s.mu.Lock()
	ns := s.net
	s.net = nil
	s.mu.Unlock()
	if ns != nil {
		ns.Close()
	}
}

// netUsage is s's traffic through the proxy (nil: no network).
func netUsage(s *sb) *apitypes.NetUsage {
	s.mu.Lock()
	ns := s.net
	s.mu.Unlock()
	if ns == nil {
		return nil
	}
	c := ns.Counters()
	return &apitypes.NetUsage{Connections: c.Connections, Refused: c.Refused, BytesOut: c.BytesOut, BytesIn: c.BytesIn,
		DNSQueries: c.DNSQueries, DNSRefused: c.DNSRefused, Open: c.Open}
}

// DialPort connects to 127.0.0.1:port inside sandbox id's network namespace, from a
// daemon thread that entered it (netns.DialLoopback): a service of the sandbox reached
// from the host without any route between the two. Any sandbox, with or without a
// network.
func (m *Manager) DialPort(ctx context.Context, id string, port int) (net.Conn, error) {
	if port < 1 || port > 65535 {
		return nil, fmt.Errorf("port %d: want 1-65535: %w", port, errdefs.ErrInvalid)
	}
	s, err := m.get(id)
	if err != nil {
		return nil, err
	}
	// The namespace is opened while s cannot change init (opMu), and used after: the
	// file holds the namespace, whatever becomes of the PID.
	s.opMu.Lock()
	var f *os.File
	if s.rt == nil || !s.rt.Alive() {
		err = fmt.Errorf("sandbox %s is not running: %w", id, errdefs.ErrConflict)
	} else {
		f, err = s.rt.OpenNetNS()
	}
	s.opMu.Unlock()
	if err != nil {
		return nil, err
	}
	defer func() { _ = f.Close() }() // read-only: a namespace fd
	c, err := netns.DialLoopback(ctx, int(f.Fd()), uint16(port))
	if err != nil {
		return nil, fmt.Errorf("sandbox %s: nothing answers on port %d (a server must listen on 127.0.0.1 or 0.0.0.0 inside): %v: %w", id, port, err, errdefs.ErrUnavailable)
	}
	return c, nil
}
