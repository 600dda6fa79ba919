package security

// Network (issue 28): nothing inside a sandbox with a network gets past the daemon's
// proxy, even with "allow_out": ["*"]. Each attack has a live target in the test's
// internet (testutil.NewInternet) or on the host, so each would succeed without the
// mechanism that refuses it.

import (
	"fmt"
	"net"
	"net/netip"
	"strings"
	"testing"

	"deltabox/internal/apitypes"
	"deltabox/internal/testutil"
)

func netProbe(t *testing.T, d *testutil.Daemon, id string, args ...string) string {
	t.Helper()
	r, err := d.C.Exec(ctx(t), id, apitypes.ExecRequest{Argv: append([]string{"python3", "-c", testutil.NetProbe}, args...), TimeoutMS: 30_000})
	if err != nil {
		t.Fatalf("exec probe %v: %v", args, err)
	}
	return strings.TrimSpace(r.Stdout + r.Stderr)
}

// TestNetNoBypass: raw sockets, UDP other than DNS, DNS to a denied name sent to any
// server, DNS answers that point at the host, the host's own addresses (a service on
// the host's end of the veth), the host's loopback, link-local metadata, the proxy's
// own listener and another sandbox's services: all refused, for a sandbox allowed "*".
func TestNetNoBypass(t *testing.T) {
	in := testutil.NewInternet(t)
	d := testutil.StartDaemonEnv(t, testutil.NewStore(t), "DELTABOX_NET_DNS="+in.DNSAddr())
	// A service of the host on its end of the veth, and one on its loopback.
	hostSvc := listenHTTP(t, netip.AddrPortFrom(in.Host, 0), "host")
	loopSvc := listenHTTP(t, netip.MustParseAddrPort("127.0.0.1:0"), "host-loopback")

	sb, err := d.C.Create(ctx(t), apitypes.CreateOptions{Network: &apitypes.Network{AllowOut: []string{"*"}, DenyOut: []string{"denied.test"}}})
	if err != nil {
		t.Fatal(err)
	}
	other, err := d.C.Create(ctx(t), apitypes.CreateOptions{Network: &apitypes.Network{AllowOut: []string{"*"}}})
	if err != nil {
		t.Fatal(err)
	}
	// The other sandbox serves on every address it has, port 8080.
	if _, err := d.C.Exec(ctx(t), other.ID, apitypes.ExecRequest{Argv: []string{"bash", "-c",
		"cd /tmp && echo other > index.html && (setsid python3 -m http.server 8080 >/dev/null 2>&1 &) && sleep 1"}}); err != nil {
		t.Fatal(err)
	}
	// Control: the sandbox's network works, and the targets are alive.
	if got := netProbe(t, d, sb.ID, "get", "http://allowed.test/"); got != "OK allowed" {
		t.Fatalf("control: allowed.test through the proxy: %q", got)
	}
	if got := netProbe(t, d, other.ID, "get", "http://127.0.0.1:8080/index.html"); got != "OK other" {
		t.Fatalf("control: the other sandbox's own server: %q", got)
	}

	attacks := []struct {
		name string
		args []string
	}{
		{"raw ICMP to a live host", []string{"raw", in.Raw.String()}},
		{"UDP other than DNS", []string{"udp", in.Raw.String(), "7"}},
		{"DNS for a denied name via the real server", []string{"dnsat", in.DNS.String(), "denied.test"}},
		{"DNS for a denied name via resolv.conf", []string{"dns", "denied.test"}},
		{"DNS answer pointing at the host's loopback", []string{"dns", "loop.test"}},
		{"DNS answer pointing at the host", []string{"dns", "hostsvc.test"}},
		{"DNS answer pointing at metadata", []string{"dns", "meta.test"}},
		{"TLS with a denied SNI", []string{"tls", in.Denied.String(), "443", "denied.test"}},
		{"a service on the host's address", []string{"tcp", in.Host.String(), fmt.Sprint(hostSvc.Port())}},
		{"the host's loopback", []string{"tcp", "127.0.0.1", fmt.Sprint(loopSvc.Port())}},
		{"link-local metadata", []string{"get", "http://169.254.169.254/"}},
		{"another sandbox's server (its loopback)", []string{"tcp", "127.0.0.1", "8080"}},
		{"the proxy's own listener", []string{"tcp", "127.0.0.1", "PROXYPORT"}},
	}
	proxyPort := strings.TrimSpace(runIn(t, d, sb.ID, `python3 -c '
for l in open("/proc/net/tcp").readlines()[1:]:
    f = l.split()
    if f[3] == "0A" and f[1].startswith("0100007F:"): print(int(f[1].split(":")[1], 16))'`))
	if proxyPort == "" || strings.Contains(proxyPort, "\n") {
		t.Fatalf("the proxy's listener in the sandbox's namespace: %q", proxyPort)
	}
	for _, a := range attacks {
		for i := range a.args {
			a.args[i] = strings.ReplaceAll(a.args[i], "PROXYPORT", proxyPort)
		}
		if got := netProbe(t, d, sb.ID, a.args...); strings.HasPrefix(got, "OK") {
			t.Errorf("%s (%v) went through: %q", a.name, a.args, got)
		}
	}
	for _, q := range in.Queries() {
		if q == "denied.test" {
			t.Errorf("the upstream DNS server was asked for denied.test")
		}
	}
	// The rules cannot be changed from inside: no CAP_NET_ADMIN (route, link or
	// netfilter changes all need it).
	out := runIn(t, d, sb.ID, `python3 -c '
import socket, fcntl, struct
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    fcntl.ioctl(s, 0x8914, struct.pack("16sH14x", b"lo", 0)); print("WORKS")
except OSError as e: print("refused", e)'`)
	if !strings.HasPrefix(out, "refused") {
		t.Errorf("root of the sandbox changed lo's flags: %q", out)
	}
}

func runIn(t *testing.T, d *testutil.Daemon, id, script string) string {
	t.Helper()
	return sh(t, d, id, script)
}

// listenHTTP serves body on ap (port 0: any) in the test's (the host's) namespace.
func listenHTTP(t *testing.T, ap netip.AddrPort, body string) netip.AddrPort {
	t.Helper()
	l, err := net.Listen("tcp4", ap.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			fmt.Fprintf(c, "HTTP/1.0 200 OK\r\n\r\n%s", body)
			c.Close()
		}
	}()
	return l.Addr().(*net.TCPAddr).AddrPort()
}
