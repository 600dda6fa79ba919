package netproxy

import (
	"crypto/tls"
	"net"
	"net/netip"
	"testing"
	"time"
)

func TestPolicy(t *testing.T) {
	p, err := ParsePolicy([]string{"pypi.org", "*.github.com", "10.0.0.0/8", "1.2.3.4"}, []string{"evil.github.com", "10.9.0.0/16"}, false)
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]bool{
		"pypi.org": true, "PyPI.org.": true, "files.pypi.org": false, "api.github.com": true, "github.com": false,
		"evil.github.com": false, "a.evil.github.com": true, "example.com": false, "": false,
	} {
		if got := p.AllowsName(name); got != want {
			t.Errorf("AllowsName(%q) = %v, want %v", name, got, want)
		}
	}
	for a, want := range map[string]bool{"10.1.2.3": true, "10.9.1.1": false, "1.2.3.4": true, "1.2.3.5": false, "::ffff:10.1.2.3": true} {
		if got := p.AllowsAddr(netip.MustParseAddr(a)); got != want {
			t.Errorf("AllowsAddr(%s) = %v, want %v", a, got, want)
		}
	}
	for _, bad := range [][]string{{}, {"exa mple.com"}, {"10.0.0.0/40"}, {"*."}, {"a..b"}} {
		if _, err := ParsePolicy(bad, nil, false); err == nil {
			t.Errorf("ParsePolicy(%q) accepted", bad)
		}
	}
	if _, err := ParsePolicy(nil, nil, true); err != nil {
		t.Errorf("a model endpoint alone: %v", err)
	}
}

func TestClientNameReadsSNIAndHost(t *testing.T) {
	// A real ClientHello, as crypto/tls writes it.
	c1, c2 := net.Pipe()
	go tls.Client(c1, &tls.Config{ServerName: "api.example.test", InsecureSkipVerify: true}).Handshake()
	c2.SetReadDeadline(time.Now().Add(5 * time.Second))
	var head []byte
	buf := make([]byte, 4096)
	for {
		n, err := c2.Read(buf)
		head = append(head, buf[:n]...)
		name, st := clientName(head)
		if st == complete {
			if name != "api.example.test" {
				t.Errorf("SNI: %q", name)
			}
			break
		}
		if err != nil || st == opaque {
			t.Fatalf("ClientHello not read: state %v, err %v", st, err)
		}
	}
	c1.Close()
	c2.Close()
	for in, want := range map[string]string{
		"GET / HTTP/1.1\r\nHost: example.test:8080\r\nAccept: */*\r\n\r\n": "example.test",
		"POST /x HTTP/1.1\r\nhost: [::1]:80\r\n\r\n":                       "::1",
		"GET / HTTP/1.0\r\n\r\n":                                           "",
	} {
		if name, st := clientName([]byte(in)); st != complete || name != want {
			t.Errorf("%q: %q %v, want %q", in, name, st, want)
		}
	}
	if _, st := clientName([]byte("GET / HTTP/1.1\r\nHost: a")); st != needMore {
		t.Errorf("partial headers: %v", st)
	}
	if _, st := clientName([]byte("SSH-2.0-OpenSSH\r\n")); st != opaque {
		t.Errorf("ssh banner: %v", st)
	}
}
