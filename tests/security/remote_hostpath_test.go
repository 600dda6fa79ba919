package security

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"deltabox/internal/apitypes"
	"deltabox/internal/testutil"
)

// An API key holder on TCP must not import a host directory as an image (POST
// /v1/images {"source": HOST PATH}) and read a root-only host file from a sandbox made
// of it; nor learn from the refusal whether a host path exists.
func TestRemoteKeyCannotImportHostPaths(t *testing.T) {
	d, addr := testutil.StartRemoteDaemon(t)
	c := e2bClient{t, addr}
	key := testutil.NewKey(t, d, "k")
	dir := t.TempDir()
	os.Chmod(dir, 0o700)
	os.Mkdir(filepath.Join(dir, "bin"), 0o755) // an image needs one
	if err := os.WriteFile(filepath.Join(dir, "secret"), []byte("HOST ROOT SECRET"), 0o600); err != nil {
		t.Fatal(err)
	}
	bearer := map[string]string{"Authorization": "Bearer " + key, "Content-Type": "application/json"}
	s, b := c.do("POST", "/v1/images", bearer, `{"name":"stolen","source":"`+dir+`"}`)
	if s != 403 || !strings.Contains(string(b), "unix socket") {
		t.Errorf("import of a host directory over TCP: %d %s, want 403 saying to run it over the unix socket", s, b)
	}
	s, b = c.do("POST", "/v1/images?progress=1", bearer, `{"name":"stolen2","source":"`+dir+`"}`)
	if s != 403 {
		t.Errorf("streamed import over TCP: %d %s, want 403", s, b)
	}
	c.do("POST", "/v1/sandboxes", bearer, `{"id":"thief","image":"stolen"}`)
	if _, b = c.do("GET", "/v1/sandboxes/thief/files?path=/secret", bearer, ""); strings.Contains(string(b), "HOST ROOT SECRET") {
		t.Fatalf("a key holder read a host root-only file over TCP")
	}
	// Probing: an existing and a missing host path get the same answer.
	s1, b1 := c.do("POST", "/v1/images", bearer, `{"name":"p1","source":"`+dir+`/secret"}`)
	s2, b2 := c.do("POST", "/v1/images", bearer, `{"name":"p1","source":"`+dir+`/missing"}`)
	if s1 != s2 || string(b1) != string(b2) {
		t.Errorf("the answer tells whether a host path exists: %d %s vs %d %s", s1, b1, s2, b2)
	}
	// Root on the unix socket still imports, and the listing over TCP does not show
	// the host path it came from.
	if _, err := d.C.ImportImage(t.Context(), apitypes.ImportRequest{Name: "local", Source: dir}, nil); err != nil {
		t.Fatalf("import over the unix socket: %v", err)
	}
	if _, b = c.do("GET", "/v1/images", bearer, ""); strings.Contains(string(b), dir) {
		t.Errorf("GET /v1/images over TCP shows the host path %s: %s", dir, b)
	}
}
