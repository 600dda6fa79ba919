package security

import (
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"deltabox/internal/testutil"
)

// The native file routes over TCP must not let a client hold the sandbox's file call
// (and so its checkpoints) by not reading a read's answer or not sending a write's
// body: each 32 KiB has 10 s.
func TestRemoteFileTransfersCannotStallCheckpoints(t *testing.T) {
	d, addr := testutil.StartRemoteDaemon(t)
	c := e2bClient{t, addr}
	key := testutil.NewKey(t, d, "k")
	bearer := map[string]string{"Authorization": "Bearer " + key, "Content-Type": "application/json"}
	if s, b := c.do("POST", "/v1/sandboxes", bearer, `{"id":"stall"}`); s != 201 {
		t.Fatalf("create: %d %s", s, b)
	}
	if s, b := c.do("POST", "/v1/sandboxes/stall/exec", bearer, `{"argv":["truncate","-s","60M","/tmp/mid.bin"]}`); s != 200 {
		t.Fatalf("exec: %d %s", s, b)
	}
	for _, req := range []string{
		"GET /v1/sandboxes/stall/files?path=/tmp/mid.bin HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key + "\r\n\r\n",
		"PUT /v1/sandboxes/stall/files?path=/tmp/up.bin HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key + "\r\nContent-Length: 1000000\r\n\r\nabc",
	} {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprint(conn, req)
		time.Sleep(time.Second)
		start := time.Now()
		s, b := c.do("POST", "/v1/sandboxes/stall/checkpoint", bearer, `{"wait_ms":25000}`)
		conn.Close()
		what := strings.SplitN(req, " ", 2)[0]
		if s != 200 && s != 201 {
			t.Fatalf("a checkpoint while a %s of a file stalls: %d after %v: %.300s", what, s, time.Since(start), b)
		}
		t.Logf("checkpoint through after %v of a stalled %s", time.Since(start), what)
	}
}
