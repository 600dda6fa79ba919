// Package gateway is the daemon's TCP listener (`deltabox daemon --listen ADDR`): both
// APIs, DeltaBox's own (/v1/...) and E2B's (package e2b), for clients on other
// machines, behind API keys (package auth) and, given a certificate, TLS.
//
// What lets a request in:
//   - an API key, as E2B's control plane takes it (X-API-Key) or as a bearer token
//     (Authorization: Bearer KEY: the CLI and the Python client with DELTABOX_API_KEY);
//   - or, for envd traffic only (a request naming its sandbox in E2b-Sandbox-Id), that
//     sandbox's access token (X-Access-Token), which only a key holder got from the
//     control plane;
//   - or, for a sandbox's port (Host PORT-SANDBOXID.DOMAIN, E2B's getHost), that
//     sandbox's traffic token (e2b-traffic-access-token), likewise handed out.
//
// The key is removed from the request once checked, so no handler, and no server in a
// sandbox behind a port, sees it.
//
// With a certificate, TLS offers HTTP/2 and HTTP/1.1 (E2B's SDK takes HTTP/2 when
// offered: its streams then share connections). Anything else is a 401 before any
// handler runs, and the connection is closed after it (Connection: close; a GOAWAY on
// HTTP/2), so that a peer without a key holds no connection by keep-alive. Abuse over
// the network meets the limits a local client meets, and these: headers 64 KiB and 10 s
// to arrive, bodies 80 MiB (a 64 MiB file write and its framing; JSON routes cap their
// own lower), a connection that has not shown a valid key within 10 s of its accept (TLS
// handshake included) is closed, an authenticated one idle for 2 minutes is closed, 64
// connections at once per remote IP (more are closed at accept: one peer cannot take
// the slots of the others) and 1024 in all (more wait in the kernel's accept queue).
package gateway

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/netutil"

	"deltabox/internal/apitypes"
	"deltabox/internal/auth"
)

// Limits of the TCP listener.
const (
	maxHeader   = 64 << 10
	maxBody     = 80 << 20
	idleTimeout = 2 * time.Minute
	headerWait  = 10 * time.Second
	preAuthWait = 10 * time.Second // from accept to the first request with a valid key
	maxConns    = 1024
	maxConnsIP  = 64
)

// Config is what the listener serves.
type Config struct {
	Addr              string
	CertFile, KeyFile string // both, or neither (plain HTTP)
	Keys              *auth.Store
	Native            http.Handler // DeltaBox's API (/v1/...)
	E2B               http.Handler // E2B's control plane and envd
	// EnvdToken reports whether an envd request carries its sandbox's access token.
	EnvdToken func(*http.Request) bool
	IsEnvd    func(*http.Request) bool
	// IsPort reports whether a request is for a sandbox's port (E2B's getHost name in
	// Host: it goes to E2B's handler whatever its path), PortToken whether it carries
	// that sandbox's traffic token.
	IsPort    func(*http.Request) bool
	PortToken func(*http.Request) bool
	Log       *slog.Logger
}

// Handler is the authenticated router of the listener.
func (c *Config) Handler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		port := c.IsPort(r)
		native := !port && strings.HasPrefix(r.URL.Path, "/"+apitypes.Version+"/")
		key, ok := c.allowed(r, native, port)
		if !ok {
			c.Log.Debug("gateway: refused a request without a valid key", "remote", r.RemoteAddr, "method", r.Method, "host", r.Host, "path", r.URL.Path)
			if port {
				forbidden(w)
			} else {
				unauthorized(w, native)
			}
			return
		}
		if gc, ok := r.Context().Value(connKey{}).(*conn); ok {
			gc.authenticated()
		}
		if r.Method != "POST" || r.URL.Path != "/"+apitypes.Version+"/nodes/import" || port { // bounded by its handler
			r.Body = http.MaxBytesReader(w, r.Body, maxBody)
		}
		var kh string // "": let in by a sandbox's token
		if key != "" {
			kh = auth.Hash(key)
			stripKey(r.Header, key)
		}
		r = r.WithContext(auth.WithRemote(r.Context(), kh)) // host-path routes refuse it
		if native {
			c.Native.ServeHTTP(w, r)
			return
		}
		c.E2B.ServeHTTP(w, r)
	})
}

// keyOf is the API key r shows, "" for none.
func keyOf(r *http.Request) string {
	key := r.Header.Get("X-API-Key")
	if k, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); ok && key == "" {
		key = k
	}
	return key
}

// stripKey removes the API key from h once it let the request in: no handler reads it
// (they have auth.RemoteKey), and a request proxied into a sandbox (its ports) must not
// hand the key to the code there. An Authorization header that is not the key (an
// application's own, on a port request) stays.
func stripKey(h http.Header, key string) {
	h.Del("X-API-Key")
	if h.Get("Authorization") == "Bearer "+key {
		h.Del("Authorization")
	}
}

// allowed reports whether r may go on, and the API key that let it in ("": a token).
func (c *Config) allowed(r *http.Request, native, port bool) (string, bool) {
	if key := keyOf(r); key != "" {
		if _, ok := c.Keys.Check(key); ok {
			return key, true
		}
		if !port { // a port request's Authorization may be its application's own
			return "", false
		}
	}
	switch {
	case port:
		return "", c.PortToken(r)
	case native:
		return "", false
	default:
		return "", c.IsEnvd(r) && c.EnvdToken(r)
	}
}

// forbidden answers a port request without its sandbox's traffic token or a key (E2B's
// edge answers 403 there).
func forbidden(w http.ResponseWriter) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Connection", "close")
	w.WriteHeader(403)
	json.NewEncoder(w).Encode(map[string]any{"code": 403, "message": "a sandbox's port needs its traffic access token " +
		"(header e2b-traffic-access-token: sandbox.trafficAccessToken, from create or connect) or an API key (X-API-Key)"})
}

func unauthorized(w http.ResponseWriter, native bool) {
	msg := "no valid API key: send one (X-API-Key: KEY, or Authorization: Bearer KEY; E2B_API_KEY, DELTABOX_API_KEY); the host's root makes them with `deltabox key create NAME`"
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("WWW-Authenticate", `Bearer realm="deltabox"`)
	w.Header().Set("Connection", "close") // no keep-alive for a peer without a key
	w.WriteHeader(401)
	if native {
		var b apitypes.ErrorBody
		b.Error.Code, b.Error.Message = "unauthorized", msg
		json.NewEncoder(w).Encode(b)
		return
	}
	json.NewEncoder(w).Encode(map[string]any{"code": 401, "message": msg})
}

// Listen serves c on its address until ctx ends. ready, if set, is called with the
// bound address once the listener accepts.
func (c *Config) Listen(ctx context.Context, ready func(net.Addr)) error {
	if (c.CertFile == "") != (c.KeyFile == "") {
		return fmt.Errorf("TLS needs both --tls-cert and --tls-key")
	}
	l, err := net.Listen("tcp", c.Addr)
	if err != nil {
		return fmt.Errorf("listen on %s: %w", c.Addr, err)
	}
	l = newPerIPListener(netutil.LimitListener(l, maxConns), maxConnsIP, preAuthWait, c.Log)
	srv := &http.Server{Handler: c.Handler(), ReadHeaderTimeout: headerWait, IdleTimeout: idleTimeout, MaxHeaderBytes: maxHeader,
		ErrorLog: slog.NewLogLogger(c.Log.Handler(), slog.LevelDebug), ConnContext: connContext}
	if c.CertFile != "" {
		cert, err := tls.LoadX509KeyPair(c.CertFile, c.KeyFile)
		if err != nil {
			l.Close()
			return fmt.Errorf("TLS certificate %s and key %s: %w", c.CertFile, c.KeyFile, err)
		}
		srv.TLSConfig = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12, NextProtos: []string{"h2", "http/1.1"}}
		l = tls.NewListener(l, srv.TLSConfig)
	}
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		srv.Shutdown(sctx)
	}()
	if ready != nil {
		ready(l.Addr())
	}
	err = srv.Serve(l)
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}

type connKey struct{}

// connContext puts the listener's conn (under TLS, the conn TLS runs on) in the
// context of its requests, for the handler to mark it authenticated.
func connContext(ctx context.Context, nc net.Conn) context.Context {
	if tc, ok := nc.(*tls.Conn); ok {
		nc = tc.NetConn()
	}
	if gc, ok := nc.(*conn); ok {
		return context.WithValue(ctx, connKey{}, gc)
	}
	return ctx
}

// perIPListener closes, at accept, a connection from a remote IP that already has max
// open, and gives each connection preAuth to show a valid key: http.Server's timeouts
// are per request (ReadHeaderTimeout) or between requests (IdleTimeout), so without
// this a peer without a key could keep a connection by sending a request every few
// seconds.
type perIPListener struct {
	net.Listener
	max     int
	preAuth time.Duration
	log     *slog.Logger

	mu sync.Mutex
	// +checklocks:mu
	open map[string]int
}

func newPerIPListener(l net.Listener, max int, preAuth time.Duration, log *slog.Logger) *perIPListener {
	return &perIPListener{Listener: l, max: max, preAuth: preAuth, log: log, open: map[string]int{}}
}

func (l *perIPListener) Accept() (net.Conn, error) {
	for {
		nc, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		ip := nc.RemoteAddr().String()
		if h, _, err := net.SplitHostPort(ip); err == nil {
			ip = h
		}
		l.mu.Lock()
		full := l.open[ip] >= l.max
		if !full {
			l.open[ip]++
		}
		l.mu.Unlock()
		if full {
			l.log.Debug("gateway: refused a connection over the per-IP cap", "remote", ip, "max", l.max)
			nc.Close()
			continue
		}
		c := &conn{Conn: nc, l: l, ip: ip}
		c.timer = time.AfterFunc(l.preAuth, c.expire)
		return c, nil
	}
}

func (l *perIPListener) release(ip string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.open[ip]--; l.open[ip] <= 0 {
		delete(l.open, ip)
	}
}

// conn is one accepted connection: counted under its IP until closed, and closed at
// preAuth unless a request on it showed a valid key by then.
type conn struct {
	net.Conn
	l     *perIPListener
	ip    string
	timer *time.Timer
	authd atomic.Bool
	once  sync.Once
}

func (c *conn) authenticated() {
	if !c.authd.Swap(true) {
		c.timer.Stop()
	}
}

func (c *conn) expire() {
	if !c.authd.Load() {
		c.l.log.Debug("gateway: closed a connection that showed no valid key in time", "remote", c.ip, "after", c.l.preAuth)
		c.Close()
	}
}

func (c *conn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() {
		c.timer.Stop()
		c.l.release(c.ip)
	})
	return err
}
