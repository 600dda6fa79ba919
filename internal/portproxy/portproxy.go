// Package portproxy forwards an HTTP request to a server listening inside a sandbox,
// over a connection the caller dials (state.Manager.DialPort: from a daemon thread in
// the sandbox's network namespace, to its 127.0.0.1), so that a sandbox's service is
// reached without any route between the host and the sandbox. Both of the daemon's
// port routes use it: DeltaBox's /v1/sandboxes/{id}/ports/{port}/... (package api) and
// E2B's getHost(port) names, PORT-SANDBOXID.DOMAIN (package e2b).
//
// One upstream connection per request, closed after its answer: between requests the
// sandbox holds no connection to the daemon, so a checkpoint finds none (the fast path
// refuses a connected socket, and CRIU, which carries a listening server, is not given
// established ones: a kept-alive upstream failed the dump). The client's own connection
// to the daemon stays kept-alive;
// the dial costs a thread's setns into the namespace and back. An upgrade (WebSocket)
// is passed through: httputil.ReverseProxy then copies both ways until either side
// closes.
package portproxy

import (
	"context"
	"net"
	"net/http"
	"net/http/httputil"
)

// Target is where a request goes and how it is rewritten.
type Target struct {
	// Dial connects to the server inside the sandbox; its error is answered by Err.
	Dial func(ctx context.Context) (net.Conn, error)
	// Path replaces the request's path when not "" (the native route's tail); the
	// query is kept either way.
	Path string
	// Host replaces the Host header when not "" (the E2B route keeps the client's, as
	// E2B's edge does: dev servers check it).
	Host string
	// Err answers a failed dial, before or during proxying.
	Err func(w http.ResponseWriter, err error)
}

// Serve proxies r to t. The first dial is made before anything is sent, so that a
// port nothing listens on gets t.Err's answer rather than a generic 502 page.
func Serve(w http.ResponseWriter, r *http.Request, t Target) {
	first, err := t.Dial(r.Context())
	if err != nil {
		t.Err(w, err)
		return
	}
	firstc := make(chan net.Conn, 1)
	firstc <- first
	defer func() {
		select {
		case c := <-firstc:
			c.Close()
		default:
		}
	}()
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.Out.URL.Scheme, pr.Out.URL.Host = "http", "sandbox" // never resolved: Dial below
			if t.Path != "" {
				pr.Out.URL.Path, pr.Out.URL.RawPath = t.Path, ""
			}
			pr.Out.Host = pr.In.Host
			if t.Host != "" {
				pr.Out.Host = t.Host
			}
		},
		Transport: &http.Transport{DisableKeepAlives: true, DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			select {
			case c := <-firstc:
				return c, nil
			default:
				return t.Dial(ctx)
			}
		}},
		ErrorHandler: func(w http.ResponseWriter, _ *http.Request, err error) { t.Err(w, err) },
	}
	rp.ServeHTTP(w, r)
}
