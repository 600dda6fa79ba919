package auth

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestKeys: a created key checks, under its name; a wrong one and the empty one do not;
// the file holds no key and is 0600; a removal made by another Store (the CLI) is seen
// by the daemon's at its next check; names are validated and unique.
func TestKeys(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("keys are root's: run as root")
	}
	root := t.TempDir()
	daemon, cli := Open(root), Open(root)
	if _, ok := daemon.Check("e2b_x"); ok {
		t.Fatal("a key checked with no keys file")
	}
	k, err := cli.Create("alice")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(k, Prefix) || len(k) != len(Prefix)+40 {
		t.Fatalf("key %q: want e2b_ and 40 hex digits", k)
	}
	if name, ok := daemon.Check(k); !ok || name != "alice" {
		t.Fatalf("Check(created key) = %q, %v", name, ok)
	}
	for _, bad := range []string{"", k[:len(k)-1] + "0", k + "0", strings.ToUpper(k)} {
		if bad == k {
			continue
		}
		if _, ok := daemon.Check(bad); ok {
			t.Fatalf("Check(%q) passed", bad)
		}
	}
	st, _ := os.Stat(filepath.Join(root, FileName))
	b, _ := os.ReadFile(filepath.Join(root, FileName))
	if st.Mode().Perm() != 0o600 || strings.Contains(string(b), k[len(Prefix):]) {
		t.Fatalf("keys file mode %v, holds the key: %v", st.Mode(), strings.Contains(string(b), k))
	}
	if _, err := cli.Create("alice"); err == nil {
		t.Fatal("a second key named alice was made")
	}
	if _, err := cli.Create("../x"); err == nil {
		t.Fatal("a key named ../x was made")
	}
	time.Sleep(10 * time.Millisecond) // a new mtime even on coarse clocks
	if err := cli.Remove("alice"); err != nil {
		t.Fatal(err)
	}
	if _, ok := daemon.Check(k); ok {
		t.Fatal("a removed key still checks")
	}
	if err := cli.Remove("alice"); err == nil {
		t.Fatal("removing a missing key succeeded")
	}
}
