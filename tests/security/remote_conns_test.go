package security

import (
	"bufio"
	"net"
	"net/http"
	"syscall"
	"testing"
	"time"

	"deltabox/internal/testutil"
)

// A network peer without a key must not hold the listener's connection slots: neither
// with keep-alive 401s (the 401 closes the connection) nor with silent connections from
// one IP (64 per IP; the rest are closed at accept, and the 64 after 10 s without a
// valid key). A key holder from another address gets in meanwhile.
func TestRemoteUnauthenticatedPeerCannotHoldConnections(t *testing.T) {
	var rl syscall.Rlimit
	syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl)
	rl.Cur = rl.Max
	syscall.Setrlimit(syscall.RLIMIT_NOFILE, &rl)
	d, addr := testutil.StartRemoteDaemon(t)
	key := testutil.NewKey(t, d, "k")
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	health := func(what string) {
		t.Helper()
		cl := &http.Client{Timeout: 5 * time.Second}
		req, _ := http.NewRequest("GET", "http://"+addr+"/v1/health", nil)
		req.Header.Set("Authorization", "Bearer "+key)
		res, err := cl.Do(req)
		if err != nil {
			t.Fatalf("a key holder cannot get in while %s: %v", what, err)
		}
		res.Body.Close()
	}
	// Keep-alive 401s.
	for i := 0; i < 1030; i++ {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
		c.SetDeadline(time.Now().Add(300 * time.Millisecond))
		c.Write([]byte("GET /sandboxes HTTP/1.1\r\nHost: x\r\n\r\n"))
		res, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err == nil {
			res.Body.Close()
			if i == 0 && (res.StatusCode != 401 || !res.Close) {
				t.Errorf("a request without a key: %d, close %v; want 401 with Connection: close", res.StatusCode, res.Close)
			}
		}
	}
	health("an unauthenticated peer holds 1030 keep-alive connections")
	// Silent connections from one other address (127.0.0.2, loopback too).
	dl := net.Dialer{Timeout: time.Second, LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2)}}
	var silent []net.Conn
	for i := 0; i < 200; i++ {
		c, err := dl.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
		silent = append(silent, c)
	}
	health("one peer holds 200 silent connections")
	// At most 64 stay open; those are closed 10 s after their accept.
	start := time.Now()
	open := 0
	for _, c := range silent {
		c.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
		if _, err := c.Read(make([]byte, 1)); err != nil {
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				open++
			}
		}
	}
	if open > 64 {
		t.Errorf("%d silent connections from one IP are open, want at most 64", open)
	}
	for _, c := range silent {
		c.SetReadDeadline(start.Add(20 * time.Second))
		if _, err := c.Read(make([]byte, 1)); err != nil {
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				t.Fatalf("a silent connection without a key is still open after %v (want closed 10 s after accept)", time.Since(start))
			}
		}
	}
	t.Logf("%d of 200 silent connections outlived the accept; all closed after %v", open, time.Since(start))
}
