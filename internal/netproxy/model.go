package netproxy

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/netip"
	"net/url"
	"sync"
	"sync/atomic"
	"time"
)

// The model endpoint. A sandbox reaches it as http://ModelHost: its DNS answers
// ModelAddr for that name, the connection is caught like any other, and the proxy
// serves it as an HTTP reverse proxy to the configured URL, setting the Authorization
// header itself. The key lives in the daemon only: never in the sandbox's environment,
// files or memory, so never in a checkpoint. The proxy sees each request and response
// whole, so a checkpoint waits for exactly the requests in flight (a streamed answer
// included), never for a guess.

// ModelAddr is the address the sandbox's DNS gives ModelHost (198.18.0.0/15, set aside
// for benchmarks: never a real host's).
var ModelAddr = netip.AddrFrom4([4]byte{198, 18, 0, 1})

// Model is a sandbox's model endpoint.
type Model struct {
	Host   string   // the name inside (apitypes.ModelHost)
	URL    *url.URL // upstream base
	Key    string
	client *http.Transport
}

// NewModel checks a model endpoint's URL.
func (p *Proxy) NewModel(host, rawURL, key string) (*Model, error) {
	u, err := url.Parse(rawURL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("network: model url %q: want http(s)://host[:port]/path", rawURL)
	}
	d := &net.Dialer{Resolver: p.resolver, Timeout: dialTimeout}
	return &Model{Host: host, URL: u, Key: key, client: &http.Transport{DialContext: d.DialContext,
		ForceAttemptHTTP2: true, MaxIdleConns: 16, IdleConnTimeout: 90 * time.Second}}, nil
}

// isModel says whether a connection to dst that asked for name is for the model.
func (s *Sandbox) isModel(dst netip.AddrPort, name string) bool {
	return s.model != nil && (normName(name) == s.model.Host || dst.Addr() == ModelAddr)
}

// serveModel serves one sandbox connection to the model endpoint (head: what peek read).
func (s *Sandbox) serveModel(c *net.TCPConn, head []byte, dst netip.AddrPort) {
	s.connections.Add(1)
	var active atomic.Int64
	p := &pipe{down: c, dst: dst, what: dst.String() + " (" + s.model.Host + ")", busy: func() bool { return active.Load() > 0 }}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		c.Close()
		return
	}
	s.conns[p] = struct{}{}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.conns, p)
		s.mu.Unlock()
		p.close()
	}()
	m := s.model
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(m.URL)
			pr.Out.Host = m.URL.Host
			pr.Out.Header.Del("Authorization")
			if m.Key != "" {
				pr.Out.Header.Set("Authorization", "Bearer "+m.Key)
			}
		},
		Transport:     m.client,
		FlushInterval: -1, // streamed answers (SSE) pass at once
		ErrorLog:      nil,
	}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		active.Add(1)
		defer active.Add(-1)
		rp.ServeHTTP(w, r)
	})
	cc := &countConn{TCPConn: c, r: io.MultiReader(bytesReader(head), c), in: &s.bytesOut, out: &s.bytesIn}
	l := &oneConn{c: cc, done: make(chan struct{})}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: time.Minute, IdleTimeout: 10 * time.Minute,
		ConnState: func(_ net.Conn, st http.ConnState) {
			if st == http.StateClosed || st == http.StateHijacked {
				l.close()
			}
		}}
	srv.Serve(l)
	srv.Shutdown(context.Background())
}

func bytesReader(b []byte) io.Reader { return bufio.NewReader(&sliceReader{b: b}) }

type sliceReader struct{ b []byte }

func (r *sliceReader) Read(p []byte) (int, error) {
	if len(r.b) == 0 {
		return 0, io.EOF
	}
	n := copy(p, r.b)
	r.b = r.b[n:]
	return n, nil
}

// countConn reads what peek took first, and counts bytes both ways.
type countConn struct {
	*net.TCPConn
	r       io.Reader
	in, out *atomic.Int64
}

func (c *countConn) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.in.Add(int64(n))
	return n, err
}

func (c *countConn) Write(p []byte) (int, error) {
	n, err := c.TCPConn.Write(p)
	c.out.Add(int64(n))
	return n, err
}

// oneConn is a listener that accepts one connection, then waits for it to close.
type oneConn struct {
	c    net.Conn
	once sync.Once
	took atomic.Bool
	done chan struct{}
}

func (l *oneConn) Accept() (net.Conn, error) {
	if l.took.CompareAndSwap(false, true) {
		return l.c, nil
	}
	<-l.done
	return nil, net.ErrClosed
}

func (l *oneConn) close()         { l.once.Do(func() { close(l.done) }) }
func (l *oneConn) Close() error   { l.close(); return nil }
func (l *oneConn) Addr() net.Addr { return l.c.LocalAddr() }
