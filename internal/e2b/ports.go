package e2b

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"

	"deltabox/internal/errdefs"
	"deltabox/internal/portproxy"
)

// TrafficHeader carries a sandbox's trafficAccessToken on requests to its ports, as
// E2B's edge takes it for a sandbox created with allowPublicTraffic: false. DeltaBox's
// ports are never public: every request shows this token or an API key.
const TrafficHeader = "E2b-Traffic-Access-Token"

// PortHost parses the host E2B's SDK gives for a sandbox's port, getHost(port):
// "PORT-SANDBOXID.DOMAIN" (E2B's packages/js-sdk/src/connectionConfig.ts), with any
// DOMAIN (the SDK's E2B_DOMAIN: a wildcard name pointed at this daemon) and any
// ":port" of the listener. The first DNS label decides, so no address of the control
// plane (an IP, a name without "PORT-" in front) is taken for one; a sandbox id with a
// dot cannot be named this way (a DNS label has none): the native ports route reaches
// it.
func PortHost(host string) (port int, id string, ok bool) {
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	label, _, dotted := strings.Cut(strings.ToLower(host), ".")
	p, id, dashed := strings.Cut(label, "-")
	if !dotted || !dashed || id == "" || len(p) == 0 || len(p) > 5 || strings.Trim(p, "0123456789") != "" {
		return 0, "", false
	}
	port, _ = strconv.Atoi(p)
	if port < 1 || port > 65535 {
		return 0, "", false
	}
	return port, id, true
}

// IsPort reports whether r is for a sandbox's port (its Host is a getHost name).
func IsPort(r *http.Request) bool {
	_, _, ok := PortHost(r.Host)
	return ok
}

// PortTokenOK reports whether r, a request for a sandbox's port, carries that
// sandbox's trafficAccessToken, handed out under an API key still valid: one
// sandbox's token opens no other's ports, and no envd.
func (s *Server) PortTokenOK(r *http.Request) bool {
	_, id, ok := PortHost(r.Host)
	t := r.Header.Get(TrafficHeader)
	if !ok || t == "" {
		return false
	}
	b, err := s.box(id)
	if err != nil || subtle.ConstantTimeCompare([]byte(t), []byte(b.traffic)) != 1 {
		return false
	}
	return s.tokenKeyValid(b)
}

// servePort proxies r to port inside sandbox id (package portproxy), path, query and
// Host as the client sent them. Answers, as E2B's edge gives them where it has one:
// 404 for a sandbox that does not exist, 502 for a paused one and for a port nothing
// listens on (naming the port).
func (s *Server) servePort(w http.ResponseWriter, r *http.Request, port int, id string) {
	b, err := s.box(id)
	if err != nil {
		if errors.Is(err, errdefs.ErrNotFound) {
			err = fmt.Errorf("sandbox %s not found (a getHost name is PORT-SANDBOXID.DOMAIN): %w", id, err)
		}
		apiErr(w, err)
		return
	}
	b.mu.Lock()
	paused := b.paused != ""
	b.mu.Unlock()
	if paused {
		writeJSON(w, 502, apiError{Code: 502, Message: fmt.Sprintf("sandbox %s is paused: resume it with Sandbox.connect to reach port %d", id, port)})
		return
	}
	// The daemon's credentials, not the service's: the gateway removed the key that let
	// the request in; an X-API-Key that did not (revoked, another's) goes too.
	r.Header.Del(TrafficHeader)
	r.Header.Del("X-API-Key")
	portproxy.Serve(w, r, portproxy.Target{
		Dial: func(ctx context.Context) (net.Conn, error) { return s.m.DialPort(ctx, id, port) },
		Err: func(w http.ResponseWriter, err error) {
			if errors.Is(err, errdefs.ErrNotFound) {
				apiErr(w, err)
				return
			}
			if !errors.Is(err, errdefs.ErrUnavailable) {
				err = fmt.Errorf("sandbox %s port %d: %v", id, port, err)
			}
			// E2B's edge answers 502 for a port nothing serves.
			writeJSON(w, 502, apiError{Code: 502, Message: err.Error()})
		},
	})
}
