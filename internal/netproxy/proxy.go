package netproxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"deltabox/internal/netns"
)

// Deadlines of a connection's set-up. A client that speaks first (TLS, HTTP) has sent
// its name well within peekTimeout; one that waits for the server (SSH, SMTP) is
// decided without a name when it expires.
const (
	peekTimeout = time.Second
	dialTimeout = 10 * time.Second
	dnsTimeout  = 5 * time.Second
	maxNames    = 4096 // addresses remembered per sandbox from DNS answers
	// maxConns and maxDNS bound what one sandbox holds of the daemon at once (a
	// goroutine pair and two fds per connection, a goroutine per query): past them a
	// connection is refused, a query dropped.
	maxConns = 1024
	maxDNS   = 64
)

// Config configures the daemon's proxy.
type Config struct {
	// DNS is the upstream resolver, "ip:port"; "" uses the host's (/etc/resolv.conf).
	DNS string
	Log *slog.Logger
}

// Proxy serves every sandbox with a network: it dials upstream from the daemon's
// (the host's) namespace.
type Proxy struct {
	log      *slog.Logger
	resolver *net.Resolver
}

// New makes the daemon's proxy.
func New(cfg Config) *Proxy {
	p := &Proxy{log: cfg.Log, resolver: net.DefaultResolver}
	if p.log == nil {
		p.log = slog.Default()
	}
	if cfg.DNS != "" {
		server := cfg.DNS
		p.resolver = &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, network, server)
		}}
	}
	return p
}

// Counters is what a sandbox's traffic through the proxy came to.
type Counters struct {
	Connections int64 // connections made upstream
	Refused     int64 // connections refused by the rules or the guard
	BytesOut    int64 // from the sandbox to upstream
	BytesIn     int64 // from upstream to the sandbox
	DNSQueries  int64
	DNSRefused  int64 // names the rules do not allow (answered NXDOMAIN, never sent upstream)
	Open        int64 // connections open now
}

// Sandbox is one sandbox's side of the proxy: its listeners (inside its namespace),
// its rules, the names its DNS answers gave, its counters and open connections.
type Sandbox struct {
	p     *Proxy
	id    string
	pol   *Policy
	model *Model // nil: none
	tcp   *net.TCPListener
	dns   *net.UDPConn
	// diag reads the sandbox's sockets' unread bytes (Quiesce).
	diag *netns.Diag // +checklocks:mu
	wg   sync.WaitGroup
	// ctx ends with Close: dials and lookups in progress stop at once.
	ctx    context.Context
	cancel context.CancelFunc
	// handling counts connections being handled (peeked, dialled or proxied), dnsBusy
	// the queries being answered.
	handling atomic.Int64
	dnsBusy  atomic.Int64

	connections atomic.Int64
	refused     atomic.Int64
	bytesOut    atomic.Int64
	bytesIn     atomic.Int64
	dnsQueries  atomic.Int64
	dnsRefused  atomic.Int64

	mu    sync.Mutex
	names map[netip.Addr]map[string]bool // +checklocks:mu
	// accepted are the sandbox's connections not closed yet, whatever their stage.
	accepted map[*net.TCPConn]struct{} // +checklocks:mu
	conns    map[*pipe]struct{}        // +checklocks:mu
	closed   bool                      // +checklocks:mu
}

// Attach gives the sandbox whose network namespace is nsFD its listeners and rules,
// and starts serving it. The namespace keeps the rules after Close (it dies with the
// sandbox); the listeners go, so its connections then fail.
func (p *Proxy) Attach(id string, nsFD int, pol *Policy, model *Model) (*Sandbox, error) {
	tcp, err := netns.ListenTCP(nsFD)
	if err != nil {
		return nil, fmt.Errorf("network: proxy listener: %w", err)
	}
	dns, err := netns.ListenUDP(nsFD)
	if err != nil {
		tcp.Close()
		return nil, fmt.Errorf("network: DNS listener: %w", err)
	}
	tport := uint16(tcp.Addr().(*net.TCPAddr).Port)
	dport := uint16(dns.LocalAddr().(*net.UDPAddr).Port)
	if err := netns.Configure(nsFD, tport, dport); err != nil {
		tcp.Close()
		dns.Close()
		return nil, fmt.Errorf("network: %w", err)
	}
	diag, err := netns.NewDiag(nsFD)
	if err != nil {
		tcp.Close()
		dns.Close()
		return nil, fmt.Errorf("network: %w", err)
	}
	s := &Sandbox{p: p, id: id, pol: pol, model: model, tcp: tcp, dns: dns, diag: diag, names: map[netip.Addr]map[string]bool{},
		conns: map[*pipe]struct{}{}, accepted: map[*net.TCPConn]struct{}{}}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.wg.Add(2)
	go s.serveTCP()
	go s.serveDNS()
	return s, nil
}

// Close stops serving the sandbox and closes its connections.
func (s *Sandbox) Close() {
	s.cancel()
	s.mu.Lock()
	s.closed = true
	conns := make([]*pipe, 0, len(s.conns))
	for c := range s.conns {
		conns = append(conns, c)
	}
	for c := range s.accepted {
		c.SetLinger(0)
		c.Close() // a peek in progress ends
	}
	s.mu.Unlock()
	s.tcp.Close()
	s.dns.Close()
	for _, c := range conns {
		c.close()
	}
	s.wg.Wait()
	s.mu.Lock()
	s.diag.Close()
	s.mu.Unlock()
}

// Counters reads the sandbox's counters.
func (s *Sandbox) Counters() Counters {
	s.mu.Lock()
	open := int64(len(s.conns))
	s.mu.Unlock()
	return Counters{Connections: s.connections.Load(), Refused: s.refused.Load(), BytesOut: s.bytesOut.Load(),
		BytesIn: s.bytesIn.Load(), DNSQueries: s.dnsQueries.Load(), DNSRefused: s.dnsRefused.Load(), Open: open}
}

func (s *Sandbox) serveTCP() {
	defer s.wg.Done()
	for {
		c, err := s.tcp.AcceptTCP()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			s.p.log.Warn("network: accept", "sandbox", s.id, "err", err)
			time.Sleep(10 * time.Millisecond)
			continue
		}
		if s.handling.Add(1) > maxConns {
			s.handling.Add(-1)
			s.refuse(c, netip.AddrPort{}, "", fmt.Sprintf("over %d connections at once", maxConns))
			continue
		}
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			c.Close()
			continue
		}
		s.accepted[c] = struct{}{}
		s.mu.Unlock()
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			defer s.handling.Add(-1)
			defer func() {
				s.mu.Lock()
				delete(s.accepted, c)
				s.mu.Unlock()
			}()
			s.handle(c)
		}()
	}
}

// refuse counts and logs a refused connection and resets it.
func (s *Sandbox) refuse(c *net.TCPConn, dst netip.AddrPort, name, why string) {
	s.refused.Add(1)
	s.p.log.Info("network: refused", "sandbox", s.id, "dst", dst.String(), "name", name, "why", why)
	c.SetLinger(0) // RST: the client sees "connection reset" at once
	c.Close()
}

func (s *Sandbox) handle(c *net.TCPConn) {
	dst, err := netns.OriginalDst(c)
	if err != nil || dst.Addr().IsLoopback() {
		// Not redirected: a process connected to the listener itself.
		s.refuse(c, dst, "", "a direct connection to the proxy's listener")
		return
	}
	head, name := peek(c)
	if s.isModel(dst, name) {
		s.serveModel(c, head, dst)
		return
	}
	if ok, why := s.decide(dst, name); !ok {
		s.refuse(c, dst, name, why)
		return
	}
	ctx, cancel := context.WithTimeout(s.ctx, dialTimeout)
	d := net.Dialer{Control: func(_, address string, _ syscall.RawConn) error {
		// The address dialled is dst itself (no name is resolved here); checked once
		// more where the socket is made.
		ap, err := netip.ParseAddrPort(address)
		if err != nil {
			return err
		}
		if why := forbidden(ap.Addr()); why != "" {
			return errors.New(why)
		}
		return nil
	}}
	upc, err := d.DialContext(ctx, "tcp", dst.String())
	cancel()
	if err != nil {
		s.refuse(c, dst, name, fmt.Sprintf("upstream: %v", err))
		return
	}
	up := upc.(*net.TCPConn)
	s.connections.Add(1)
	p := &pipe{down: c, up: up, what: dst.String(), dst: dst}
	if name != "" {
		p.what += " (" + name + ")"
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		c.Close()
		up.Close()
		return
	}
	s.conns[p] = struct{}{}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.conns, p)
		s.mu.Unlock()
	}()
	if len(head) > 0 {
		if _, err := up.Write(head); err != nil {
			p.close()
			return
		}
		s.bytesOut.Add(int64(len(head)))
		p.lastUp.Store(time.Now().UnixNano())
	}
	p.run(s)
}

// peek reads a connection's first bytes until they say which name it asks for, or
// show there is none, or peekTimeout passes.
func peek(c *net.TCPConn) ([]byte, string) {
	buf := make([]byte, maxPeek)
	n := 0
	c.SetReadDeadline(time.Now().Add(peekTimeout))
	defer c.SetReadDeadline(time.Time{})
	for n < len(buf) {
		k, err := c.Read(buf[n:])
		n += k
		name, st := clientName(buf[:n])
		if st != needMore {
			return buf[:n], name
		}
		if err != nil {
			break
		}
	}
	return buf[:n], ""
}

// decide applies the rules to a connection to dst that asked for name ("" if none).
//
// With a name (TLS SNI, HTTP Host), the name must be allowed and dst must be an
// address of it (one the sandbox's DNS answers gave for it, or one the resolver gives
// now) or allowed by CIDR: a client cannot name an allowed host and reach another.
// Without one, dst must be allowed by CIDR or be an address DNS answered for an
// allowed name (ssh to github.com).
func (s *Sandbox) decide(dst netip.AddrPort, name string) (bool, string) {
	a := dst.Addr().Unmap()
	if why := forbidden(a); why != "" {
		return false, why
	}
	if s.pol.DeniesAddr(a) {
		return false, "address in deny_out"
	}
	if name != "" {
		if ip, err := netip.ParseAddr(name); err == nil {
			if ip.Unmap() != a {
				return false, "the Host names another address"
			}
			name = ""
		}
	}
	if name != "" {
		if !s.pol.AllowsName(name) {
			return false, "name not in allow_out (or in deny_out)"
		}
		if s.pol.AllowsAddr(a) || s.answered(a, name) || s.resolvesTo(name, a) {
			return true, ""
		}
		return false, "the address is not one of the name's"
	}
	if s.pol.AllowsAddr(a) {
		return true, ""
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for n := range s.names[a] {
		if s.pol.AllowsName(n) {
			return true, ""
		}
	}
	return false, "address not in allow_out, and no allowed name resolved to it"
}

func (s *Sandbox) answered(a netip.Addr, name string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.names[a][normName(name)]
}

func (s *Sandbox) resolvesTo(name string, a netip.Addr) bool {
	ctx, cancel := context.WithTimeout(s.ctx, dnsTimeout)
	defer cancel()
	addrs, err := s.p.resolver.LookupNetIP(ctx, "ip4", name)
	if err != nil {
		return false
	}
	for _, b := range addrs {
		if b.Unmap() == a {
			return true
		}
	}
	return false
}

// forbidden says why no sandbox may reach a, whatever its rules: the host's loopback
// and its own addresses (the daemon's and the host's services), link-local addresses
// (cloud metadata at 169.254.169.254), multicast and unspecified ones.
func forbidden(a netip.Addr) string {
	a = a.Unmap()
	switch {
	case !a.IsValid():
		return "no address"
	case a.IsLoopback():
		return "the host's loopback"
	case a.IsLinkLocalUnicast() || a.IsLinkLocalMulticast():
		return "a link-local address (cloud metadata)"
	case a.IsUnspecified() || a.IsMulticast() || a == netip.AddrFrom4([4]byte{255, 255, 255, 255}):
		return "not a unicast address"
	case hostAddr(a):
		return "an address of the host"
	}
	return ""
}

// hostAddrs caches the host's addresses for hostAddrsTTL: reading them is a netlink
// dump (about 0.1 ms here), twice per connection otherwise. Only the host's root adds
// addresses, and a new one is known within the TTL.
var hostAddrs struct {
	mu sync.Mutex
	// +checklocks:mu
	at time.Time
	// +checklocks:mu
	addrs map[netip.Addr]bool
}

const hostAddrsTTL = time.Second

// hostAddr says whether a is one of the host's own addresses.
func hostAddr(a netip.Addr) bool {
	hostAddrs.mu.Lock()
	defer hostAddrs.mu.Unlock()
	if hostAddrs.addrs == nil || time.Since(hostAddrs.at) > hostAddrsTTL {
		addrs, err := net.InterfaceAddrs()
		if err != nil {
			return true // unknown: refuse
		}
		m := map[netip.Addr]bool{}
		for _, x := range addrs {
			if ipn, ok := x.(*net.IPNet); ok {
				if b, ok := netip.AddrFromSlice(ipn.IP); ok {
					m[b.Unmap()] = true
				}
			}
		}
		hostAddrs.addrs, hostAddrs.at = m, time.Now()
	}
	return hostAddrs.addrs[a]
}

// pipe is one proxied connection: down is the sandbox's side, up the upstream's.
type pipe struct {
	down, up *net.TCPConn
	what     string         // "dst (name)", for messages
	dst      netip.AddrPort // where the sandbox's socket connected (SO_ORIGINAL_DST)
	// busy, when set, says whether a request is in flight (the model endpoint, which
	// sees requests whole); else lastUp and lastDown tell.
	busy func() bool
	// lastUp and lastDown are when bytes last went each way (UnixNano): a request is
	// in flight while the sandbox has sent more recently than upstream answered.
	lastUp, lastDown atomic.Int64
	once             sync.Once
}

func (p *pipe) close() {
	p.once.Do(func() {
		p.down.SetLinger(0)
		p.down.Close()
		if p.up != nil {
			p.up.Close()
		}
	})
}

// run copies both ways until both ends are done.
func (p *pipe) run(s *Sandbox) {
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		err := copyCount(p.up, p.down, &s.bytesOut, &p.lastUp)
		if err != nil {
			p.close()
			return
		}
		p.up.CloseWrite()
	}()
	err := copyCount(p.down, p.up, &s.bytesIn, &p.lastDown)
	if err != nil {
		p.close()
	} else {
		p.down.CloseWrite()
	}
	wg.Wait()
	p.close()
}

func copyCount(dst, src *net.TCPConn, count, last *atomic.Int64) error {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			last.Store(time.Now().UnixNano())
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return werr
			}
			count.Add(int64(n))
		}
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
	}
}
