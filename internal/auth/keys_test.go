package auth

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
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

// TestKeyEditsWithSameMtimeAndSize: an edit that leaves the file's mtime and size as
// they were (two edits within the timestamp granularity, names of one length) is still
// seen: the edit renames a new file over the old, and the inode is part of the stamp.
func TestKeyEditsWithSameMtimeAndSize(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("keys are root's: run as root")
	}
	root := t.TempDir()
	daemon, cli := Open(root), Open(root)
	k1, err := cli.Create("alice1")
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(root, FileName)
	st1, _ := os.Stat(p)
	if _, ok := daemon.Check(k1); !ok {
		t.Fatal("a created key does not check")
	}
	if err := cli.Remove("alice1"); err != nil {
		t.Fatal(err)
	}
	k2, err := cli.Create("alice2")
	if err != nil {
		t.Fatal(err)
	}
	os.Chtimes(p, st1.ModTime(), st1.ModTime())
	if st2, _ := os.Stat(p); st2.Size() != st1.Size() {
		t.Skipf("the file's size changed (%d, %d): nothing to test", st1.Size(), st2.Size())
	}
	if _, ok := daemon.Check(k1); ok {
		t.Error("a key removed by an edit that kept mtime and size still checks")
	}
	if _, ok := daemon.Check(k2); !ok {
		t.Error("a key made by an edit that kept mtime and size does not check")
	}
}

// TestKeyEditLockHasADeadline: an edit waits for another's flock at most lockWait, then
// fails naming the lock, instead of hanging.
func TestKeyEditLockHasADeadline(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("keys are root's: run as root")
	}
	root := t.TempDir()
	st := Open(root)
	fd, err := unix.Open(filepath.Join(root, FileName+".lock"), unix.O_RDWR|unix.O_CREAT, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if err := unix.Flock(fd, unix.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	old := lockWait
	lockWait = 300 * time.Millisecond
	defer func() { lockWait = old }()
	done := make(chan error, 1)
	go func() { _, err := st.Create("bob"); done <- err }()
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), FileName+".lock") {
			t.Fatalf("Create while the lock is held: %v, want an error naming the lock", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Create waits for ever for a held lock")
	}
}
