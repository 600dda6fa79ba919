package client

import (
	"crypto/tls"
	"net/http"
	"net/url"
	"time"
)

// NewRemote returns a client for a daemon's TCP listener (`deltabox daemon --listen`)
// at base (http://HOST:PORT or https://HOST:PORT), sending key as a bearer token.
// Requests keep their paths; only the scheme and host change.
func NewRemote(base, key string) *Client {
	u, err := url.Parse(base)
	if err != nil || u.Host == "" {
		u = &url.URL{Scheme: "http", Host: base}
	}
	t := &http.Transport{Proxy: http.ProxyFromEnvironment, MaxIdleConnsPerHost: 16, IdleConnTimeout: 90 * time.Second,
		TLSClientConfig: &tls.Config{MinVersion: tls.VersionTLS12}, TLSHandshakeTimeout: 10 * time.Second}
	return &Client{Socket: u.String(), hc: &http.Client{Transport: &remoteTransport{base: u, key: key, rt: t}}}
}

type remoteTransport struct {
	base *url.URL
	key  string
	rt   http.RoundTripper
}

func (t *remoteTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	r := req.Clone(req.Context())
	r.URL.Scheme, r.URL.Host, r.Host = t.base.Scheme, t.base.Host, t.base.Host
	if t.key != "" {
		r.Header.Set("Authorization", "Bearer "+t.key)
	}
	return t.rt.RoundTrip(r)
}

func (t *remoteTransport) CloseIdleConnections() {
	if c, ok := t.rt.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}
