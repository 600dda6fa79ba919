package sbinit

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// userRoot makes a root directory with etc/passwd and etc/group and returns an fd on it.
func userRoot(t *testing.T, passwd, group string) (string, int) {
	t.Helper()
	dir := t.TempDir()
	os.Mkdir(filepath.Join(dir, "etc"), 0o755)
	if passwd != "" {
		os.WriteFile(filepath.Join(dir, "etc/passwd"), []byte(passwd), 0o644)
	}
	if group != "" {
		os.WriteFile(filepath.Join(dir, "etc/group"), []byte(group), 0o644)
	}
	fd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return dir, fd
}

func TestLookupUser(t *testing.T) {
	_, root := userRoot(t,
		"root:x:0:0:root:/root:/bin/bash\n# comment\nbroken line\nbob:x:1001:1001:Bob:/home/bob:/bin/sh\n",
		"root:x:0:\nbob:x:1001:\ndev:x:2000:alice,bob\nops:x:2001:bob\n")
	for _, c := range []struct {
		spec string
		want User
	}{
		{"bob", User{Name: "bob", UID: 1001, GID: 1001, Groups: []uint32{1001, 2000, 2001}, Home: "/home/bob"}},
		{"1001", User{Name: "bob", UID: 1001, GID: 1001, Groups: []uint32{1001, 2000, 2001}, Home: "/home/bob"}},
		{"bob:dev", User{Name: "bob", UID: 1001, GID: 2000, Groups: []uint32{2000, 2001}, Home: "/home/bob"}},
		{"1000", User{UID: 1000, GID: 1000, Groups: []uint32{1000}, Home: "/"}},
		{"1000:2001", User{UID: 1000, GID: 2001, Groups: []uint32{2001}, Home: "/"}},
		{"root", User{Name: "root", UID: 0, GID: 0, Groups: []uint32{0}, Home: "/root"}},
	} {
		u, err := LookupUser(root, c.spec)
		if err != nil || !reflect.DeepEqual(*u, c.want) {
			t.Errorf("%q: got %+v, %v; want %+v", c.spec, u, err, c.want)
		}
	}
	for spec, want := range map[string]string{
		"alice":      `no user "alice" in the sandbox's /etc/passwd (it lists root, bob)`,
		"bob:nope":   `no group "nope" in the sandbox's /etc/group (it lists root, bob, dev, ops)`,
		"":           "give NAME, UID",
		"bob:":       "give NAME, UID",
		"4294967295": `no user "4294967295"`,
	} {
		if _, err := LookupUser(root, spec); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: error %v, want it to contain %q", spec, err, want)
		}
	}
}

// TestLookupUserHostileFiles: the files are the sandbox's. A FIFO (which would block the
// spawn thread for ever), a symlink out of the root, a file over the cap and a missing
// file are refused, each quickly and with a message.
func TestLookupUserHostileFiles(t *testing.T) {
	dir, root := userRoot(t, "", "")
	passwd := filepath.Join(dir, "etc/passwd")
	check := func(what, want string) {
		t.Helper()
		done := make(chan error, 1)
		go func() { _, err := LookupUser(root, "bob"); done <- err }()
		select {
		case err := <-done:
			if err == nil || !strings.Contains(err.Error(), want) {
				t.Errorf("%s: error %v, want it to contain %q", what, err, want)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: LookupUser blocked", what)
		}
	}
	check("missing", "the sandbox has no /etc/passwd")
	if err := unix.Mkfifo(passwd, 0o644); err != nil {
		t.Fatal(err)
	}
	check("a FIFO", "not a regular file")
	os.Remove(passwd)
	// A host file the sandbox names by an absolute symlink: resolved in the root.
	host := filepath.Join(t.TempDir(), "hostpasswd")
	os.WriteFile(host, []byte("bob:x:7:7::/:/bin/sh\n"), 0o644)
	os.Symlink(host, passwd)
	check("a symlink (last component)", "open the sandbox's /etc/passwd")
	os.Remove(passwd)
	os.RemoveAll(filepath.Join(dir, "etc"))
	os.Symlink(filepath.Dir(host), filepath.Join(dir, "etc"))
	os.Rename(host, filepath.Join(filepath.Dir(host), "passwd"))
	check("a symlinked /etc leading out", "the sandbox has no /etc/passwd")
	os.Remove(filepath.Join(dir, "etc"))
	os.Mkdir(filepath.Join(dir, "etc"), 0o755)
	f, _ := os.Create(passwd)
	f.Truncate(maxIDFile + 1)
	f.Close()
	check("over the cap", "is over 4 MiB")
}
