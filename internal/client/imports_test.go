package client

import (
	"os/exec"
	"strings"
	"testing"
)

// The client is linked into programs that are not the daemon (the CLI's client verbs,
// benchmarks, tools): it speaks the wire form defined in apitypes and must not pull in
// the daemon's packages (state, sandbox, store and the Linux machinery under them).
func TestClientImportsOnlyTheWireTypes(t *testing.T) {
	allowed := map[string]bool{
		"deltabox/internal/client":   true,
		"deltabox/internal/apitypes": true,
		"deltabox/internal/errdefs":  true,
	}
	// go test puts its own go first on PATH.
	out, err := exec.Command("go", "list", "-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}", "deltabox/internal/client").CombinedOutput()
	if err != nil {
		t.Fatalf("go list -deps: %v\n%s", err, out)
	}
	for _, p := range strings.Fields(string(out)) {
		if !allowed[p] {
			t.Errorf("internal/client depends on %s; it may import only apitypes, errdefs and the standard library (`go list -deps ./internal/client` shows the chain)", p)
		}
	}
}
