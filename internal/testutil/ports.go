package testutil

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"testing"
	"time"

	"deltabox/internal/apitypes"
)

// echoServer answers every request with its method, path and body on the first line
// and its headers after; a GET with "Upgrade: echo" is switched (101) to echoing lines
// back, a stand-in for a WebSocket.
const echoServer = `import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        if self.headers.get("Upgrade") == "echo":
            self.send_response(101); self.send_header("Upgrade", "echo"); self.send_header("Connection", "Upgrade"); self.end_headers()
            while True:
                line = self.rfile.readline()
                if not line: break
                self.wfile.write(line)
            self.close_connection = True
            return
        self.reply(b"")
    def do_POST(self): self.reply(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
    def reply(self, body):
        out = b"%s %s %s\n%s" % (self.command.encode(), self.path.encode(), body, str(self.headers).encode())
        self.send_response(200); self.send_header("Content-Length", str(len(out))); self.end_headers(); self.wfile.write(out)
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), H).serve_forever()
`

// StartEchoServer starts echoServer on port inside sandbox id (as root, in the
// background) and returns once it accepts connections, within 10 s.
func StartEchoServer(t testing.TB, d *Daemon, id string, port int) {
	t.Helper()
	script := fmt.Sprintf(`cat > /tmp/echo%[1]d.py <<'PY'
%[2]sPY
(setsid python3 /tmp/echo%[1]d.py %[1]d >/dev/null 2>&1 &)
for i in $(seq 100); do python3 -c 'import socket; socket.create_connection(("127.0.0.1", %[1]d))' 2>/dev/null && exit 0; sleep 0.1; done
echo "the echo server does not listen on %[1]d within 10 s" >&2; exit 1`, port, echoServer)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	r, err := d.C.Exec(ctx, id, apitypes.ExecRequest{Argv: []string{"bash", "-c", script}, TimeoutMS: 30_000})
	if err != nil || r.ExitCode != 0 {
		t.Fatalf("start the echo server on port %d in %s: %v %+v", port, id, err, r)
	}
}

// HostClient is an HTTP client that connects to addr whatever the URL's host, so a
// test can ask for E2B's getHost names (PORT-SANDBOXID.DOMAIN) without DNS.
func HostClient(addr string) *http.Client {
	var d net.Dialer
	return &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return d.DialContext(ctx, network, addr)
		},
	}}
}
