package client

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// serve runs h on a unix socket and counts the connections the server accepted.
func serve(t *testing.T, h http.Handler) (socket string, conns *atomic.Int64, srv *http.Server) {
	t.Helper()
	socket = filepath.Join(t.TempDir(), "s.sock")
	l, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	conns = new(atomic.Int64)
	srv = &http.Server{Handler: h, ConnState: func(c net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}}
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
	return socket, conns, srv
}

func get(t *testing.T, hc *http.Client, ctx context.Context, path string) (string, error) {
	t.Helper()
	req, _ := http.NewRequestWithContext(ctx, "GET", "http://deltabox"+path, nil)
	resp, err := hc.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

func TestTransportReusesOneConnection(t *testing.T) {
	sock, conns, _ := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		io.WriteString(w, r.Method+" "+r.URL.Path+" "+string(b))
	}))
	hc := &http.Client{Transport: &unixTransport{socket: sock}}
	for i := 0; i < 5; i++ {
		got, err := get(t, hc, context.Background(), "/v1/health")
		if err != nil || got != "GET /v1/health " {
			t.Fatalf("request %d: %q, %v", i, got, err)
		}
	}
	req, _ := http.NewRequest("POST", "http://deltabox/x", strings.NewReader("body"))
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(b) != "POST /x body" {
		t.Fatalf("POST answered %q", b)
	}
	if n := conns.Load(); n != 1 {
		t.Fatalf("6 sequential requests used %d connections, want 1", n)
	}
}

// A body closed before its end may leave bytes on the connection: it is not reused.
func TestTransportBodyClosedEarlyIsNotReused(t *testing.T) {
	big := strings.Repeat("x", 1<<20)
	sock, conns, _ := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, big)
	}))
	hc := &http.Client{Transport: &unixTransport{socket: sock}}
	resp, err := hc.Get("http://deltabox/big")
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 10)
	io.ReadFull(resp.Body, buf)
	resp.Body.Close()
	got, err := get(t, hc, context.Background(), "/big")
	if err != nil || got != big {
		t.Fatalf("second request: %d bytes, %v", len(got), err)
	}
	if n := conns.Load(); n != 2 {
		t.Fatalf("connections = %d, want 2 (the half-read one dropped)", n)
	}
}

// A daemon restart closes pooled connections; the next request goes through on a new one.
func TestTransportRetriesAConnectionTheServerClosed(t *testing.T) {
	var calls atomic.Int64
	sock, conns, srv := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		b, _ := io.ReadAll(r.Body)
		w.Write(b)
	}))
	hc := &http.Client{Transport: &unixTransport{socket: sock}}
	if _, err := get(t, hc, context.Background(), "/a"); err != nil {
		t.Fatal(err)
	}
	// Close the server's side of the idle connection (as a restarted daemon would).
	srv.SetKeepAlivesEnabled(false)
	time.Sleep(50 * time.Millisecond)
	req, _ := http.NewRequest("POST", "http://deltabox/b", strings.NewReader("again"))
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatalf("request after the server closed the idle connection: %v", err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(b) != "again" {
		t.Fatalf("answer %q", b)
	}
	if calls.Load() != 2 || conns.Load() != 2 {
		t.Fatalf("handler calls %d (want 2: the POST ran once), connections %d (want 2)", calls.Load(), conns.Load())
	}
}

func TestTransportCancelAndDeadline(t *testing.T) {
	release := make(chan struct{})
	sock, _, _ := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	defer close(release)
	hc := &http.Client{Transport: &unixTransport{socket: sock}}

	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(50*time.Millisecond, cancel)
	t0 := time.Now()
	if _, err := get(t, hc, ctx, "/slow"); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled request: err %v, want context.Canceled", err)
	}
	if d := time.Since(t0); d > 2*time.Second {
		t.Fatalf("cancellation took %v", d)
	}
	ctx, cancel2 := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel2()
	if _, err := get(t, hc, ctx, "/slow"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("request past its deadline: err %v, want context.DeadlineExceeded", err)
	}
}

func TestTransportNoDaemon(t *testing.T) {
	hc := &http.Client{Transport: &unixTransport{socket: filepath.Join(t.TempDir(), "none.sock")}}
	if _, err := get(t, hc, context.Background(), "/v1/health"); err == nil {
		t.Fatal("request to a missing socket succeeded")
	}
}
