package api

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httputil"
	"strconv"
	"strings"

	"deltabox/internal/errdefs"
)

// portsRoutes registers ANY /v1/sandboxes/{id}/ports/{port}/{path...}: an HTTP request
// to a server listening inside the sandbox, proxied by the daemon (docs/API.md, Ports).
// The daemon connects from a thread in the sandbox's network namespace
// (state.Manager.DialPort), so the sandbox's network is never opened to the host;
// upgrades (WebSocket) pass through.
func (s *Server) portsRoutes() {
	s.mux.HandleFunc("/v1/sandboxes/{id}/ports/{port}/{path...}", s.port)
}

func (s *Server) port(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	port, err := strconv.Atoi(r.PathValue("port"))
	if err != nil || port < 1 || port > 65535 {
		writeErr(w, fmt.Errorf("port %q: want 1-65535: %w", r.PathValue("port"), errdefs.ErrInvalid))
		return
	}
	// Fail before proxying when nothing listens: a clear error rather than a 502 page.
	first, err := s.m.DialPort(r.Context(), id, port)
	if err != nil {
		writeErr(w, err)
		return
	}
	firstc := make(chan net.Conn, 1)
	firstc <- first
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.Out.URL.Scheme, pr.Out.URL.Host = "http", "127.0.0.1:"+strconv.Itoa(port)
			pr.Out.URL.Path = "/" + strings.TrimPrefix(r.PathValue("path"), "/")
			pr.Out.URL.RawPath = ""
			pr.Out.Host = pr.Out.URL.Host
		},
		Transport: &http.Transport{DisableKeepAlives: true, DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			select {
			case c := <-firstc:
				return c, nil
			default:
				return s.m.DialPort(ctx, id, port)
			}
		}},
		ErrorHandler: func(w http.ResponseWriter, _ *http.Request, err error) {
			writeErr(w, fmt.Errorf("sandbox %s port %d: %v: %w", id, port, err, errdefs.ErrUnavailable))
		},
	}
	defer func() {
		select {
		case c := <-firstc:
			_ = c.Close()
		default:
		}
	}()
	rp.ServeHTTP(w, r)
}
