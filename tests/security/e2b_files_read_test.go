package security

import (
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"deltabox/internal/testutil"
)

// E2B's GET /files must not hold the sandbox's file call at a slow reader's pace: a
// file over the native read cap (64 MiB) is refused before any byte, a client that
// stops reading is cut after 10 s per chunk, and a checkpoint waiting meanwhile gets
// through. A Range is honoured.
func TestE2BFilesReadCannotStallCheckpoints(t *testing.T) {
	d, addr := testutil.StartRemoteDaemon(t)
	c := e2bClient{t, addr}
	key := testutil.NewKey(t, d, "k")
	r := c.create(key)
	bearer := map[string]string{"Authorization": "Bearer " + key, "Content-Type": "application/json"}
	if s, b := c.do("POST", "/v1/sandboxes/"+r.SandboxID+"/exec", bearer,
		`{"argv":["sh","-c","truncate -s 9G /home/user/big.bin && truncate -s 60M /home/user/mid.bin && printf 0123456789 > /home/user/small"]}`); s != 200 {
		t.Fatalf("exec: %d %s", s, b)
	}
	get := func(p, rng string) *http.Response {
		req, _ := http.NewRequest("GET", "http://"+addr+"/files?path="+p, nil)
		req.Header.Set("E2b-Sandbox-Id", r.SandboxID)
		req.Header.Set("X-Access-Token", r.EnvdAccessToken)
		if rng != "" {
			req.Header.Set("Range", rng)
		}
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	res := get("/home/user/big.bin", "")
	res.Body.Close()
	if res.StatusCode == 200 {
		t.Errorf("GET /files of a 9 GiB file: 200, want a refusal (over the 64 MiB read cap)")
	}
	res = get("/home/user/small", "bytes=2-4")
	b, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if res.StatusCode != 206 || string(b) != "234" || res.Header.Get("Content-Range") != "bytes 2-4/10" {
		t.Errorf("Range bytes=2-4: %d %q %q, want 206 \"234\" bytes 2-4/10", res.StatusCode, b, res.Header.Get("Content-Range"))
	}
	if res = get("/home/user/small", "bytes=20-"); res.StatusCode != 416 {
		t.Errorf("Range bytes=20- of 10 bytes: %d, want 416", res.StatusCode)
	}
	res.Body.Close()
	// A reader that never reads the body of a 60 MiB file (more than the sockets buffer).
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.Write([]byte("GET /files?path=/home/user/mid.bin HTTP/1.1\r\nHost: x\r\nE2b-Sandbox-Id: " + r.SandboxID + "\r\nX-Access-Token: " + r.EnvdAccessToken + "\r\n\r\n"))
	hdr := make([]byte, 512)
	n, _ := conn.Read(hdr)
	if !strings.HasPrefix(string(hdr[:n]), "HTTP/1.1 200") {
		t.Fatalf("GET /files of 60 MiB: %q", hdr[:n])
	}
	start := time.Now()
	s, b := c.do("POST", "/v1/sandboxes/"+r.SandboxID+"/checkpoint", bearer, `{"wait_ms":25000}`)
	if s != 200 && s != 201 {
		t.Fatalf("a checkpoint while a file read stalls: %d after %v: %.300s", s, time.Since(start), b)
	}
	t.Logf("checkpoint through after %v of a stalled read", time.Since(start))
}
