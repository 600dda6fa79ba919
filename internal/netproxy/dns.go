package netproxy

import (
	"context"
	"errors"
	"net"
	"net/netip"

	"golang.org/x/net/dns/dnsmessage"
)

// serveDNS answers the sandbox's DNS queries (every UDP datagram to port 53 lands
// here). Only names the rules allow are resolved, upstream by the daemon's resolver:
// a query for any other name never leaves the host, so DNS cannot carry data out
// (tunnelling through a denied domain's name server). A records only: AAAA and other
// types get an empty answer, and the sandbox has no IPv6 route anyway.
func (s *Sandbox) serveDNS() {
	defer s.wg.Done()
	buf := make([]byte, 1500)
	for {
		n, from, err := s.dns.ReadFromUDPAddrPort(buf)
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		if s.dnsBusy.Add(1) > maxDNS {
			s.dnsBusy.Add(-1)
			continue
		}
		q := append([]byte(nil), buf[:n]...)
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			defer s.dnsBusy.Add(-1)
			if resp := s.answer(q); resp != nil {
				s.dns.WriteToUDPAddrPort(resp, from)
			}
		}()
	}
}

// answer builds the response to one query message (nil: not a query, dropped).
func (s *Sandbox) answer(msg []byte) []byte {
	var p dnsmessage.Parser
	h, err := p.Start(msg)
	if err != nil || h.Response {
		return nil
	}
	q, err := p.Question()
	if err != nil {
		return nil
	}
	s.dnsQueries.Add(1)
	rh := dnsmessage.Header{ID: h.ID, Response: true, RecursionDesired: h.RecursionDesired, RecursionAvailable: true}
	name := normName(q.Name.String())
	var addrs []netip.Addr
	switch {
	case s.model != nil && name == s.model.Host:
		if q.Type == dnsmessage.TypeA {
			addrs = []netip.Addr{ModelAddr}
		}
	case !s.pol.AllowsName(name):
		s.dnsRefused.Add(1)
		s.p.log.Info("network: refused DNS", "sandbox", s.id, "name", name, "why", "name not in allow_out (or in deny_out)")
		rh.RCode = dnsmessage.RCodeNameError
	case q.Class != dnsmessage.ClassINET || h.OpCode != 0:
		rh.RCode = dnsmessage.RCodeNotImplemented
	case q.Type == dnsmessage.TypeA:
		ctx, cancel := context.WithTimeout(s.ctx, dnsTimeout)
		addrs, err = s.p.resolver.LookupNetIP(ctx, "ip4", name)
		cancel()
		var de *net.DNSError
		switch {
		case errors.As(err, &de) && de.IsNotFound:
			rh.RCode = dnsmessage.RCodeNameError
		case err != nil:
			rh.RCode = dnsmessage.RCodeServerFailure
		}
	}
	b := dnsmessage.NewBuilder(nil, rh)
	b.EnableCompression()
	b.StartQuestions()
	b.Question(q)
	b.StartAnswers()
	var kept []netip.Addr
	for _, a := range addrs {
		a = a.Unmap()
		if !a.Is4() || (forbidden(a) != "" && a != ModelAddr) {
			continue // never hand out an address the proxy would refuse anyway
		}
		kept = append(kept, a)
		b.AResource(dnsmessage.ResourceHeader{Name: q.Name, Class: dnsmessage.ClassINET, TTL: 60}, dnsmessage.AResource{A: a.As4()})
	}
	s.remember(name, kept)
	resp, err := b.Finish()
	if err != nil {
		return nil
	}
	return resp
}

// remember records that DNS gave the sandbox addrs for name.
func (s *Sandbox) remember(name string, addrs []netip.Addr) {
	if len(addrs) == 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.names) > maxNames {
		clear(s.names)
	}
	for _, a := range addrs {
		m := s.names[a]
		if m == nil {
			m = map[string]bool{}
			s.names[a] = m
		}
		m[name] = true
	}
}
