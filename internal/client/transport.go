package client

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"sync"
	"syscall"
)

// unixTransport is the client's http.RoundTripper: HTTP/1.1 over kept-alive unix
// socket connections, each exchange done in the caller's goroutine with the standard
// library's own request writer and response reader (http.Request.Write,
// http.ReadResponse).
//
// Why not http.Transport: it hands every request to a connection's write goroutine and
// takes the answer from its read goroutine, three goroutine switches that become
// thread wake-ups when the process was idle. On these 2-vCPU machines, where a vCPU
// that has been idle for a few milliseconds runs its first syscalls 5-10x slower,
// that measured 0.50 ms per cold health request through http.Transport against 0.35 ms
// on one connection in one goroutine, and checkpoints and restores are ~1 ms calls.
//
// A connection goes back to the pool once its response body has been read to the end
// and closed; a body closed early, an error, or a "Connection: close" answer closes it.
// A request that finds its reused connection closed by the daemon (a restarted
// daemon) is sent again once on a new connection, when the daemon cannot have acted on
// it: the write failed, or the method is idempotent.
type unixTransport struct {
	socket string

	mu sync.Mutex
	// +checklocks:mu
	idle []*unixConn
}

const maxIdleConns = 16

type unixConn struct {
	c  net.Conn
	br *bufio.Reader
	bw *bufio.Writer
}

func (t *unixTransport) get(ctx context.Context) (*unixConn, bool, error) {
	t.mu.Lock()
	if n := len(t.idle); n > 0 {
		uc := t.idle[n-1]
		t.idle = t.idle[:n-1]
		t.mu.Unlock()
		return uc, true, nil
	}
	t.mu.Unlock()
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", t.socket)
	if err != nil {
		return nil, false, err
	}
	return &unixConn{c: c, br: bufio.NewReaderSize(c, 16<<10), bw: bufio.NewWriterSize(c, 16<<10)}, false, nil
}

func (t *unixTransport) put(uc *unixConn) {
	t.mu.Lock()
	if len(t.idle) < maxIdleConns {
		t.idle = append(t.idle, uc)
		uc = nil
	}
	t.mu.Unlock()
	if uc != nil {
		uc.c.Close()
	}
}

// CloseIdleConnections closes the pooled connections (http.Client calls it).
func (t *unixTransport) CloseIdleConnections() {
	t.mu.Lock()
	idle := t.idle
	t.idle = nil
	t.mu.Unlock()
	for _, uc := range idle {
		uc.c.Close()
	}
}

func (t *unixTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err, retry := t.roundTrip(req)
	if retry && (req.Body == nil || req.GetBody != nil) {
		if req.GetBody != nil {
			b, gerr := req.GetBody()
			if gerr != nil {
				return nil, err
			}
			r2 := req.Clone(req.Context())
			r2.Body = b
			req = r2
		}
		resp, err, _ = t.roundTrip(req)
	}
	return resp, err
}

// roundTrip does one exchange; retry says the error came from a reused connection
// that the daemon had closed before answering anything.
func (t *unixTransport) roundTrip(req *http.Request) (*http.Response, error, bool) {
	ctx := req.Context()
	uc, reused, err := t.get(ctx)
	if err != nil {
		if req.Body != nil {
			req.Body.Close()
		}
		return nil, err, false
	}
	// Cancellation (or the context's deadline) closes the connection, which ends any
	// read or write in progress.
	stop := context.AfterFunc(ctx, func() { uc.c.Close() })
	fail := func(err error) (*http.Response, error, bool) {
		stop()
		uc.c.Close()
		if ctx.Err() != nil {
			err = ctx.Err()
		}
		return nil, err, false
	}
	// A daemon may answer before it has read the whole body (a refused upload) and
	// close: a failed write is not the end, the answer may be waiting to be read.
	werr := req.Write(uc.bw)
	if werr == nil {
		werr = uc.bw.Flush()
	}
	if _, err := uc.br.Peek(1); err != nil {
		// Send again only what the daemon cannot have acted on: the write itself
		// failed (a unix socket fails it at once when the peer has closed), or the
		// method is idempotent. A POST written whole and then met by EOF may have run.
		retry := reused && isClosedConn(err) && ctx.Err() == nil && (werr != nil || idempotent(req.Method))
		if werr != nil {
			err = werr
		}
		r, e, _ := fail(err)
		return r, e, retry
	}
	resp, err := http.ReadResponse(uc.br, req)
	if err != nil {
		return fail(err)
	}
	resp.Body = &connBody{ReadCloser: resp.Body, t: t, uc: uc, stop: stop, keep: werr == nil && !resp.Close && !req.Close,
		eof: resp.Body == http.NoBody}
	return resp, nil, false
}

func idempotent(method string) bool {
	switch method {
	case "GET", "HEAD", "OPTIONS", "PUT", "DELETE":
		return true
	}
	return false
}

func isClosedConn(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

// connBody gives the connection back when the body has been read to its end.
type connBody struct {
	io.ReadCloser
	t    *unixTransport
	uc   *unixConn
	stop func() bool
	keep bool
	eof  bool
	done bool
}

func (b *connBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err == io.EOF {
		b.eof = true
	}
	return n, err
}

func (b *connBody) Close() error {
	if b.done {
		return nil
	}
	b.done = true
	err := b.ReadCloser.Close()
	if !b.eof {
		// http's body reader drains a little on Close; a body we did not see end may
		// still have bytes in flight: the connection cannot be reused.
		b.keep = false
	}
	if b.stop() && b.keep && err == nil {
		b.t.put(b.uc)
	} else {
		b.uc.c.Close()
	}
	return err
}
