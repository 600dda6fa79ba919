package security

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"os/exec"
	"strings"
	"testing"

	"deltabox/internal/testutil"
)

// TestE2BPortsStayInTheirSandbox: a sandbox's port, reached by E2B's getHost name
// (PORT-SANDBOXID.DOMAIN on the daemon's listener), opens with that sandbox's traffic
// token only, or a key, and the server sees neither (nor a revoked key): another
// sandbox's traffic token, the sandbox's own envd token, a token of a removed sandbox
// or of a revoked key get a 403, and a traffic token opens no envd. The native ports
// route over TCP does not hand the key to the server either.
// A port route never reaches the host's loopback: with a server on the host's
// 127.0.0.1:P, P of a sandbox (getHost's route and the native ports route alike) is
// the sandbox's own 127.0.0.1:P, where nothing listens (502), the daemon dialing from
// inside the sandbox's network namespace.
func TestE2BPortsStayInTheirSandbox(t *testing.T) {
	d, addr := testutil.StartRemoteDaemon(t)
	c := e2bClient{t, addr}
	key := testutil.NewKey(t, d, "k")
	a, b := c.create(key), c.create(key)
	if a.TrafficAccessToken == "" || a.TrafficAccessToken == a.EnvdAccessToken || a.TrafficAccessToken == b.TrafficAccessToken {
		t.Fatalf("traffic tokens %q and %q (envd %q): want distinct per sandbox and from envd's", a.TrafficAccessToken, b.TrafficAccessToken, a.EnvdAccessToken)
	}
	testutil.StartEchoServer(t, d, a.SandboxID, 8000)
	testutil.StartEchoServer(t, d, b.SandboxID, 8000)
	hc := testutil.HostClient(addr)
	get := func(port int, id string, hdr map[string]string) (int, string) {
		t.Helper()
		req, _ := http.NewRequest("GET", fmt.Sprintf("http://%d-%s.deltabox.test/", port, id), nil)
		for k, v := range hdr {
			req.Header.Set(k, v)
		}
		res, err := hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer res.Body.Close()
		body, _ := io.ReadAll(res.Body)
		return res.StatusCode, string(body)
	}
	traffic := func(tok string) map[string]string { return map[string]string{"e2b-traffic-access-token": tok} }
	revoked := testutil.NewKey(t, d, "gone")
	if out, err := exec.Command(testutil.Binary(t), "key", "rm", "gone", "--root", d.Root).CombinedOutput(); err != nil {
		t.Fatalf("key rm: %v %s", err, out)
	}
	s, body := get(8000, b.SandboxID, map[string]string{"e2b-traffic-access-token": b.TrafficAccessToken, "X-API-Key": revoked})
	if s != 200 || strings.Contains(body, b.TrafficAccessToken) || strings.Contains(body, revoked) {
		t.Fatalf("b's port with b's token (and a revoked key): %d %s: want 200, neither credential seen by the server", s, body)
	}
	for name, hdr := range map[string]map[string]string{
		"a's traffic token":           traffic(a.TrafficAccessToken),
		"b's envd token as traffic":   traffic(b.EnvdAccessToken),
		"b's envd token (X-Access)":   {"X-Access-Token": b.EnvdAccessToken, "E2b-Sandbox-Id": b.SandboxID},
		"a wrong key, b's token none": {"X-API-Key": "e2b_" + strings.Repeat("0", 40)},
	} {
		if s, body := get(8000, b.SandboxID, hdr); s != 403 {
			t.Errorf("b's port with %s: %d %s, want 403", name, s, body)
		}
	}
	// DeltaBox's own ports route over TCP does not hand the key to the server either.
	for _, h := range []map[string]string{{"Authorization": "Bearer " + key}, {"X-API-Key": key}} {
		if s, body := c.do("GET", "/v1/sandboxes/"+a.SandboxID+"/ports/8000/", h, ""); s != 200 || strings.Contains(string(body), key) {
			t.Errorf("the native ports route with the key as %v: %d %q: want 200, the key unseen by the server", h, s, body)
		}
	}
	if s, body := c.do("GET", "/health", map[string]string{"E2b-Sandbox-Id": a.SandboxID, "X-Access-Token": a.TrafficAccessToken}, ""); s != 401 {
		t.Errorf("envd with a's traffic token: %d %s, want 401", s, body)
	}

	// The host's loopback is not the sandbox's.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go http.Serve(l, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "HOST-LOOPBACK") }))
	hp := l.Addr().(*net.TCPAddr).Port
	if s, body := get(hp, a.SandboxID, traffic(a.TrafficAccessToken)); s != 502 || strings.Contains(body, "HOST-LOOPBACK") {
		t.Errorf("getHost(%d) of a with the host's server on 127.0.0.1:%d: %d %q, want 502", hp, hp, s, body)
	}
	if s, body := c.do("GET", fmt.Sprintf("/v1/sandboxes/%s/ports/%d/", a.SandboxID, hp), map[string]string{"X-API-Key": key}, ""); s == 200 || strings.Contains(string(body), "HOST-LOOPBACK") {
		t.Errorf("the native ports route to %d of a: %d %q, want an error", hp, s, body)
	}

	// A token dies with its sandbox, and with the key it was handed to.
	if s, body := c.do("DELETE", "/sandboxes/"+b.SandboxID, map[string]string{"X-API-Key": key}, ""); s != 204 {
		t.Fatalf("kill b: %d %s", s, body)
	}
	if s, body := get(8000, b.SandboxID, traffic(b.TrafficAccessToken)); s != 403 {
		t.Errorf("a killed sandbox's port with its token: %d %s, want 403", s, body)
	}
	key2 := testutil.NewKey(t, d, "k2")
	e := c.create(key2)
	testutil.StartEchoServer(t, d, e.SandboxID, 8000)
	if s, body := get(8000, e.SandboxID, traffic(e.TrafficAccessToken)); s != 200 {
		t.Fatalf("e's port with its token: %d %s", s, body)
	}
	if out, err := exec.Command(testutil.Binary(t), "key", "rm", "k2", "--root", d.Root).CombinedOutput(); err != nil {
		t.Fatalf("key rm: %v %s", err, out)
	}
	if s, body := get(8000, e.SandboxID, traffic(e.TrafficAccessToken)); s != 403 {
		t.Errorf("a revoked key's traffic token: %d %s, want 403", s, body)
	}
}
