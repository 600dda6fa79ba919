package api

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"

	"deltabox/internal/errdefs"
	"deltabox/internal/portproxy"
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
	portproxy.Serve(w, r, portproxy.Target{
		Dial: func(ctx context.Context) (net.Conn, error) { return s.m.DialPort(ctx, id, port) },
		Path: "/" + strings.TrimPrefix(r.PathValue("path"), "/"),
		Host: "127.0.0.1:" + strconv.Itoa(port),
		Err: func(w http.ResponseWriter, err error) {
			if !errors.Is(err, errdefs.ErrUnavailable) && !errors.Is(err, errdefs.ErrNotFound) && !errors.Is(err, errdefs.ErrConflict) {
				err = fmt.Errorf("sandbox %s port %d: %v: %w", id, port, err, errdefs.ErrUnavailable)
			}
			writeErr(w, err)
		},
	})
}
