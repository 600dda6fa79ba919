package security

import (
	"os/exec"
	"testing"

	"deltabox/internal/testutil"
)

// A sandbox's envd access token must die with the sandbox (a sandbox made later under
// the same id does not take it) and with the API key it was handed to (deltabox key rm).
// It was an HMAC of the id under a daemon secret: both kept it working.
func TestE2BAccessTokenDiesWithKeyAndSandbox(t *testing.T) {
	d, addr := testutil.StartRemoteDaemon(t)
	c := e2bClient{t, addr}
	key := testutil.NewKey(t, d, "k")
	bearer := map[string]string{"Authorization": "Bearer " + key, "Content-Type": "application/json"}
	r := c.create(key)
	if s, b := c.do("GET", "/health", envdHdr(r.SandboxID, r.EnvdAccessToken), ""); s != 204 {
		t.Fatalf("envd with its token: %d %s", s, b)
	}
	if s, b := c.do("DELETE", "/v1/sandboxes/"+r.SandboxID, bearer, ""); s != 200 {
		t.Fatalf("remove: %d %s", s, b)
	}
	if s, b := c.do("POST", "/v1/sandboxes", bearer, `{"id":"`+r.SandboxID+`"}`); s != 201 {
		t.Fatalf("create again under id %s: %d %s", r.SandboxID, s, b)
	}
	if s, b := c.do("GET", "/health", envdHdr(r.SandboxID, r.EnvdAccessToken), ""); s != 401 {
		t.Errorf("the removed sandbox's token on a new sandbox of the same id: %d %s, want 401", s, b)
	}
	// Revoking the key ends the tokens handed out under it.
	key2 := testutil.NewKey(t, d, "k2")
	r2 := c.create(key2)
	if s, b := c.do("GET", "/health", envdHdr(r2.SandboxID, r2.EnvdAccessToken), ""); s != 204 {
		t.Fatalf("envd with its token: %d %s", s, b)
	}
	if out, err := exec.Command(testutil.Binary(t), "key", "rm", "k2", "--root", d.Root).CombinedOutput(); err != nil {
		t.Fatalf("key rm: %v %s", err, out)
	}
	if s, b := c.do("GET", "/health", envdHdr(r2.SandboxID, r2.EnvdAccessToken), ""); s != 401 {
		t.Errorf("a revoked key's sandbox token: %d %s, want 401", s, b)
	}
	// The other key's token still works; connect answers the same token.
	if s, b := c.do("POST", "/sandboxes/"+r2.SandboxID+"/connect", map[string]string{"X-API-Key": key}, `{"timeout":300}`); s != 200 {
		t.Fatalf("connect with the other key: %d %s", s, b)
	}
	if s, b := c.do("GET", "/health", envdHdr(r2.SandboxID, r2.EnvdAccessToken), ""); s != 204 {
		t.Errorf("the token handed again under a valid key: %d %s, want 204", s, b)
	}
}
