package e2e

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"deltabox/internal/api"
	"deltabox/internal/testutil"
)

// remoteDaemon starts a daemon that also listens on TCP (args: TLS).
func remoteDaemon(t *testing.T, args ...string) (*testutil.Daemon, string) {
	t.Helper()
	return testutil.StartRemoteDaemon(t, args...)
}

// cliRun runs the deltabox binary with env added; it returns stdout and the error
// (with stderr).
func cliRun(t *testing.T, env []string, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command(testutil.Binary(t), args...)
	cmd.Env = append(os.Environ(), env...)
	var out, errb strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	if err != nil {
		err = fmt.Errorf("deltabox %s: %v: %s", strings.Join(args, " "), err, errb.String())
	}
	return out.String(), err
}

func newKey(t *testing.T, d *testutil.Daemon, name string) string {
	t.Helper()
	return testutil.NewKey(t, d, name)
}

func e2bDir() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "e2b")
}

// TestE2BSDK runs E2B's official SDK (the npm package pinned in tests/e2b) against a
// daemon on 127.0.0.1, configured only by E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY:
// create with the default template, commands (output streamed, exit codes, a timeout, a
// background command, stdin, connect), files (write, read, list, rename, remove) as E2B's
// user, info and list, pause and resume (the file and a python process of the user back),
// a snapshot and a sandbox created from it, kill; a server started in the sandbox
// fetched at getHost(port)'s address. tests/e2b/sdk_test.mjs says each
// check; it uses only the SDK's public API.
func TestE2BSDK(t *testing.T) {
	dir := e2bDir()
	_, err := os.Stat(filepath.Join(dir, "node_modules", "e2b", "package.json"))
	testutil.Require(t, err == nil, "E2B's SDK is not installed in tests/e2b (scripts/setup.sh runs npm ci there): %v", err)
	_, err = exec.LookPath("node")
	testutil.Require(t, err == nil, "node is not installed: %v", err)
	d, addr := remoteDaemon(t)
	key := newKey(t, d, "sdk")
	env, err := cliRun(t, nil, "e2b", "env", "--key", key, "--host", addr, "--domain", "deltabox.test")
	if err != nil {
		t.Fatal(err)
	}
	_, port, _ := net.SplitHostPort(addr)
	want := fmt.Sprintf("export E2B_API_URL=http://%s\nexport E2B_SANDBOX_URL=http://%s\nexport E2B_API_KEY=%s\nexport E2B_DOMAIN=deltabox.test:%s\n", addr, addr, key, port)
	if env != want {
		t.Fatalf("deltabox e2b env printed\n%s\nwant\n%s", env, want)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "node", "sdk_test.mjs")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "E2B_API_URL=http://"+addr, "E2B_SANDBOX_URL=http://"+addr, "E2B_API_KEY="+key,
		"E2B_DOMAIN=deltabox.test:"+port) // getHost's names: the script resolves them to addr
	out, err := cmd.CombinedOutput()
	t.Logf("sdk_test.mjs:\n%s", out)
	if err != nil || !strings.Contains(string(out), "all ok") {
		t.Fatalf("the SDK script failed: %v\ndaemon log:\n%s", err, d.Log())
	}
}

// TestRemoteKeys: the CLI reaches a daemon's TCP listener with DELTABOX_HOST and
// DELTABOX_API_KEY; without a key, with a wrong one or with a revoked one it is refused
// with 401 (the daemon's native API and E2B's alike). The keys file is root's (0600) and
// holds no key, only hashes.
func TestRemoteKeys(t *testing.T) {
	d, addr := remoteDaemon(t)
	key := newKey(t, d, "alice")
	other := newKey(t, d, "bob")
	st, err := os.Stat(filepath.Join(d.Root, "keys.json"))
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("keys.json: %v, mode %v: want 0600", err, st.Mode())
	}
	raw, _ := os.ReadFile(filepath.Join(d.Root, "keys.json"))
	if strings.Contains(string(raw), key) || strings.Contains(string(raw), strings.TrimPrefix(key, "e2b_")) {
		t.Fatal("keys.json holds a key in clear")
	}
	host := "DELTABOX_HOST=" + addr
	if _, err := cliRun(t, []string{host, "DELTABOX_API_KEY=" + key}, "create", "--name", "rk"); err != nil {
		t.Fatalf("create over TCP with a key: %v", err)
	}
	out, err := cliRun(t, []string{host, "DELTABOX_API_KEY=" + key}, "exec", "rk", "--", "echo", "over tcp")
	if err != nil || out != "over tcp\n" {
		t.Fatalf("exec over TCP: %q, %v", out, err)
	}
	for _, c := range []struct{ name, key string }{{"no key", ""}, {"a wrong key", "e2b_" + strings.Repeat("0", 40)}} {
		_, err := cliRun(t, []string{host, "DELTABOX_API_KEY=" + c.key}, "ls")
		if err == nil || !strings.Contains(err.Error(), "no valid API key") {
			t.Fatalf("ls over TCP with %s: %v, want a refusal naming the key", c.name, err)
		}
	}
	status := func(method, path, hdr, val string) int {
		req, _ := http.NewRequest(method, "http://"+addr+path, nil)
		if hdr != "" {
			req.Header.Set(hdr, val)
		}
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, res.Body)
		res.Body.Close()
		return res.StatusCode
	}
	if s := status("GET", "/sandboxes", "", ""); s != 401 {
		t.Fatalf("E2B list without a key: %d, want 401", s)
	}
	if s := status("GET", "/sandboxes", "X-API-Key", key); s != 200 {
		t.Fatalf("E2B list with a key: %d, want 200", s)
	}
	// Revoked: refused from the next request on, without a restart; the other key stays.
	if _, err := cliRun(t, nil, "key", "rm", "alice", "--root", d.Root); err != nil {
		t.Fatal(err)
	}
	if s := status("GET", "/v1/sandboxes", "Authorization", "Bearer "+key); s != 401 {
		t.Fatalf("native list with a revoked key: %d, want 401", s)
	}
	if _, err := cliRun(t, []string{host, "DELTABOX_API_KEY=" + key}, "ls"); err == nil {
		t.Fatal("the CLI with a revoked key was let in")
	}
	if s := status("GET", "/v1/sandboxes", "Authorization", "Bearer "+other); s != 200 {
		t.Fatalf("native list with the other key: %d, want 200", s)
	}
	ls, err := cliRun(t, nil, "key", "ls", "--root", d.Root)
	if err != nil || strings.Contains(ls, "alice") || !strings.Contains(ls, "bob") {
		t.Fatalf("key ls after rm alice: %q, %v", ls, err)
	}
	// The unix socket stays root's only.
	if st, err := os.Stat(d.Socket); err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("socket %s: %v: want mode 0600", d.Socket, err)
	}
}

// TestRemoteTLS: with --tls-cert and --tls-key the listener speaks TLS with that
// certificate, and plain HTTP is not answered. A sandbox's port is reached at
// https://getHost(port) over HTTP/2 with a wildcard certificate (*.DOMAIN), as E2B's
// users fetch it.
func TestRemoteTLS(t *testing.T) {
	dir := t.TempDir()
	priv, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "deltabox-test"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, DNSNames: []string{"*.deltabox.test"},
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &priv.PublicKey, priv)
	if err != nil {
		t.Fatal(err)
	}
	kb, _ := x509.MarshalECPrivateKey(priv)
	cf, kf := filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	os.WriteFile(cf, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600)
	os.WriteFile(kf, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}), 0o600)
	d, addr := remoteDaemon(t, "--tls-cert", cf, "--tls-key", kf)
	key := newKey(t, d, "tls")
	cert, _ := x509.ParseCertificate(der)
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}, Timeout: 10 * time.Second}
	req, _ := http.NewRequest("GET", "https://"+addr+"/v1/health", nil)
	req.Header.Set("Authorization", "Bearer "+key)
	res, err := hc.Do(req)
	if err != nil {
		t.Fatalf("health over TLS: %v", err)
	}
	var h api.ErrorBody
	json.NewDecoder(res.Body).Decode(&h)
	res.Body.Close()
	if res.StatusCode != 200 {
		t.Fatalf("health over TLS: %d", res.StatusCode)
	}
	if res, err := (&http.Client{Timeout: 5 * time.Second}).Get("http://" + addr + "/v1/health"); err == nil && res.StatusCode == 200 {
		t.Fatal("plain HTTP answered 200 on the TLS listener")
	}

	req, _ = http.NewRequest("POST", "https://"+addr+"/sandboxes", strings.NewReader(`{}`))
	req.Header.Set("X-API-Key", key)
	var sb struct{ SandboxID, TrafficAccessToken string }
	if res, err = hc.Do(req); err != nil || res.StatusCode != 201 || json.NewDecoder(res.Body).Decode(&sb) != nil {
		t.Fatalf("create over TLS: %v %v", res, err)
	}
	res.Body.Close()
	testutil.StartEchoServer(t, d, sb.SandboxID, 8000)
	var dialer net.Dialer
	h2 := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}, ForceAttemptHTTP2: true,
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return dialer.DialContext(ctx, network, addr)
		}}}
	_, port, _ := net.SplitHostPort(addr)
	req, _ = http.NewRequest("GET", "https://8000-"+sb.SandboxID+".deltabox.test:"+port+"/tls", nil)
	req.Header.Set("e2b-traffic-access-token", sb.TrafficAccessToken)
	res, err = h2.Do(req)
	if err != nil {
		t.Fatalf("getHost over TLS: %v", err)
	}
	b, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if res.StatusCode != 200 || res.ProtoMajor != 2 || !strings.HasPrefix(string(b), "GET /tls ") {
		t.Fatalf("getHost over TLS: %s %d %q, want HTTP/2 200 from the server in the sandbox", res.Proto, res.StatusCode, b)
	}
}

// TestCheckpointCarriesUserProcess: a background process of a user other than root (no
// CAP_SYS_ADMIN) in a root sandbox is carried by CRIU across a checkpoint and restore;
// the fast path once tried to move it, failed, killed it and answered 500.
func TestCheckpointCarriesUserProcess(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "cu")
	dbxSh(t, d, "cu", "useradd -u 1000 u1")
	r := dbxExec(t, d, "cu", api.ExecRequest{User: "u1", Argv: []string{"sh", "-c",
		`nohup python3 -c 'import time
n = 0
while True:
    n += 1
    open("/tmp/n", "w").write(str(n))
    time.sleep(0.05)' >/dev/null 2>&1 &`}})
	if r.ExitCode != 0 {
		t.Fatalf("start: %+v", r)
	}
	time.Sleep(300 * time.Millisecond)
	res, err := d.C.Checkpoint(dbxCtx(t), "cu", "")
	if err != nil {
		t.Fatalf("checkpoint with a uid 1000 process: %v", err)
	}
	if res.Killed != 0 || res.CRIUProcesses != 1 {
		t.Fatalf("checkpoint: killed %d, criu_processes %d: want 0 and 1", res.Killed, res.CRIUProcesses)
	}
	dbxRestore(t, d, "cu", res.Node.ID)
	if got := dbxSh(t, d, "cu", `a=$(cat /tmp/n); sleep 0.3; b=$(cat /tmp/n); [ "$b" -gt "$a" ] && ps -o user= -C python3`); got != "u1\n" {
		t.Fatalf("after the restore: %q, want the user's python counting", got)
	}
}

// TestPythonClientRemote: the Python client reaches a daemon's TCP listener with
// DELTABOX_HOST and DELTABOX_API_KEY (a run, a file, a checkpoint and a restore), and
// without the key it is refused with 401.
func TestPythonClientRemote(t *testing.T) {
	py, err := exec.LookPath("python3")
	testutil.Require(t, err == nil, "needs python3 for the Python client: %v", err)
	d, addr := remoteDaemon(t)
	key := newKey(t, d, "py")
	_, file, _, _ := runtime.Caller(0)
	src := filepath.Join(filepath.Dir(file), "..", "..", "clients", "python")
	script := `
import os, sys
from deltabox import Sandbox, DeltaBoxError
if os.environ.get("DELTABOX_API_KEY"):
    with Sandbox.create() as sb:
        sb.files.write("a.txt", "remote")
        c = sb.checkpoint()
        sb.run("rm a.txt").check()
        sb.restore(c)
        print(sb.run("cat a.txt").stdout)
else:
    try:
        Sandbox.create()
    except DeltaBoxError as e:
        print("refused", e.status)
`
	run := func(env ...string) string {
		cmd := exec.Command(py, "-c", script)
		cmd.Env = append(os.Environ(), append([]string{"PYTHONPATH=" + src, "DELTABOX_SOCKET=/nonexistent"}, env...)...)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("python: %v\n%s", err, out)
		}
		return string(out)
	}
	if got := run("DELTABOX_HOST="+addr, "DELTABOX_API_KEY="+key); got != "remote\n" {
		t.Fatalf("with the key: %q", got)
	}
	if got := run("DELTABOX_HOST=http://"+addr, "DELTABOX_API_KEY="); got != "refused 401\n" {
		t.Fatalf("without the key: %q", got)
	}
}

// TestRemoteFromAnotherNetns: a network namespace made by the test, joined to the host
// by a veth pair, plays the second machine: from there the CLI and the Python client
// reach the daemon's listener on the host's end of the pair with a key, and are refused
// without one.
func TestRemoteFromAnotherNetns(t *testing.T) {
	_, err := exec.LookPath("ip")
	testutil.Require(t, err == nil, "needs ip (iproute2) to make a network namespace: %v", err)
	var rb [2]byte
	rand.Read(rb[:])
	ns := fmt.Sprintf("dbxr%02x%02x", rb[0], rb[1])
	hostIf, nsIf := ns+"h", ns+"n"
	sub := fmt.Sprintf("10.213.%d", rb[0])
	host, peer := sub+".1", sub+".2"
	ipc := func(args ...string) {
		t.Helper()
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	ipc("netns", "add", ns)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", ns).Run(); exec.Command("ip", "link", "del", hostIf).Run() })
	ipc("link", "add", hostIf, "type", "veth", "peer", "name", nsIf)
	ipc("link", "set", nsIf, "netns", ns)
	ipc("addr", "add", host+"/30", "dev", hostIf)
	ipc("link", "set", hostIf, "up")
	ipc("netns", "exec", ns, "ip", "addr", "add", peer+"/30", "dev", nsIf)
	ipc("netns", "exec", ns, "ip", "link", "set", nsIf, "up")
	ipc("netns", "exec", ns, "ip", "link", "set", "lo", "up")

	l, err := net.Listen("tcp", host+":0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	d := testutil.StartDaemonArgs(t, testutil.NewStore(t), []string{"--listen", addr})
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if c, err := net.Dial("tcp", addr); err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no listener on %s; log:\n%s", addr, d.Log())
		}
	}
	key := newKey(t, d, "far")
	inNS := func(env []string, args ...string) (string, error) {
		cmd := exec.Command("ip", append([]string{"netns", "exec", ns}, args...)...)
		cmd.Env = append(os.Environ(), append([]string{"DELTABOX_SOCKET=/nonexistent", "DELTABOX_HOST=" + addr}, env...)...)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	bin := testutil.Binary(t)
	if out, err := inNS([]string{"DELTABOX_API_KEY=" + key}, bin, "create", "--name", "far"); err != nil {
		t.Fatalf("create from the other namespace: %v: %s", err, out)
	}
	if out, err := inNS([]string{"DELTABOX_API_KEY=" + key}, bin, "exec", "far", "--", "echo", "from afar"); err != nil || out != "from afar\n" {
		t.Fatalf("exec from the other namespace: %q, %v", out, err)
	}
	if out, err := inNS(nil, bin, "ls"); err == nil || !strings.Contains(out, "no valid API key") {
		t.Fatalf("ls without a key from the other namespace: %q, %v: want a refusal", out, err)
	}
	if py, err := exec.LookPath("python3"); err == nil {
		_, file, _, _ := runtime.Caller(0)
		src := filepath.Join(filepath.Dir(file), "..", "..", "clients", "python")
		out, err := inNS([]string{"DELTABOX_API_KEY=" + key, "PYTHONPATH=" + src}, py, "-c",
			"from deltabox import Sandbox\nprint(Sandbox.create().run('echo py afar').stdout, end='')")
		if err != nil || out != "py afar\n" {
			t.Fatalf("python client from the other namespace: %q, %v", out, err)
		}
	}
}

// TestE2BTimeout: a sandbox created with E2B's timeout is killed when it expires, or
// paused with autoPause (and then resumes on connect).
func TestE2BTimeout(t *testing.T) {
	d, addr := remoteDaemon(t)
	key := newKey(t, d, "k")
	do := func(method, path, body string) (int, map[string]any) {
		req, _ := http.NewRequest(method, "http://"+addr+path, strings.NewReader(body))
		req.Header.Set("X-API-Key", key)
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer res.Body.Close()
		var m map[string]any
		json.NewDecoder(res.Body).Decode(&m)
		return res.StatusCode, m
	}
	_, killed := do("POST", "/sandboxes", `{"templateID":"base","timeout":1}`)
	_, paused := do("POST", "/sandboxes", `{"templateID":"base","timeout":1,"autoPause":true}`)
	_, kept := do("POST", "/sandboxes", `{"templateID":"base","timeout":60}`)
	time.Sleep(3 * time.Second)
	if s, _ := do("GET", "/sandboxes/"+killed["sandboxID"].(string), ""); s != 404 {
		t.Fatalf("a sandbox past its timeout: %d, want 404", s)
	}
	if s, m := do("GET", "/sandboxes/"+paused["sandboxID"].(string), ""); s != 200 || m["state"] != "paused" {
		t.Fatalf("an autoPause sandbox past its timeout: %d %v, want paused", s, m["state"])
	}
	if s, _ := do("POST", "/sandboxes/"+paused["sandboxID"].(string)+"/connect", `{"timeout":60}`); s != 201 {
		t.Fatalf("connect to the paused sandbox: %d, want 201 (resumed)", s)
	}
	if s, m := do("GET", "/sandboxes/"+kept["sandboxID"].(string), ""); s != 200 || m["state"] != "running" {
		t.Fatalf("a sandbox within its timeout: %d %v", s, m["state"])
	}
}
