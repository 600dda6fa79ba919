package e2e

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"strings"
	"testing"
	"time"

	"deltabox/internal/testutil"
)

// e2bSandbox creates a sandbox through E2B's control plane on addr and returns its id
// and trafficAccessToken.
func e2bSandbox(t *testing.T, addr, key string) (id, traffic string) {
	t.Helper()
	req, _ := http.NewRequest("POST", "http://"+addr+"/sandboxes", strings.NewReader(`{"templateID":"base"}`))
	req.Header.Set("X-API-Key", key)
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	var r struct {
		SandboxID          string `json:"sandboxID"`
		TrafficAccessToken string `json:"trafficAccessToken"`
	}
	b, _ := io.ReadAll(res.Body)
	if res.StatusCode != 201 || json.Unmarshal(b, &r) != nil || r.TrafficAccessToken == "" {
		t.Fatalf("create: %d %s", res.StatusCode, b)
	}
	return r.SandboxID, r.TrafficAccessToken
}

// TestE2BGetHost: a request whose Host is E2B's getHost name for a sandbox's port
// (PORT-SANDBOXID.DOMAIN, any domain pointed at the daemon) reaches the server
// listening on that port inside the sandbox, with its path, query, body and Host kept;
// the client's connection to the daemon is kept alive across requests; an upgrade is
// passed through both ways; a checkpoint right after requests succeeds. The sandbox's trafficAccessToken or an API key lets it in,
// and neither reaches the server. Nothing listening is a 502 naming the port, an unknown
// sandbox a 404, no credential a 403.
func TestE2BGetHost(t *testing.T) {
	d, addr := remoteDaemon(t)
	key := newKey(t, d, "gethost")
	id, traffic := e2bSandbox(t, addr, key)
	testutil.StartEchoServer(t, d, id, 8000)
	_, lport, _ := net.SplitHostPort(addr)
	host := func(port int, id string) string { return fmt.Sprintf("%d-%s.deltabox.test:%s", port, id, lport) }
	c := testutil.HostClient(addr)
	do := func(method, url string, hdr map[string]string, body string, trace *httptrace.ClientTrace) (int, string) {
		t.Helper()
		req, _ := http.NewRequest(method, url, strings.NewReader(body))
		for k, v := range hdr {
			req.Header.Set(k, v)
		}
		if trace != nil {
			req = req.WithContext(httptrace.WithClientTrace(req.Context(), trace))
		}
		res, err := c.Do(req)
		if err != nil {
			t.Fatalf("%s %s: %v", method, url, err)
		}
		defer res.Body.Close()
		b, _ := io.ReadAll(res.Body)
		return res.StatusCode, string(b)
	}
	tok := map[string]string{"e2b-traffic-access-token": traffic}
	base := "http://" + host(8000, id)

	reused := 0
	trace := &httptrace.ClientTrace{GotConn: func(i httptrace.GotConnInfo) {
		if i.Reused {
			reused++
		}
	}}
	for i := 0; i < 3; i++ {
		s, body := do("GET", base+"/a/b?x=1", tok, "", trace)
		if s != 200 || !strings.HasPrefix(body, "GET /a/b?x=1 \n") || !strings.Contains(body, "Host: "+host(8000, id)) {
			t.Fatalf("GET through getHost's name: %d %q", s, body)
		}
		if strings.Contains(strings.ToLower(body), "traffic-access-token") {
			t.Fatalf("the server in the sandbox saw the traffic token:\n%s", body)
		}
	}
	if reused != 2 {
		t.Errorf("%d of 2 later requests reused the connection to the daemon, want keep-alive", reused)
	}
	if s, body := do("POST", base+"/up", tok, "hello", nil); s != 200 || !strings.HasPrefix(body, "POST /up hello\n") {
		t.Errorf("POST: %d %q", s, body)
	}
	// A key lets in too, and does not reach the server; an application's own
	// Authorization, beside the token, does.
	for _, h := range []map[string]string{{"X-API-Key": key}, {"Authorization": "Bearer " + key}} {
		s, body := do("GET", base+"/k", h, "", nil)
		if s != 200 || strings.Contains(body, key) {
			t.Errorf("GET with the key as %v: %d %q (the key must not reach the server)", h, s, body)
		}
	}
	s, body := do("GET", base+"/app", map[string]string{"e2b-traffic-access-token": traffic, "Authorization": "Bearer app-secret"}, "", nil)
	if s != 200 || !strings.Contains(body, "Authorization: Bearer app-secret") {
		t.Errorf("GET with the application's own Authorization: %d %q", s, body)
	}
	if s, body := do("GET", base+"/", nil, "", nil); s != 403 || !strings.Contains(body, "e2b-traffic-access-token") {
		t.Errorf("GET without a token: %d %q, want 403 naming the header", s, body)
	}
	if s, body := do("GET", "http://"+host(8001, id)+"/", tok, "", nil); s != 502 || !strings.Contains(body, "port 8001") {
		t.Errorf("GET of a port nothing listens on: %d %q, want 502 naming port 8001", s, body)
	}
	if s, body := do("GET", "http://"+host(8000, "nosuchbox")+"/", map[string]string{"X-API-Key": key}, "", nil); s != 404 || !strings.Contains(body, "nosuchbox") {
		t.Errorf("GET of an unknown sandbox: %d %q, want 404 naming it", s, body)
	}

	// Between requests the sandbox holds no connection to the daemon (one inside per
	// request, closed after it): a checkpoint right after them succeeds (the listening
	// server goes through CRIU), and the server serves again after a restore.
	cp, err := d.C.Checkpoint(dbxCtx(t), id, "after-gets")
	if err != nil {
		t.Fatalf("checkpoint after GETs through getHost: %v", err)
	}
	if _, err := d.C.Restore(dbxCtx(t), id, cp.Node.ID); err != nil {
		t.Fatal(err)
	}
	if s, body := do("GET", base+"/again", tok, "", nil); s != 200 || !strings.HasPrefix(body, "GET /again ") {
		t.Errorf("GET after a restore: %d %q", s, body)
	}

	// An upgrade passes through: after the 101 the server echoes lines back.
	nc, err := net.DialTimeout("tcp", addr, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	nc.SetDeadline(time.Now().Add(20 * time.Second))
	fmt.Fprintf(nc, "GET /ws HTTP/1.1\r\nHost: %s\r\nConnection: Upgrade\r\nUpgrade: echo\r\ne2b-traffic-access-token: %s\r\n\r\n", host(8000, id), traffic)
	br := bufio.NewReader(nc)
	res, err := http.ReadResponse(br, nil)
	if err != nil || res.StatusCode != 101 {
		t.Fatalf("upgrade: %v %v", res, err)
	}
	echo := func(line, when string) {
		t.Helper()
		io.WriteString(nc, line)
		got, err := br.ReadString('\n')
		if err != nil || got != line {
			t.Fatalf("%s: sent %q, read %q, %v", when, line, got, err)
		}
	}
	echo("ping\n", "after the upgrade")
	echo("pong\n", "after the upgrade")

	// A checkpoint with the connection open: the server's end, a connection to the
	// daemon's, goes through CRIU (its TCP state repaired back, the sandbox's TCP
	// traffic held meanwhile: durable/tcp.go), and the connection carries on.
	cp2, err := d.C.Checkpoint(dbxCtx(t), id, "connection-open")
	if err != nil {
		t.Fatalf("checkpoint with an upgraded connection open: %v", err)
	}
	echo("after the checkpoint\n", "after a checkpoint with the connection open")
	// A restore rewinds the server's end to the checkpoint, which the daemon's end has
	// gone past: the connection ends (the ended server's end closed it), and the
	// server serves new ones.
	if _, err := d.C.Restore(dbxCtx(t), id, cp2.Node.ID); err != nil {
		t.Fatal(err)
	}
	io.WriteString(nc, "after the restore\n")
	if got, err := br.ReadString('\n'); err == nil {
		t.Errorf("after a restore to before the last exchange, the old connection still answered %q", got)
	}
	if s, body := do("GET", base+"/after-restore", tok, "", nil); s != 200 || !strings.HasPrefix(body, "GET /after-restore ") {
		t.Errorf("GET after a restore with a connection open at the checkpoint: %d %q", s, body)
	}
}
