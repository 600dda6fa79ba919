package e2b

import "testing"

// TestPortHost: getHost's names are parsed whatever the domain and listener port; the
// control plane's hosts (IPs, api.DOMAIN, localhost) and malformed ports are not.
func TestPortHost(t *testing.T) {
	for _, c := range []struct {
		host string
		port int
		id   string
	}{
		{"8000-sb-1a2b.e2b.app", 8000, "sb-1a2b"},
		{"3000-My-Box.deltabox.test:40319", 3000, "my-box"},
		{"65535-x.d", 65535, "x"},
		{"49983-abc.sandbox.example.com:443", 49983, "abc"},
	} {
		port, id, ok := PortHost(c.host)
		if !ok || port != c.port || id != c.id {
			t.Errorf("PortHost(%q) = %d, %q, %v; want %d, %q", c.host, port, id, ok, c.port, c.id)
		}
	}
	for _, h := range []string{"127.0.0.1:8080", "[::1]:8080", "localhost", "api.e2b.app", "8000-x", "8000-.d",
		"-x.d", "0-x.d", "65536-x.d", "123456-x.d", "80a-x.d", "x-8000.d", "+80-x.d", ""} {
		if port, id, ok := PortHost(h); ok {
			t.Errorf("PortHost(%q) = %d, %q: want no port route", h, port, id)
		}
	}
}
