package e2e

// Network through the daemon (issue 28): egress off by default, allowed by domain,
// wildcard and CIDR through the daemon's proxy, with no configuration inside; counters
// and a log line per refusal. "The internet" is a network namespace the test makes
// (testutil.NewInternet). Bypasses are in tests/security/net_test.go.

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"deltabox/internal/api"
	"deltabox/internal/apitypes"
	"deltabox/internal/state"
	"deltabox/internal/testutil"
)

// netProbe runs testutil.NetProbe in sandbox id and returns its one line.
func netProbe(t *testing.T, d *testutil.Daemon, id string, args ...string) string {
	t.Helper()
	res := dbxExec(t, d, id, api.ExecRequest{Argv: append([]string{"python3", "-c", testutil.NetProbe}, args...)})
	return strings.TrimSpace(res.Stdout + res.Stderr)
}

func TestNetEgressAllowList(t *testing.T) {
	in := testutil.NewInternet(t)
	d := testutil.StartDaemonEnv(t, testutil.NewStore(t), "DELTABOX_NET_DNS="+in.DNSAddr())
	sb, err := d.C.Create(dbxCtx(t), state.CreateOptions{Network: &apitypes.Network{
		AllowOut: []string{"allowed.test", "*.wild.test", in.Raw.String() + "/32"},
		DenyOut:  []string{"secret.allowed.test"}}})
	if err != nil {
		t.Fatal(err)
	}
	if sb.Network == nil || len(sb.Network.AllowOut) != 3 {
		t.Fatalf("the sandbox does not report its network rules: %+v", sb.Network)
	}
	ok := []struct{ args []string }{
		{[]string{"get", "http://allowed.test/"}},        // name via DNS, HTTP Host
		{[]string{"get", "https://allowed.test/"}},       // TLS SNI
		{[]string{"get", "http://www.wild.test/"}},       // wildcard
		{[]string{"get", "http://" + in.Raw.String()}},   // CIDR
		{[]string{"dns", "allowed.test"}},                // DNS answers without configuration
		{[]string{"tcp", in.Allowed.String(), "80", ""}}, // its address, no name: DNS gave it for allowed.test
	}
	want := []string{"OK allowed", "OK allowed-tls", "OK allowed", "OK raw", "OK " + in.Allowed.String(), "OK allowed"}
	for i, c := range ok {
		if got := netProbe(t, d, sb.ID, c.args...); got != want[i] {
			t.Errorf("%v: got %q, want %q", c.args, got, want[i])
		}
	}
	refused := [][]string{
		{"tcp", in.Denied.String(), "80", "denied.test"},  // an address outside the list
		{"tcp", in.Denied.String(), "80", "allowed.test"}, // an allowed name at another address
		{"tcp", in.Allowed.String(), "80", "denied.test"}, // a denied name at an allowed address
		{"get", "http://" + in.Denied.String()},
	}
	for _, args := range refused {
		if got := netProbe(t, d, sb.ID, args...); strings.HasPrefix(got, "OK") {
			t.Errorf("%v went through: %q", args, got)
		}
	}
	for _, name := range []string{"denied.test", "secret.allowed.test"} {
		if got := netProbe(t, d, sb.ID, "dns", name); strings.HasPrefix(got, "OK") {
			t.Errorf("DNS for %s answered: %q", name, got)
		}
	}
	for _, q := range in.Queries() {
		if q == "denied.test" || q == "secret.allowed.test" {
			t.Errorf("the upstream DNS server was asked for %s, which the rules deny", q)
		}
	}

	info, err := d.C.Get(dbxCtx(t), sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	if info.Usage == nil || info.Usage.Network == nil {
		t.Fatalf("no network usage: %+v", info.Usage)
	}
	n := info.Usage.Network
	if n.Connections != 5 || n.Refused != int64(len(refused)) || n.DNSRefused != 2 || n.BytesIn == 0 || n.BytesOut == 0 {
		t.Errorf("counters %+v: want 5 connections, %d refused, 2 names refused, bytes both ways", n, len(refused))
	}
	if logged := strings.Count(d.Log(), "network: refused\""); int64(logged) != n.Refused {
		t.Errorf("%d refusals logged, %d counted:\n%s", logged, n.Refused, d.Log())
	}
}

// TestNetOffByDefault: a sandbox created without "network" reaches nothing, and a
// create with an empty or malformed list is a 400 saying what to write.
func TestNetOffByDefault(t *testing.T) {
	in := testutil.NewInternet(t)
	d := testutil.StartDaemonEnv(t, testutil.NewStore(t), "DELTABOX_NET_DNS="+in.DNSAddr())
	sb := dbxCreate(t, d, "")
	for _, args := range [][]string{{"get", "http://" + in.Allowed.String()}, {"dns", "allowed.test"}} {
		if got := netProbe(t, d, sb.ID, args...); !strings.HasPrefix(got, "ERR") {
			t.Errorf("%v without network: %q", args, got)
		}
	}
	for _, nw := range []*apitypes.Network{{}, {AllowOut: []string{"bad name!"}}, {AllowOut: []string{"10.0.0.0/33"}}} {
		_, err := d.C.Create(dbxCtx(t), state.CreateOptions{Network: nw})
		if err == nil || !strings.Contains(err.Error(), "allow_out") {
			t.Errorf("create with %+v: %v, want a 400 naming allow_out", nw, err)
		}
	}
}

// TestNetPorts: a server inside a sandbox without network is reached through the
// daemon (ports/{port}/path, query and body kept); nothing listening is a clear error;
// the sandbox still has no route out.
func TestNetPorts(t *testing.T) {
	d := testutil.StartDaemon(t)
	sb := dbxCreate(t, d, "")
	dbxSh(t, d, sb.ID, `cat > /tmp/srv.py <<'PY'
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self): self.reply(b"")
    def do_POST(self): self.reply(self.rfile.read(int(self.headers["Content-Length"])))
    def reply(self, body):
        out = b"%s %s %s" % (self.command.encode(), self.path.encode(), body)
        self.send_response(200); self.send_header("Content-Length", str(len(out))); self.end_headers(); self.wfile.write(out)
http.server.HTTPServer(("127.0.0.1", 8000), H).serve_forever()
PY
(setsid python3 /tmp/srv.py >/dev/null 2>&1 &); for i in $(seq 50); do python3 -c 'import socket; socket.create_connection(("127.0.0.1", 8000))' 2>/dev/null && exit 0; sleep 0.1; done; exit 1`)
	for _, c := range []struct{ method, path, body, want string }{
		{"GET", "a/b?x=1", "", "GET /a/b?x=1 "},
		{"POST", "", "hello", "POST / hello"},
	} {
		resp, err := d.C.Port(dbxCtx(t), sb.ID, 8000, c.method, c.path, strings.NewReader(c.body))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || string(b) != c.want {
			t.Errorf("%s %s: %d %q, want 200 %q", c.method, c.path, resp.StatusCode, b, c.want)
		}
	}
	resp, err := d.C.Port(dbxCtx(t), sb.ID, 8001, "GET", "", nil)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 503 || !strings.Contains(string(b), "nothing answers on port 8001") {
		t.Errorf("nothing on 8001: %d %s", resp.StatusCode, b)
	}
	if got := netProbe(t, d, sb.ID, "tcp", "192.0.2.1", "80"); !strings.HasPrefix(got, "ERR") {
		t.Errorf("a sandbox whose port is used reaches out: %q", got)
	}
}

// TestNetPythonClient: Sandbox.create(network=...) gives a sandbox the rules, and a
// request from inside goes through; a bad key is a TypeError before any request.
func TestNetPythonClient(t *testing.T) {
	py, err := exec.LookPath("python3")
	testutil.Require(t, err == nil, "needs python3 for the Python client: %v", err)
	in := testutil.NewInternet(t)
	d := testutil.StartDaemonEnv(t, testutil.NewStore(t), "DELTABOX_NET_DNS="+in.DNSAddr())
	repo := pycRepo(t)
	script := `
import sys, deltabox
with deltabox.Sandbox.create(network={"allow_out": ["allowed.test"]}) as sb:
    r = sb.run(["python3", "-c", sys.argv[1], "get", "http://allowed.test/"])
    print(r.stdout.strip(), sb.info()["usage"]["network"]["connections"])
try:
    deltabox.Sandbox.create(network={"allow": ["x"]})
except TypeError as e:
    print("TypeError", e)
`
	out, err := pycCmd(t, py, repo, map[string]string{"DELTABOX_SOCKET": d.Socket, "PYTHONPATH": filepath.Join(repo, "clients", "python")},
		"-c", script, testutil.NetProbe).CombinedOutput()
	if err != nil {
		t.Fatalf("python client: %v\n%s", err, out)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if len(lines) != 2 || lines[0] != "OK allowed 1" || !strings.HasPrefix(lines[1], "TypeError network: unknown keys ['allow']") {
		t.Errorf("python client's network: %q", out)
	}
}

// TestNetCheckpointKeepsFastPath (the NPD): a python session that makes keep-alive
// requests through the proxy between checkpoints is checkpointed and restored 20 times
// in a row on the fast path (its process taken by a template fork, none by CRIU, no
// session ended): at each checkpoint the proxy resets the idle connection, and the
// process's closed socket is replaced by a fresh one in every live copy. Its next
// request after each checkpoint and each restore succeeds, reconnecting as urllib3 does
// on a dropped connection.
func TestNetCheckpointKeepsFastPath(t *testing.T) {
	in := testutil.NewInternet(t)
	d := testutil.StartDaemonEnv(t, testutil.NewStore(t), "DELTABOX_NET_DNS="+in.DNSAddr())
	sb, err := d.C.Create(dbxCtx(t), state.CreateOptions{Network: &apitypes.Network{AllowOut: []string{"allowed.test"}}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.C.StartSession(dbxCtx(t), sb.ID, state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	sessRun(t, d, sb.ID, "py", `import http.client
c = http.client.HTTPConnection("allowed.test", 80, timeout=10)
reconnects = 0
def ask():
    global c, reconnects
    try:
        c.request("GET", "/")
        return c.getresponse().read().decode()
    except (OSError, http.client.HTTPException):
        c.close()
        reconnects += 1
        c.request("GET", "/")
        return c.getresponse().read().decode()`)
	const probe = `(ask(), ask(), c.sock is not None)`
	want := `('allowed', 'allowed', True)` // two requests on one kept-alive connection
	var nodes []string
	check := func(what string, op *state.OpResult) {
		t.Helper()
		if op.Processes != 1 || op.CRIUProcesses != 0 || len(op.SessionsEnded) != 0 {
			t.Fatalf("%s: processes %d, criu_processes %d, sessions ended %v (%v): want the session on the fast path",
				what, op.Processes, op.CRIUProcesses, op.SessionsEnded, op.ProcessErrors)
		}
	}
	for i := 0; i < 20; i++ {
		if got := strings.TrimSpace(sessRun(t, d, sb.ID, "py", probe)); got != want {
			t.Fatalf("round %d before the checkpoint: %s, want %s", i, got, want)
		}
		op := dbxCheckpoint(t, d, sb.ID, "")
		check("checkpoint", op)
		nodes = append(nodes, op.Node.ID)
		if got := strings.TrimSpace(sessRun(t, d, sb.ID, "py", probe)); got != want {
			t.Fatalf("round %d after the checkpoint: %s, want %s", i, got, want)
		}
		check("restore", dbxRestore(t, d, sb.ID, nodes[len(nodes)/2]))
		if got := strings.TrimSpace(sessRun(t, d, sb.ID, "py", probe)); got != want {
			t.Fatalf("round %d after the restore: %s, want %s", i, got, want)
		}
	}
	// The templates hold the reset sockets: their durable images (CRIU) take them.
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		n, err := d.C.Node(dbxCtx(t), nodes[0])
		if err != nil {
			t.Fatal(err)
		}
		if im := n.ProcessImage; im != nil && im.State == "complete" {
			break
		} else if im != nil && im.State == "failed" {
			t.Fatalf("the durable image of a node whose template holds a reset socket: %s", im.Error)
		} else if time.Now().After(deadline) {
			t.Fatalf("the durable image of node %s not complete within 60 s: %+v", nodes[0], im)
		}
	}
	info, err := d.C.Get(dbxCtx(t), sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	if n := info.Usage.Network; n == nil || n.Refused != 0 || n.Connections < 40 {
		t.Errorf("counters after 20 rounds: %+v", n)
	}
}

// TestNetCheckpointWaitsForRequests: a request in flight through the proxy refuses a
// checkpoint without wait_ms (409 naming the connection, which stays open), and a
// checkpoint with wait_ms waits for its answer, which the process gets whole.
func TestNetCheckpointWaitsForRequests(t *testing.T) {
	in := testutil.NewInternet(t)
	d := testutil.StartDaemonEnv(t, testutil.NewStore(t), "DELTABOX_NET_DNS="+in.DNSAddr())
	sb, err := d.C.Create(dbxCtx(t), state.CreateOptions{Network: &apitypes.Network{AllowOut: []string{"allowed.test"}}})
	if err != nil {
		t.Fatal(err)
	}
	// Two slow requests, one after the other, in the background (3 s in all).
	dbxSh(t, d, sb.ID, `(setsid python3 -c '
import urllib.request
for i in range(2): open("/tmp/got%d" % i, "w").write(urllib.request.urlopen("http://allowed.test/slow", timeout=10).read().decode())
' >/dev/null 2>&1 &)`)
	waitOpen := func() {
		t.Helper()
		for start := time.Now(); time.Since(start) < 10*time.Second; time.Sleep(20 * time.Millisecond) {
			info, err := d.C.Get(dbxCtx(t), sb.ID)
			if err == nil && info.Usage != nil && info.Usage.Network != nil && info.Usage.Network.Open == 1 {
				return
			}
		}
		t.Fatal("the background request never opened its connection")
	}
	waitOpen()
	_, err = d.C.Checkpoint(dbxCtx(t), sb.ID, "")
	if err == nil || !strings.Contains(err.Error(), "still carry a request") || !strings.Contains(err.Error(), "allowed.test") {
		t.Fatalf("checkpoint with a request in flight and no wait_ms: %v, want a 409 naming allowed.test", err)
	}
	t0 := time.Now()
	op, err := d.C.CheckpointWith(dbxCtx(t), sb.ID, apitypes.CheckpointRequest{WaitMS: 5000, EndBackground: true})
	if err != nil {
		t.Fatalf("checkpoint with wait_ms 5000: %v", err)
	}
	if time.Since(t0) < 200*time.Millisecond {
		t.Errorf("checkpoint with wait_ms took %v: it did not wait for the request", time.Since(t0))
	}
	_ = op
	if got := dbxSh(t, d, sb.ID, "cat /tmp/got0"); got != "allowed" {
		t.Errorf("the first answer, which the checkpoint waited for: %q", got)
	}
}

// TestNetCheckpointWaitsForAnswerEnd: a process that has read an answer's bytes but
// not yet its end (the server closed: HTTP/1.0) is still reading it. A checkpoint with
// wait_ms waits until it has (its socket closed), instead of resetting the connection
// under it, which would turn its last read into an error after it had every byte.
func TestNetCheckpointWaitsForAnswerEnd(t *testing.T) {
	in := testutil.NewInternet(t)
	d := testutil.StartDaemonEnv(t, testutil.NewStore(t), "DELTABOX_NET_DNS="+in.DNSAddr())
	sb, err := d.C.Create(dbxCtx(t), state.CreateOptions{Network: &apitypes.Network{AllowOut: []string{"allowed.test"}}})
	if err != nil {
		t.Fatal(err)
	}
	dbxSh(t, d, sb.ID, `(setsid python3 -c '
import socket, time
s = socket.create_connection(("allowed.test", 80))
s.sendall(b"GET / HTTP/1.0\r\nHost: allowed.test\r\n\r\n")
time.sleep(0.5)
data = s.recv(65536)
open("/tmp/read1", "w").write(str(len(data)))
time.sleep(1.5)
end = s.recv(65536)
open("/tmp/got", "w").write("end" if end == b"" else "more")
s.close()
' >/dev/null 2>/tmp/err &)`)
	dbxSh(t, d, sb.ID, `for i in $(seq 1000); do [ -s /tmp/read1 ] && exit 0; sleep 0.01; done; echo "the process never read its answer" >&2; cat /tmp/err >&2; exit 1`)
	t0 := time.Now()
	if _, err := d.C.CheckpointWith(dbxCtx(t), sb.ID, apitypes.CheckpointRequest{WaitMS: 5000}); err != nil {
		t.Fatalf("checkpoint with wait_ms 5000: %v", err)
	}
	t.Logf("the checkpoint waited %v for the answer's end to be read", time.Since(t0))
	got := dbxSh(t, d, sb.ID, `for i in $(seq 500); do [ -s /tmp/got ] && break; sleep 0.01; done; cat /tmp/got; cat /tmp/err`)
	if got != "end" {
		t.Errorf("the process's read of the answer's end after the checkpoint: %q, want end", got)
	}
}

// TestNetCheckpointWaitsForAnswerRead: an answer the proxy has relayed whole but the
// sandbox's process has not read yet is a request still in flight. The process sleeps
// 1.5 s between sending its request and reading the answer; a checkpoint meanwhile took
// the connection for idle, reset it, and the fast path gave the process a fresh socket:
// the answer was lost, and its recv failed with ENOTCONN (what made
// TestNetCheckpointWaitsForRequests fail under load). Without wait_ms the checkpoint is
// refused naming the connection; with it, it waits until the answer is read.
func TestNetCheckpointWaitsForAnswerRead(t *testing.T) {
	in := testutil.NewInternet(t)
	d := testutil.StartDaemonEnv(t, testutil.NewStore(t), "DELTABOX_NET_DNS="+in.DNSAddr())
	sb, err := d.C.Create(dbxCtx(t), state.CreateOptions{Network: &apitypes.Network{AllowOut: []string{"allowed.test"}}})
	if err != nil {
		t.Fatal(err)
	}
	dbxSh(t, d, sb.ID, `(setsid python3 -c '
import socket, time
s = socket.create_connection(("allowed.test", 80))
s.sendall(b"GET / HTTP/1.0\r\nHost: allowed.test\r\n\r\n")
time.sleep(1.5)
data = b""
while True:
    b = s.recv(4096)
    if not b:
        break
    data += b
open("/tmp/got", "w").write(data.decode().split("\r\n\r\n", 1)[1])
' >/dev/null 2>/tmp/err &)`)
	for start := time.Now(); ; time.Sleep(10 * time.Millisecond) {
		info, err := d.C.Get(dbxCtx(t), sb.ID)
		if err == nil && info.Usage != nil && info.Usage.Network != nil && info.Usage.Network.BytesIn > 0 {
			break
		}
		if time.Since(start) > 10*time.Second {
			t.Fatal("the answer never went through the proxy")
		}
	}
	_, err = d.C.Checkpoint(dbxCtx(t), sb.ID, "")
	if err == nil || !strings.Contains(err.Error(), "still carry a request") || !strings.Contains(err.Error(), "allowed.test") {
		t.Fatalf("checkpoint with an answer unread and no wait_ms: %v, want a 409 naming allowed.test", err)
	}
	t0 := time.Now()
	if _, err := d.C.CheckpointWith(dbxCtx(t), sb.ID, apitypes.CheckpointRequest{WaitMS: 5000}); err != nil {
		t.Fatalf("checkpoint with wait_ms 5000: %v", err)
	}
	t.Logf("the checkpoint waited %v for the answer to be read", time.Since(t0))
	got := dbxSh(t, d, sb.ID, `for i in $(seq 500); do [ -s /tmp/got ] && break; sleep 0.01; done; cat /tmp/got; cat /tmp/err`)
	if got != "allowed" {
		t.Errorf("the answer the process read after the checkpoint: %q, want allowed", got)
	}

	// Bytes a process leaves unread for longer than netproxy's unreadWindow (3 s) are not
	// an answer it is reading: they hold no checkpoint, and the reset drops them.
	info, err := d.C.Get(dbxCtx(t), sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	before := info.Usage.Network.BytesIn
	dbxSh(t, d, sb.ID, `(setsid python3 -c '
import socket, time
s = socket.create_connection(("allowed.test", 80))
s.sendall(b"GET / HTTP/1.0\r\nHost: allowed.test\r\n\r\n")
time.sleep(1000)
' >/dev/null 2>&1 &)`)
	var answered time.Time
	for start := time.Now(); ; time.Sleep(10 * time.Millisecond) {
		info, err := d.C.Get(dbxCtx(t), sb.ID)
		if err == nil && info.Usage.Network.BytesIn > before {
			answered = time.Now()
			break
		}
		if time.Since(start) > 10*time.Second {
			t.Fatal("the second answer never went through the proxy")
		}
	}
	time.Sleep(time.Until(answered.Add(3500 * time.Millisecond)))
	if _, err := d.C.Checkpoint(dbxCtx(t), sb.ID, "stale"); err != nil {
		t.Errorf("checkpoint with an answer left unread for 3.5 s: %v, want it taken (the connection reset)", err)
	}
}

// TestNetModelEndpoint: a sandbox with a model endpoint (and no other egress) reaches it
// as http://model.deltabox.internal, the proxy adding the key; the key is in no answer
// of the API, no file, environment or process memory of the sandbox; a python session
// keeping a connection to it stays on the fast path over checkpoints and restores.
func TestNetModelEndpoint(t *testing.T) {
	in := testutil.NewInternet(t)
	d := testutil.StartDaemonEnv(t, testutil.NewStore(t), "DELTABOX_NET_DNS="+in.DNSAddr())
	sb, err := d.C.Create(dbxCtx(t), state.CreateOptions{Network: &apitypes.Network{
		Model: &apitypes.ModelEndpoint{URL: "http://allowed.test/v1", Key: in.ModelKey}}})
	if err != nil {
		t.Fatal(err)
	}
	if sb.Network == nil || sb.Network.Model == nil || sb.Network.Model.Key != "" || !sb.Network.Model.KeySet {
		t.Fatalf("the create's answer shows the model as %+v", sb.Network)
	}
	if got := netProbe(t, d, sb.ID, "get", "http://"+apitypes.ModelHost+"/chat/completions"); got != "OK authorized /v1/chat/completions" {
		t.Errorf("the model through the proxy: %q", got)
	}
	if got := netProbe(t, d, sb.ID, "get", "http://allowed.test/"); !strings.HasPrefix(got, "ERR") {
		t.Errorf("a sandbox with only a model reached allowed.test: %q", got)
	}
	if _, err := d.C.StartSession(dbxCtx(t), sb.ID, state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	sessRun(t, d, sb.ID, "py", `import http.client
c = http.client.HTTPConnection("`+apitypes.ModelHost+`", timeout=10)
def ask():
    global c
    try:
        c.request("POST", "/chat/completions", body=b"{}", headers={"Authorization": "Bearer not-the-key"})
        return c.getresponse().read().decode()
    except (OSError, http.client.HTTPException):
        c.close()
        c.request("POST", "/chat/completions", body=b"{}")
        return c.getresponse().read().decode()`)
	want := "('authorized /v1/chat/completions', True)"
	var first string
	for i := 0; i < 5; i++ {
		if got := strings.TrimSpace(sessRun(t, d, sb.ID, "py", "(ask(), c.sock is not None)")); got != want {
			t.Fatalf("round %d: %s, want %s", i, got, want)
		}
		op := dbxCheckpoint(t, d, sb.ID, "")
		if op.Processes != 1 || op.CRIUProcesses != 0 {
			t.Fatalf("checkpoint %d: processes %d, criu %d (%v)", i, op.Processes, op.CRIUProcesses, op.ProcessErrors)
		}
		if first == "" {
			first = op.Node.ID
		}
		if got := strings.TrimSpace(sessRun(t, d, sb.ID, "py", "ask()")); got != "'authorized /v1/chat/completions'" {
			t.Fatalf("round %d after the checkpoint: %s", i, got)
		}
		if op := dbxRestore(t, d, sb.ID, first); op.Processes != 1 || op.CRIUProcesses != 0 {
			t.Fatalf("restore %d: processes %d, criu %d", i, op.Processes, op.CRIUProcesses)
		}
	}
	// The key: nowhere in the environment, command line or readable memory of any
	// process of the sandbox (init, the python session, its fast-path templates), read
	// from the host as root: a command cannot read another command's /proc/PID/environ
	// or /proc/PID/mem (each runs in a Landlock domain of its own). No command given
	// the key has run in the sandbox yet.
	info0, err := d.C.Get(dbxCtx(t), sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	procs := netSandboxPids(t, dbxCgroupDir(t, info0.InitPid))
	if len(procs) < 2 {
		t.Fatalf("the sandbox's cgroup holds %v, want init and the python session at least", procs)
	}
	for _, h := range procs {
		if where := netProcHolds(h, []byte(in.ModelKey)); where != "" {
			exe, _ := os.Readlink(fmt.Sprintf("/proc/%d/exe", h))
			t.Errorf("the model key is in process %d (host pid, %s) of the sandbox: %s", h, exe, where)
		}
	}
	// Nor in its files, grepped from inside through the sandbox's own view of its mounts
	// (after the memory: this command carries the key to the sandbox's init).
	res := dbxExec(t, d, sb.ID, api.ExecRequest{Argv: []string{"bash", "-c", `grep -rlsF -- "$1" /workspace /tmp /etc /root; [ $? != 0 ]`, "bash", in.ModelKey}})
	if res.ExitCode != 0 || res.Stdout != "" {
		t.Errorf("the model key is in the sandbox's files (exit %d):\n%s%s", res.ExitCode, res.Stdout, res.Stderr)
	}
	// Nor in the node's durable image (CRIU's dump of the session's template and its
	// pages), once written.
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		n, err := d.C.Node(dbxCtx(t), first)
		if err != nil {
			t.Fatal(err)
		}
		if im := n.ProcessImage; im != nil && im.State == "complete" {
			break
		} else if (im != nil && im.State == "failed") || time.Now().After(deadline) {
			t.Fatalf("node %s's durable image: %+v", first, im)
		}
	}
	files := 0
	filepath.WalkDir(filepath.Join(d.Root, "durable"), func(p string, e os.DirEntry, err error) error {
		if err != nil || !e.Type().IsRegular() {
			return nil
		}
		files++
		if b, err := os.ReadFile(p); err == nil && bytes.Contains(b, []byte(in.ModelKey)) {
			t.Errorf("the model key is in the durable image file %s", p)
		}
		return nil
	})
	if files == 0 {
		t.Errorf("no durable image file under %s", filepath.Join(d.Root, "durable"))
	}
	info, _ := d.C.Get(dbxCtx(t), sb.ID)
	if b, _ := json.Marshal(info); strings.Contains(string(b), in.ModelKey) {
		t.Errorf("GET /v1/sandboxes/%s shows the key", sb.ID)
	}
}

// TestNetAfterDaemonRestart: the next daemon adopts a sandbox with a network and serves
// it again (new listeners, the namespace's rules replaced to name them); a denied
// destination stays refused.
func TestNetAfterDaemonRestart(t *testing.T) {
	in := testutil.NewInternet(t)
	root := testutil.NewStore(t)
	d := testutil.StartDaemonEnv(t, root, "DELTABOX_NET_DNS="+in.DNSAddr())
	sb, err := d.C.Create(dbxCtx(t), state.CreateOptions{Network: &apitypes.Network{AllowOut: []string{"allowed.test"}}})
	if err != nil {
		t.Fatal(err)
	}
	if got := netProbe(t, d, sb.ID, "get", "http://allowed.test/"); got != "OK allowed" {
		t.Fatalf("before the restart: %q", got)
	}
	d.Stop()
	d = testutil.StartDaemonEnv(t, root, "DELTABOX_NET_DNS="+in.DNSAddr())
	if got := netProbe(t, d, sb.ID, "get", "http://allowed.test/"); got != "OK allowed" {
		t.Errorf("after the restart: %q\n%s", got, d.Log())
	}
	if got := netProbe(t, d, sb.ID, "get", "http://"+in.Denied.String()+"/"); strings.HasPrefix(got, "OK") {
		t.Errorf("after the restart a denied address answered: %q", got)
	}
	info, err := d.C.Get(dbxCtx(t), sb.ID)
	if err != nil || info.Usage == nil || info.Usage.Network == nil || info.Usage.Network.Connections != 1 || info.Usage.Network.Refused != 1 {
		t.Errorf("counters after the restart (from zero): %+v %v", info.Usage, err)
	}
}

// TestNetGitOverHTTPS: git, unconfigured, clones over https from an allowed name
// through the proxy (git's dumb HTTP protocol, TLS with SNI; the test's certificate is
// self-signed, hence sslVerify off), and cannot from a denied one.
func TestNetGitOverHTTPS(t *testing.T) {
	_, err := exec.LookPath("git")
	testutil.Require(t, err == nil, "needs git on the host to make the repository")
	in := testutil.NewInternet(t)
	repo := filepath.Join(t.TempDir(), "repo.git")
	work := t.TempDir()
	for _, args := range [][]string{
		{"init", "-q", "-b", "main", work},
		{"-C", work, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "served through the proxy"},
		{"clone", "-q", "--bare", work, repo},
		{"-C", repo, "update-server-info"},
	} {
		if out, err := exec.Command("git", args...).CombinedOutput(); err != nil {
			t.Fatalf("git %v: %v: %s", args, err, out)
		}
	}
	in.ServeDir("repo.git", repo)
	d := testutil.StartDaemonEnv(t, testutil.NewStore(t), "DELTABOX_NET_DNS="+in.DNSAddr())
	sb, err := d.C.Create(dbxCtx(t), state.CreateOptions{Network: &apitypes.Network{AllowOut: []string{"allowed.test"}}})
	if err != nil {
		t.Fatal(err)
	}
	out := dbxSh(t, d, sb.ID, "git -c http.sslVerify=false clone -q https://allowed.test/repo.git /tmp/c && git -C /tmp/c log --format=%s")
	if strings.TrimSpace(out) != "served through the proxy" {
		t.Errorf("git clone over https: %q", out)
	}
	res := dbxExec(t, d, sb.ID, api.ExecRequest{Argv: []string{"bash", "-c", "git -c http.sslVerify=false clone -q https://denied.test/repo.git /tmp/d"}})
	if res.ExitCode == 0 {
		t.Errorf("git cloned from a denied name")
	}
}

// netSandboxPids lists the host pids of every process in the cgroup dir and the
// cgroups under it.
func netSandboxPids(t *testing.T, dir string) []int {
	t.Helper()
	var pids []int
	err := filepath.WalkDir(dir, func(p string, e os.DirEntry, err error) error {
		if err == nil && e.Name() == "cgroup.procs" {
			pids = append(pids, dbxReadPids(p)...)
		}
		return err
	})
	if err != nil {
		t.Fatalf("listing the processes of cgroup %s: %v", dir, err)
	}
	return pids
}

// netProcHolds says where host process pid holds key: its environment, its command
// line or a readable mapping of its memory ("" when nowhere; a memory root cannot
// open fails the check rather than passing it). A process gone meanwhile
// holds nothing; a mapping the kernel will not let root read (a guard page, [vvar])
// is skipped.
func netProcHolds(pid int, key []byte) string {
	for _, f := range []string{"environ", "cmdline"} {
		if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/%s", pid, f)); err == nil && bytes.Contains(b, key) {
			return f
		}
	}
	maps, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		return ""
	}
	mem, err := os.Open(fmt.Sprintf("/proc/%d/mem", pid))
	if err != nil {
		return "unknown, its memory is unreadable to root: " + err.Error()
	}
	defer mem.Close()
	for _, l := range strings.Split(string(maps), "\n") {
		fs := strings.Fields(l)
		if len(fs) < 2 || !strings.HasPrefix(fs[1], "r") {
			continue
		}
		lo, hi, _ := strings.Cut(fs[0], "-")
		a, err1 := strconv.ParseUint(lo, 16, 64)
		b, err2 := strconv.ParseUint(hi, 16, 64)
		if err1 != nil || err2 != nil {
			continue
		}
		buf := make([]byte, b-a)
		n, _ := mem.ReadAt(buf, int64(a))
		if bytes.Contains(buf[:n], key) {
			return "memory " + l
		}
	}
	return ""
}
