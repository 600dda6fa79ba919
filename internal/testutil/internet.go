package testutil

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/dns/dnsmessage"
	"golang.org/x/sys/unix"

	"deltabox/internal/netns"
)

// Internet plays the internet for network tests: a network namespace the test makes,
// joined to the host's by a veth pair, holding HTTP(S) servers at several addresses
// and a DNS server that maps test names to them. The host reaches it through the
// veth's route, as the daemon's proxy reaches real hosts.
type Internet struct {
	NS   string     // the namespace's name (ip netns)
	Host netip.Addr // the host's end of the veth (an address of the host)
	// Allowed, Denied and Raw serve HTTP on :80 (Allowed and Denied HTTPS on :443),
	// answering "allowed", "denied", "raw" (after 1.5 s at /slow); Raw echoes UDP on :7 and answers ping; Metadata is 169.254.169.254 (a cloud's metadata
	// server), answering "metadata"; DNS is the name server at :53.
	Allowed  netip.Addr
	Denied   netip.Addr
	Raw      netip.Addr
	DNS      netip.Addr
	Metadata netip.Addr
	// ModelKey is the key the model at http://allowed.test/v1/ wants (random).
	ModelKey string
	// Names maps the names the DNS server knows to their addresses.
	Names map[string]netip.Addr

	mu sync.Mutex
	// +checklocks:mu
	queries []string // names the DNS server was asked, in order
	// +checklocks:mu
	dirs map[string]string // first path element -> directory served (ServeDir)
}

// lockInternet holds, until t's cleanup, the host-wide lock of the test internets: each
// routes 169.254.169.254/32 (its metadata server) on the host, which one internet at
// a time can, and the e2e and security packages run at once ("ip route add
// 169.254.169.254/32: File exists", CI on this machine). It waits at most 5 minutes.
func lockInternet(t testing.TB) {
	t.Helper()
	f, err := os.OpenFile("/run/deltabox-test-internet.lock", os.O_CREATE|os.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		t.Fatalf("the test internets' lock: %v", err)
	}
	for end := time.Now().Add(5 * time.Minute); ; time.Sleep(50 * time.Millisecond) {
		err = unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			break
		}
		if err != unix.EWOULDBLOCK || time.Now().After(end) {
			f.Close()
			t.Fatalf("the test internets' lock (/run/deltabox-test-internet.lock, held by another test process's internet): %v", err)
		}
	}
	t.Cleanup(func() { f.Close() }) // the flock goes with the file
}

// NewInternet makes the namespace and its servers; t's cleanup removes them.
func NewInternet(t testing.TB) *Internet {
	t.Helper()
	_, err := exec.LookPath("ip")
	Require(t, err == nil, "iproute2's ip is needed to make the test's internet (apt-get install iproute2)")
	Require(t, os.Geteuid() == 0, "making network namespaces needs root")
	lockInternet(t)
	var rb [2]byte
	rand.Read(rb[:])
	sub := 64 + int(rb[0])%64 // 100.64.0.0/10 (shared address space), one /24 per test
	third := int(rb[1])
	tag := fmt.Sprintf("%02x%02x", rb[0], rb[1])
	in := &Internet{NS: "dbxinet" + tag, Names: map[string]netip.Addr{}}
	var kb [16]byte
	rand.Read(kb[:])
	in.ModelKey = fmt.Sprintf("sk-test-%x", kb)
	addr := func(last int) netip.Addr { return netip.AddrFrom4([4]byte{100, byte(sub), byte(third), byte(last)}) }
	in.Host, in.Allowed, in.Denied, in.Raw, in.DNS = addr(1), addr(2), addr(3), addr(4), addr(5)
	in.Metadata = netip.MustParseAddr("169.254.169.254")
	in.Names["allowed.test"] = in.Allowed
	in.Names["www.wild.test"] = in.Allowed
	in.Names["denied.test"] = in.Denied
	in.Names["secret.allowed.test"] = in.Denied
	in.Names["loop.test"] = netip.MustParseAddr("127.0.0.1")
	in.Names["meta.test"] = in.Metadata
	in.Names["hostsvc.test"] = in.Host
	hostIf, inIf := "dbxh"+tag, "dbxi"+tag
	run := func(args ...string) {
		t.Helper()
		if out, err := Command(t, time.Minute, "ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	run("netns", "add", in.NS)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		exec.CommandContext(ctx, "ip", "link", "del", hostIf).Run()
		exec.CommandContext(ctx, "ip", "netns", "del", in.NS).Run()
	})
	run("link", "add", hostIf, "type", "veth", "peer", "name", inIf, "netns", in.NS)
	run("addr", "add", in.Host.String()+"/24", "dev", hostIf)
	run("link", "set", hostIf, "up")
	run("route", "add", in.Metadata.String()+"/32", "dev", hostIf)
	run("-n", in.NS, "link", "set", "lo", "up")
	for _, a := range []netip.Addr{in.Allowed, in.Denied, in.Raw, in.DNS} {
		run("-n", in.NS, "addr", "add", a.String()+"/24", "dev", inIf)
	}
	run("-n", in.NS, "addr", "add", in.Metadata.String()+"/32", "dev", inIf)
	run("-n", in.NS, "link", "set", inIf, "up")
	run("-n", in.NS, "route", "add", "default", "dev", inIf)

	f, err := os.Open("/run/netns/" + in.NS)
	if err != nil {
		t.Fatalf("open the test's namespace: %v", err)
	}
	defer f.Close()
	nsFD := int(f.Fd())
	serve := func(a netip.Addr, port uint16, body string, tlsName string) {
		t.Helper()
		var l net.Listener
		err := netns.In(nsFD, func() (err error) {
			l, err = net.Listen("tcp4", netip.AddrPortFrom(a, port).String())
			return err
		})
		if err != nil {
			t.Fatalf("listen in the test's internet: %v", err)
		}
		if tlsName != "" {
			l = tls.NewListener(l, &tls.Config{Certificates: []tls.Certificate{selfSigned(t, tlsName)}})
		}
		srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			in.mu.Lock()
			dir := in.dirs[strings.SplitN(strings.TrimPrefix(r.URL.Path, "/"), "/", 2)[0]]
			in.mu.Unlock()
			if dir != "" {
				http.StripPrefix("/"+strings.SplitN(strings.TrimPrefix(r.URL.Path, "/"), "/", 2)[0], http.FileServer(http.Dir(dir))).ServeHTTP(w, r)
				return
			}
			if r.URL.Path == "/slow" { // an answer that takes 1.5 s: a request in flight
				time.Sleep(1500 * time.Millisecond)
			}
			if strings.HasPrefix(r.URL.Path, "/v1/") { // the model: its key or 401
				if r.Header.Get("Authorization") != "Bearer "+in.ModelKey {
					http.Error(w, "unauthorized", http.StatusUnauthorized)
					return
				}
				fmt.Fprint(w, "authorized "+r.URL.Path)
				return
			}
			fmt.Fprint(w, body)
		}), ReadHeaderTimeout: 10 * time.Second}
		go srv.Serve(l)
		t.Cleanup(func() { srv.Close() })
	}
	serve(in.Allowed, 80, "allowed", "")
	serve(in.Allowed, 443, "allowed-tls", "allowed.test")
	serve(in.Denied, 80, "denied", "")
	serve(in.Denied, 443, "denied-tls", "denied.test")
	serve(in.Raw, 80, "raw", "")
	serve(in.Metadata, 80, "metadata", "")

	var echo *net.UDPConn // UDP echo at Raw:7
	err = netns.In(nsFD, func() (err error) {
		echo, err = net.ListenUDP("udp4", net.UDPAddrFromAddrPort(netip.AddrPortFrom(in.Raw, 7)))
		return err
	})
	if err != nil {
		t.Fatalf("UDP echo in the test's internet: %v", err)
	}
	t.Cleanup(func() { echo.Close() })
	go func() {
		buf := make([]byte, 1500)
		for {
			n, from, err := echo.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			echo.WriteToUDPAddrPort(buf[:n], from)
		}
	}()

	var dns *net.UDPConn
	err = netns.In(nsFD, func() (err error) {
		dns, err = net.ListenUDP("udp4", net.UDPAddrFromAddrPort(netip.AddrPortFrom(in.DNS, 53)))
		return err
	})
	if err != nil {
		t.Fatalf("DNS server in the test's internet: %v", err)
	}
	t.Cleanup(func() { dns.Close() })
	go in.serveDNS(dns)
	return in
}

// ServeDir serves dir's files at /name/ on every HTTP(S) server of the internet.
func (in *Internet) ServeDir(name, dir string) {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.dirs == nil {
		in.dirs = map[string]string{}
	}
	in.dirs[name] = dir
}

// DNSAddr is the DNS server's address, for the daemon's DELTABOX_NET_DNS.
func (in *Internet) DNSAddr() string { return netip.AddrPortFrom(in.DNS, 53).String() }

// Queries are the names the DNS server was asked so far.
func (in *Internet) Queries() []string {
	in.mu.Lock()
	defer in.mu.Unlock()
	return append([]string(nil), in.queries...)
}

func (in *Internet) serveDNS(c *net.UDPConn) {
	buf := make([]byte, 1500)
	for {
		n, from, err := c.ReadFromUDPAddrPort(buf)
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		var p dnsmessage.Parser
		h, err := p.Start(buf[:n])
		if err != nil {
			continue
		}
		q, err := p.Question()
		if err != nil {
			continue
		}
		name := strings.TrimSuffix(strings.ToLower(q.Name.String()), ".")
		in.mu.Lock()
		in.queries = append(in.queries, name)
		in.mu.Unlock()
		rh := dnsmessage.Header{ID: h.ID, Response: true, Authoritative: true}
		a, ok := in.Names[name]
		if !ok {
			rh.RCode = dnsmessage.RCodeNameError
		}
		b := dnsmessage.NewBuilder(nil, rh)
		b.StartQuestions()
		b.Question(q)
		b.StartAnswers()
		if ok && q.Type == dnsmessage.TypeA {
			b.AResource(dnsmessage.ResourceHeader{Name: q.Name, Class: dnsmessage.ClassINET, TTL: 5}, dnsmessage.AResource{A: a.As4()})
		}
		if resp, err := b.Finish(); err == nil {
			c.WriteToUDPAddrPort(resp, from)
		}
	}
}

func selfSigned(t testing.TB, name string) tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: name}, DNSNames: []string{name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

// NetProbe is a python3 program (the default image has no curl) that tries one way out
// of a sandbox and prints "OK <what came back>" or "ERR <why>" on one line:
//
//	get URL [HOST]        urllib GET (HOST: a Host header of its own; TLS unverified)
//	tcp IP PORT [HOST]    a plain socket: GET / with Host HOST, the first bytes back
//	tls IP PORT SNI       a TLS handshake naming SNI, then GET / (unverified)
//	udp IP PORT           a datagram, and a reply within 2 s
//	dns NAME              getaddrinfo, through the sandbox's resolv.conf
//	dnsat IP NAME         an A query sent to IP:53 directly
//	raw IP                an ICMP echo on a raw socket, and a reply within 2 s
const NetProbe = `
import socket, ssl, struct, sys, urllib.request
def main(a):
    if a[0] == "get":
        req = urllib.request.Request(a[1])
        if len(a) > 2: req.add_header("Host", a[2])
        ctx = ssl._create_unverified_context()
        return urllib.request.urlopen(req, timeout=8, context=ctx).read().decode()
    if a[0] == "tcp":
        s = socket.create_connection((a[1], int(a[2])), timeout=8)
        s.sendall(("GET / HTTP/1.0\r\nHost: %s\r\n\r\n" % (a[3] if len(a) > 3 else a[1])).encode())
        d = s.recv(4096)
        if not d: raise Exception("closed with no answer")
        return d.decode(errors="replace").split("\r\n\r\n")[-1]
    if a[0] == "tls":
        ctx = ssl._create_unverified_context()
        s = ctx.wrap_socket(socket.create_connection((a[1], int(a[2])), timeout=8), server_hostname=a[3])
        s.sendall(("GET / HTTP/1.0\r\nHost: %s\r\n\r\n" % a[3]).encode())
        d = s.recv(4096)
        if not d: raise Exception("closed with no answer")
        return d.decode(errors="replace").split("\r\n\r\n")[-1]
    if a[0] == "udp":
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(2)
        s.sendto(b"ping", (a[1], int(a[2])))
        return s.recvfrom(100)[0].decode()
    if a[0] == "dns":
        return socket.gethostbyname(a[1])
    if a[0] == "dnsat":
        q = struct.pack("!HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0)
        q += b"".join(bytes([len(p)]) + p.encode() for p in a[2].split(".")) + b"\0" + struct.pack("!HH", 1, 1)
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(3)
        s.sendto(q, (a[1], 53))
        r = s.recvfrom(1500)[0]
        rcode, an = r[3] & 15, struct.unpack("!H", r[6:8])[0]
        if rcode or not an: raise Exception("rcode %d, %d answers" % (rcode, an))
        return socket.inet_ntoa(r[-4:])
    if a[0] == "raw":
        s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP); s.settimeout(2)
        body = struct.pack("!BBHHH", 8, 0, 0, 1, 1) + b"deltabox"
        c = sum(struct.unpack("!%dH" % (len(body) // 2), body)); c = (c >> 16) + (c & 0xffff); c = ~(c + (c >> 16)) & 0xffff
        s.sendto(body[:2] + struct.pack("!H", c) + body[4:], (a[1], 0))
        while True:
            d, src = s.recvfrom(1500)
            if src[0] == a[1]: return "reply from " + src[0]
try:
    print("OK", main(sys.argv[1:]))
except Exception as e:
    print("ERR", type(e).__name__, e)
`
