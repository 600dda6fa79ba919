package security

import (
	"encoding/json"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"testing"

	"deltabox/internal/testutil"
)

// e2bClient speaks to a daemon's TCP listener in these tests.
type e2bClient struct {
	t    *testing.T
	addr string
}

func (c e2bClient) do(method, path string, hdr map[string]string, body string) (int, []byte) {
	req, _ := http.NewRequest(method, "http://"+c.addr+path, strings.NewReader(body))
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		c.t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return res.StatusCode, b
}

type e2bRef struct {
	SandboxID          string `json:"sandboxID"`
	EnvdAccessToken    string `json:"envdAccessToken"`
	TrafficAccessToken string `json:"trafficAccessToken"`
}

func (c e2bClient) create(key string) e2bRef {
	s, b := c.do("POST", "/sandboxes", map[string]string{"X-API-Key": key}, `{"templateID":"base"}`)
	var r e2bRef
	if s != 201 || json.Unmarshal(b, &r) != nil || r.EnvdAccessToken == "" {
		c.t.Fatalf("create: %d %s", s, b)
	}
	return r
}

// envd headers for sandbox r (tok "": none).
func envdHdr(id, tok string) map[string]string {
	m := map[string]string{"E2b-Sandbox-Id": id, "Content-Type": "application/json"}
	if tok != "" {
		m["X-Access-Token"] = tok
	}
	return m
}

// TestE2BEnvdAccess: envd traffic needs its sandbox's access token (or a key): none, or
// another sandbox's, is a 401; the E2B control plane without a key is a 401; a killed
// sandbox is a 502 (E2B's answer for a sandbox that is not running).
func TestE2BEnvdAccess(t *testing.T) {
	d, addr := testutil.StartRemoteDaemon(t)
	c := e2bClient{t, addr}
	key := testutil.NewKey(t, d, "k")
	if s, _ := c.do("POST", "/sandboxes", nil, `{}`); s != 401 {
		t.Fatalf("create without a key: %d, want 401", s)
	}
	a, b := c.create(key), c.create(key)
	stat := `{"path":"/etc/hostname"}`
	if s, body := c.do("POST", "/filesystem.Filesystem/Stat", envdHdr(a.SandboxID, a.EnvdAccessToken), stat); s != 200 {
		t.Fatalf("stat with the sandbox's token: %d %s", s, body)
	}
	if s, _ := c.do("POST", "/filesystem.Filesystem/Stat", envdHdr(a.SandboxID, ""), stat); s != 401 {
		t.Fatalf("stat without a token: %d, want 401", s)
	}
	if s, _ := c.do("POST", "/filesystem.Filesystem/Stat", envdHdr(a.SandboxID, b.EnvdAccessToken), stat); s != 401 {
		t.Fatalf("stat of sandbox a with b's token: %d, want 401", s)
	}
	// A token does not open DeltaBox's own API either.
	if s, _ := c.do("GET", "/v1/sandboxes", map[string]string{"X-Access-Token": a.EnvdAccessToken, "E2b-Sandbox-Id": a.SandboxID}, ""); s != 401 {
		t.Fatalf("native API with a sandbox token: %d, want 401", s)
	}
	if s, _ := c.do("DELETE", "/sandboxes/"+a.SandboxID, map[string]string{"X-API-Key": key}, ""); s != 204 {
		t.Fatalf("kill: %d", s)
	}
	if s, _ := c.do("POST", "/filesystem.Filesystem/Stat", envdHdr(a.SandboxID, a.EnvdAccessToken), stat); s != 502 {
		t.Fatalf("stat of a killed sandbox: %d, want 502", s)
	}
}

// TestE2BFilesStayInTheSandbox: a sandbox's symlink to a host path, or a path that
// climbs with "..", read through envd's /files gives the sandbox's own file or a 404,
// never the host's (reads resolve with openat2 RESOLVE_IN_ROOT on the sandbox's root);
// a write through such a symlink runs inside the sandbox and cannot reach the host.
func TestE2BFilesStayInTheSandbox(t *testing.T) {
	d, addr := testutil.StartRemoteDaemon(t)
	c := e2bClient{t, addr}
	key := testutil.NewKey(t, d, "k")
	r := c.create(key)
	hostFile := "/tmp/deltabox-e2b-sec-" + strconv.Itoa(os.Getpid())
	if err := os.WriteFile(hostFile, []byte("HOST SECRET"), 0o600); err != nil {
		t.Fatal(err)
	}
	defer os.Remove(hostFile)
	h := envdHdr(r.SandboxID, r.EnvdAccessToken)
	run := `{"process":{"cmd":"/bin/sh","args":["-c","ln -s ` + hostFile + ` /home/user/link; ln -s /proc/1/root` + hostFile + ` /home/user/link2"]}}`
	hh := map[string]string{"E2b-Sandbox-Id": r.SandboxID, "X-Access-Token": r.EnvdAccessToken, "Content-Type": "application/connect+json", "Authorization": "Basic cm9vdDo="}
	// A server stream: one framed JSON message in, frames out (start, end).
	frame := func(js string) string {
		n := len(js)
		return string([]byte{0, byte(n >> 24), byte(n >> 16), byte(n >> 8), byte(n)}) + js
	}
	if s, b := c.do("POST", "/process.Process/Start", hh, frame(run)); s != 200 || !strings.Contains(string(b), `"exited":true`) {
		t.Fatalf("start ln -s: %d %q", s, b)
	}
	for _, p := range []string{"link", "link2", "../../../.." + hostFile, hostFile} {
		s, b := c.do("GET", "/files?path="+p, h, "")
		if strings.Contains(string(b), "HOST SECRET") {
			t.Fatalf("/files?path=%s read the host's file", p)
		}
		if s == 200 {
			t.Fatalf("/files?path=%s: 200 %q, want 404 (the sandbox has no such file)", p, b)
		}
	}
	// A write through the symlink lands in the sandbox (which has no /tmp/... parent it
	// may not make as the user, or makes its own), never on the host.
	c.do("POST", "/files?path=link", map[string]string{"E2b-Sandbox-Id": r.SandboxID, "X-Access-Token": r.EnvdAccessToken, "Content-Type": "application/octet-stream"}, "OVERWRITTEN")
	if b, _ := os.ReadFile(hostFile); string(b) != "HOST SECRET" {
		t.Fatalf("the host file now holds %q", b)
	}
}
