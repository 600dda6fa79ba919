package e2e

// The files API (internal/files, docs/API.md "Files"): round trips through a real
// daemon, atomic overwrite, visibility to and from exec'd commands, rollback with
// checkpoint/restore, 409 for a state switch during a file operation, and
// confinement: no path or symlink reaches the host, and the sandbox's other mounts
// (/proc, /dev, /dev/shm) are refused.

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"deltabox/internal/api"
	"deltabox/internal/client"
	"deltabox/internal/errdefs"
	"deltabox/internal/files"
	"deltabox/internal/testutil"
)

func filesWrite(t *testing.T, d *testutil.Daemon, id, p, content string, o client.WriteFileOptions) *files.Info {
	t.Helper()
	in, err := d.C.WriteFile(dbxCtx(t), id, p, strings.NewReader(content), o)
	if err != nil {
		t.Fatalf("write %s in %s: %v", p, id, err)
	}
	return in
}

func filesRead(t *testing.T, d *testutil.Daemon, id, p string) string {
	t.Helper()
	b, err := d.C.ReadFile(dbxCtx(t), id, p)
	if err != nil {
		t.Fatalf("read %s in %s: %v", p, id, err)
	}
	return string(b)
}

// filesWantErr checks err's class and, when msg is not empty, that its message holds msg.
func filesWantErr(t *testing.T, what string, err, class error, msg string) {
	t.Helper()
	if err == nil {
		t.Fatalf("%s: succeeded, want %v", what, class)
	}
	if !errors.Is(err, class) {
		t.Fatalf("%s: %v, want %v", what, err, class)
	}
	if msg != "" && !strings.Contains(err.Error(), msg) {
		t.Fatalf("%s: message %q does not say %q", what, err, msg)
	}
}

func TestFilesRoundTrip(t *testing.T) {
	d := testutil.StartDaemon(t)
	id := dbxCreate(t, d, "files1").ID
	ctx := dbxCtx(t)

	// Write (relative to the workdir), stat, read, list.
	in := filesWrite(t, d, id, "a.py", "print('hi')\n", client.WriteFileOptions{})
	if in.Path != "/workspace/a.py" || in.Type != "file" || in.Size != 12 || in.Mode != 0o644 || in.UID != 0 {
		t.Fatalf("write answered %+v", in)
	}
	if got := filesRead(t, d, id, "/workspace/a.py"); got != "print('hi')\n" {
		t.Fatalf("read back %q", got)
	}
	st, err := d.C.StatFile(ctx, id, "a.py")
	if err != nil || st.Size != 12 || st.Permissions != "-rw-r--r--" || st.ModTime.IsZero() {
		t.Fatalf("stat: %+v %v", st, err)
	}
	// Visible to commands, and the other way round.
	if out := dbxSh(t, d, id, "cat a.py && stat -c %a a.py"); out != "print('hi')\n644\n" {
		t.Fatalf("the sandbox sees %q", out)
	}
	dbxSh(t, d, id, "mkdir -p sub/deep && printf 'from exec' > sub/deep/x && ln -s a.py link && mkfifo fifo")
	if got := filesRead(t, d, id, "sub/deep/x"); got != "from exec" {
		t.Fatalf("read a command's file: %q", got)
	}
	l, err := d.C.ListFiles(ctx, id, "", client.ListFilesOptions{})
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]files.Info{}
	for _, e := range l.Entries {
		names[e.Name] = e
	}
	if l.Path != "/workspace" || names["a.py"].Size != 12 || names["sub"].Type != "dir" ||
		names["link"].Type != "symlink" || names["link"].LinkTarget != "a.py" || names["fifo"].Type != "fifo" || l.Truncated {
		t.Fatalf("list /workspace: %+v", l)
	}
	l, err = d.C.ListFiles(ctx, id, "/workspace/sub", client.ListFilesOptions{Recursive: true})
	if err != nil || len(l.Entries) != 2 || l.Entries[1].Path != "/workspace/sub/deep/x" {
		t.Fatalf("recursive list: %+v %v", l, err)
	}
	// Reading through a symlink reads its target; a FIFO or a directory is refused.
	if got := filesRead(t, d, id, "link"); got != "print('hi')\n" {
		t.Fatalf("read a symlink: %q", got)
	}
	_, err = d.C.ReadFile(ctx, id, "fifo")
	filesWantErr(t, "read a FIFO", err, errdefs.ErrInvalid, "not a regular file")
	_, err = d.C.ReadFile(ctx, id, "sub")
	filesWantErr(t, "read a directory", err, errdefs.ErrInvalid, "is a directory")
	_, err = d.C.WriteFile(ctx, id, "sub", strings.NewReader("x"), client.WriteFileOptions{})
	filesWantErr(t, "write over a directory", err, errdefs.ErrInvalid, "is a directory")

	// Atomic overwrite keeps mode and owner (a new inode, renamed over the old).
	dbxSh(t, d, id, "printf old > run.sh && chown 1234:5678 run.sh && chmod 4750 run.sh")
	ino := dbxSh(t, d, id, "stat -c %i run.sh")
	in = filesWrite(t, d, id, "run.sh", "#!/bin/sh\necho new\n", client.WriteFileOptions{})
	if in.Mode != 0o4750 || in.UID != 1234 || in.GID != 5678 {
		t.Fatalf("overwrite did not keep mode and owner: %+v", in)
	}
	if out := dbxSh(t, d, id, "stat -c '%a %u %g' run.sh && ./run.sh"); out != "4750 1234 5678\nnew\n" {
		t.Fatalf("after overwrite the sandbox sees %q", out)
	}
	if dbxSh(t, d, id, "stat -c %i run.sh") == ino {
		t.Fatal("overwrite reused the inode: not atomic")
	}
	in = filesWrite(t, d, id, "run.sh", "x", client.WriteFileOptions{Mode: 0o600})
	if in.Mode != 0o600 {
		t.Fatalf("explicit mode: %o", in.Mode)
	}
	// A file of the image: copy-up, the image itself is untouched.
	filesWrite(t, d, id, "/etc/motd", "changed\n", client.WriteFileOptions{})
	if out := dbxSh(t, d, id, "cat /etc/motd"); out != "changed\n" {
		t.Fatalf("/etc/motd: %q", out)
	}
	if b, err := os.ReadFile(filepath.Join(testutil.MainRoot(), "images/default/rootfs/etc/motd")); err == nil && string(b) == "changed\n" {
		t.Fatal("the write reached the image")
	}

	// Parents, binary content, ranges, the JSON form.
	_, err = d.C.WriteFile(ctx, id, "n1/n2/f", strings.NewReader("x"), client.WriteFileOptions{})
	filesWantErr(t, "write without parents", err, errdefs.ErrNotFound, "mkdir")
	bin := make([]byte, 256*64)
	for i := range bin {
		bin[i] = byte(i)
	}
	if _, err := d.C.WriteFile(ctx, id, "n1/n2/f", bytes.NewReader(bin), client.WriteFileOptions{Mkdir: true}); err != nil {
		t.Fatal(err)
	}
	if got, err := d.C.ReadFile(ctx, id, "n1/n2/f"); err != nil || !bytes.Equal(got, bin) {
		t.Fatalf("binary round trip: %d bytes, %v", len(got), err)
	}
	if sum := dbxSh(t, d, id, "sha256sum < n1/n2/f | cut -d' ' -f1"); sum != fmt.Sprintf("%x\n", sha256.Sum256(bin)) {
		t.Fatalf("the sandbox's sha256 %s differs", sum)
	}
	if got, err := d.C.ReadFileRange(ctx, id, "n1/n2/f", 300, 5); err != nil || !bytes.Equal(got, bin[300:305]) {
		t.Fatalf("range: %v %v", got, err)
	}
	status, body := dbxRaw(t, d, "GET", "/sandboxes/"+id+"/files?path=n1/n2/f&format=json&offset=1&length=3", "")
	var fc api.FileContent
	if status != 200 || json.Unmarshal(body, &fc) != nil || fc.Encoding != "base64" || !bytes.Equal(fc.Content, bin[1:4]) ||
		fc.Size != int64(len(bin)) || fc.Path != "/workspace/n1/n2/f" || fc.Offset != 1 {
		t.Fatalf("format=json: %d %s", status, body)
	}
	// Over the cap: a clear 400, and ranges still work.
	dbxSh(t, d, id, "truncate -s 65M big && printf END >> big")
	_, err = d.C.ReadFile(ctx, id, "big")
	filesWantErr(t, "read 65 MiB", err, errdefs.ErrInvalid, "offset and length")
	if got, err := d.C.ReadFileRange(ctx, id, "big", 65<<20, 0); err != nil || string(got) != "END" {
		t.Fatalf("the tail of a big file: %q %v", got, err)
	}
	_, err = d.C.WriteFile(ctx, id, "toobig", bytes.NewReader(make([]byte, files.DefaultMaxWrite+1)), client.WriteFileOptions{})
	filesWantErr(t, "write over the cap", err, errdefs.ErrInvalid, "limit")

	// mkdir, rm.
	r, err := d.C.Mkdir(ctx, id, "m1/m2", 0o700)
	if err != nil || !r.Created || r.Entry.Mode != 0o700 || r.Entry.Type != "dir" {
		t.Fatalf("mkdir: %+v %v", r, err)
	}
	if r, err := d.C.Mkdir(ctx, id, "m1/m2", 0); err != nil || r.Created {
		t.Fatalf("mkdir of an existing dir: %+v %v", r, err)
	}
	filesWantErr(t, "rm a non-empty dir", d.C.RemoveFile(ctx, id, "m1", false), errdefs.ErrConflict, "not empty")
	if err := d.C.RemoveFile(ctx, id, "m1", true); err != nil {
		t.Fatal(err)
	}
	if err := d.C.RemoveFile(ctx, id, "link", false); err != nil {
		t.Fatal(err)
	}
	if out := dbxSh(t, d, id, "ls -a m1 link 2>&1; cat a.py"); !strings.Contains(out, "No such file") || !strings.HasSuffix(out, "print('hi')\n") {
		t.Fatalf("after rm: %q", out)
	}
	filesWantErr(t, "rm a missing file", d.C.RemoveFile(ctx, id, "m1", false), errdefs.ErrNotFound, "")
	filesWantErr(t, "rm /", d.C.RemoveFile(ctx, id, "/", true), errdefs.ErrInvalid, "")

	// No temp file is left anywhere a write went.
	if out := dbxSh(t, d, id, "find / -xdev -name '.deltabox-tmp*' | head"); out != "" {
		t.Fatalf("temp files left: %s", out)
	}

	// The CLI.
	bin2 := testutil.Binary(t)
	cmd := testutil.Command(t, time.Minute, bin2, "--socket", d.Socket, "files", "write", id, "cli.txt", "-p")
	cmd.Stdin = strings.NewReader("via cli\n")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("deltabox files write: %v: %s", err, out)
	}
	if out, err := testutil.Command(t, time.Minute, bin2, "--socket", d.Socket, "files", "read", id, "/workspace/cli.txt").Output(); err != nil || string(out) != "via cli\n" {
		t.Fatalf("deltabox files read: %q %v", out, err)
	}
	if out, err := testutil.Command(t, time.Minute, bin2, "--socket", d.Socket, "files", "ls", id).Output(); err != nil || !strings.Contains(string(out), "/workspace/cli.txt") {
		t.Fatalf("deltabox files ls: %q %v", out, err)
	}
	if out, err := testutil.Command(t, time.Minute, bin2, "--socket", d.Socket, "files", "read", id, "../../etc/passwd").CombinedOutput(); err == nil || !strings.Contains(string(out), "leaves the sandbox") {
		t.Fatalf("deltabox files read ../../etc/passwd: %q %v", out, err)
	}

	// Unknown sandbox: 404 on every route; a bad query: 400.
	for _, c := range []struct{ method, path string }{
		{"GET", "/files?path=/etc/passwd"}, {"PUT", "/files?path=/x"}, {"DELETE", "/files?path=/x"},
		{"GET", "/files/list?path=/"}, {"GET", "/files/stat?path=/"}, {"POST", "/files/mkdir?path=/x"},
	} {
		status, body := dbxRaw(t, d, c.method, "/sandboxes/nope"+c.path, "")
		if code, msg := dbxErrorBody(t, body); status != 404 || code != "not_found" || !strings.Contains(msg, "nope") {
			t.Fatalf("%s %s on an unknown sandbox: %d %s", c.method, c.path, status, body)
		}
	}
	for _, q := range []string{"/files", "/files?path=a.py&offset=-1", "/files?path=a.py&format=xml", "/files/list?recursive=maybe"} {
		if status, body := dbxRaw(t, d, "GET", "/sandboxes/"+id+q, ""); status != 400 {
			t.Fatalf("GET %s: %d %s, want 400", q, status, body)
		}
	}
	if status, body := dbxRaw(t, d, "PUT", "/sandboxes/"+id+"/files?path=x&mode=999", ""); status != 400 {
		t.Fatalf("PUT mode=999: %d %s", status, body)
	}
}

// TestFilesCheckpointRestore: files written through the API belong to the state and
// roll back with it.
func TestFilesCheckpointRestore(t *testing.T) {
	d := testutil.StartDaemon(t)
	id := dbxCreate(t, d, "files2").ID
	ctx := dbxCtx(t)
	filesWrite(t, d, id, "f", "v1", client.WriteFileOptions{})
	filesWrite(t, d, id, "/etc/motd", "motd v1", client.WriteFileOptions{})
	n1 := dbxCheckpoint(t, d, id, "v1").Node.ID
	filesWrite(t, d, id, "f", "v2", client.WriteFileOptions{})
	filesWrite(t, d, id, "g/h", "new", client.WriteFileOptions{Mkdir: true})
	if err := d.C.RemoveFile(ctx, id, "/etc/motd", false); err != nil {
		t.Fatal(err)
	}
	n2 := dbxCheckpoint(t, d, id, "v2").Node.ID
	filesWrite(t, d, id, "f", "v3 uncommitted", client.WriteFileOptions{})

	dbxRestore(t, d, id, n1)
	if got := filesRead(t, d, id, "f"); got != "v1" {
		t.Fatalf("after restore to n1: f = %q", got)
	}
	if got := filesRead(t, d, id, "/etc/motd"); got != "motd v1" {
		t.Fatalf("after restore to n1: motd = %q", got)
	}
	_, err := d.C.StatFile(ctx, id, "g")
	filesWantErr(t, "stat g after restore to n1", err, errdefs.ErrNotFound, "")
	if out := dbxSh(t, d, id, "cat f"); out != "v1" {
		t.Fatalf("exec after restore sees %q", out)
	}

	dbxRestore(t, d, id, n2)
	if got := filesRead(t, d, id, "f") + "|" + filesRead(t, d, id, "g/h"); got != "v2|new" {
		t.Fatalf("after restore to n2: %q", got)
	}
	_, err = d.C.ReadFile(ctx, id, "/etc/motd")
	filesWantErr(t, "motd after restore to n2", err, errdefs.ErrNotFound, "")

	// A second sandbox restored onto n1 sees n1's files; writes stay its own.
	other := dbxCreate(t, d, "files2b").ID
	dbxRestore(t, d, other, n1)
	filesWrite(t, d, other, "f", "other", client.WriteFileOptions{})
	if a, b := filesRead(t, d, id, "f"), filesRead(t, d, other, "f"); a != "v2" || b != "other" {
		t.Fatalf("two sandboxes: %q %q", a, b)
	}
}

// TestFilesEscape: no path, symlink or mount leads out of the sandbox, and nothing
// outside is read or changed.
func TestFilesEscape(t *testing.T) {
	d := testutil.StartDaemon(t)
	id := dbxCreate(t, d, "files3").ID
	ctx := dbxCtx(t)

	// A host directory with a secret, at a path the sandbox does not have.
	rb := make([]byte, 6)
	rand.Read(rb)
	hostDir := filepath.Join(os.TempDir(), "deltabox-files-escape-"+hex.EncodeToString(rb))
	if err := os.MkdirAll(hostDir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(hostDir) })
	secret := filepath.Join(hostDir, "secret")
	if err := os.WriteFile(secret, []byte("HOST SECRET"), 0o600); err != nil {
		t.Fatal(err)
	}
	checkHost := func(when string) {
		t.Helper()
		ents, err := os.ReadDir(hostDir)
		if b, _ := os.ReadFile(secret); string(b) != "HOST SECRET" || err != nil || len(ents) != 1 {
			var names []string
			for _, e := range ents {
				names = append(names, e.Name())
			}
			t.Fatalf("%s: the host directory changed: %v, secret %q", when, names, b)
		}
	}
	hostDB := filepath.Join(d.Root, "index.db") // the test daemon's own index
	mainDB := filepath.Join(testutil.MainRoot(), "index.db")
	ups := strings.Repeat("../", 12)
	dbxSh(t, d, id, fmt.Sprintf(`set -e
		test ! -e %[1]s && test ! -e %[2]s
		echo SANDBOX > /etc/deltabox-marker
		mkdir -p /srv/own && echo OWN > /srv/own/f
		cd /workspace
		ln -s /../../../.. l_root
		ln -s %[3]s l_ups
		ln -s %[1]s l_hostdir
		ln -s %[3]s%[1]s l_hostdir_rel
		ln -s %[4]s l_secret
		ln -s %[2]s l_db
		ln -s %[5]s l_maindb
		ln -s /srv/own/f l_own
		ln -s %[1]s/written l_write
		ln -s %[3]s%[1]s/written_rel l_write_rel
		ln -s /proc/1/root l_proc
		ln -s /proc/self/root l_self
		ln -s /dev/shm l_shm
		touch /dev/shm/in-shm`, hostDir, hostDB, ups, secret, mainDB))

	// Symlinks to "/" and ".." chains resolve inside the sandbox.
	for _, p := range []string{"l_root/etc/deltabox-marker", "l_ups/etc/deltabox-marker", "l_root/workspace/l_ups/etc/deltabox-marker"} {
		if got := filesRead(t, d, id, p); got != "SANDBOX\n" {
			t.Fatalf("read %s = %q, want the sandbox's own file", p, got)
		}
	}
	// An absolute symlink names the sandbox's own file, never the host's.
	if got := filesRead(t, d, id, "l_own"); got != "OWN\n" {
		t.Fatalf("read l_own = %q", got)
	}
	for _, p := range []string{"l_secret", "l_db", "l_maindb", "l_hostdir/secret", "l_hostdir_rel/secret", "l_root" + secret, "l_ups" + hostDB} {
		b, err := d.C.ReadFile(ctx, id, p)
		if strings.Contains(string(b), "HOST") || len(b) > 0 {
			t.Fatalf("read %s returned host content (%d bytes)", p, len(b))
		}
		filesWantErr(t, "read "+p, err, errdefs.ErrNotFound, "")
	}
	for _, p := range []string{"l_hostdir", "l_hostdir_rel", "l_root" + hostDir} {
		_, err := d.C.ListFiles(ctx, id, p, client.ListFilesOptions{})
		filesWantErr(t, "list "+p, err, errdefs.ErrNotFound, "")
	}
	_, err := d.C.StatFile(ctx, id, "l_hostdir/secret")
	filesWantErr(t, "stat l_hostdir/secret", err, errdefs.ErrNotFound, "")
	filesWantErr(t, "rm l_hostdir/secret", d.C.RemoveFile(ctx, id, "l_hostdir/secret", false), errdefs.ErrNotFound, "")
	// The symlink itself is what stat describes and rm removes.
	if st, err := d.C.StatFile(ctx, id, "l_secret"); err != nil || st.Type != "symlink" || st.LinkTarget != secret {
		t.Fatalf("stat l_secret: %+v %v", st, err)
	}
	if err := d.C.RemoveFile(ctx, id, "l_secret", false); err != nil {
		t.Fatal(err)
	}
	checkHost("after reads")

	// ".." in the path itself: refused with a message.
	for _, p := range []string{"../../etc/passwd", "/../../etc/shadow", "sub/../../../x", "/.."} {
		_, err := d.C.ReadFile(ctx, id, p)
		filesWantErr(t, "read "+p, err, errdefs.ErrInvalid, "leaves the sandbox")
		_, err = d.C.WriteFile(ctx, id, p, strings.NewReader("x"), client.WriteFileOptions{Mkdir: true})
		filesWantErr(t, "write "+p, err, errdefs.ErrInvalid, "leaves the sandbox")
		filesWantErr(t, "rm "+p, d.C.RemoveFile(ctx, id, p, true), errdefs.ErrInvalid, "leaves the sandbox")
		_, err = d.C.ListFiles(ctx, id, p, client.ListFilesOptions{})
		filesWantErr(t, "list "+p, err, errdefs.ErrInvalid, "leaves the sandbox")
	}

	// Writes through symlinks pointing outside: nothing on the host, ever.
	for _, p := range []string{"l_write", "l_write_rel", "l_hostdir/new", "l_hostdir_rel/new"} {
		_, err := d.C.WriteFile(ctx, id, p, strings.NewReader("PWNED"), client.WriteFileOptions{})
		filesWantErr(t, "write "+p, err, errdefs.ErrNotFound, "")
	}
	checkHost("after writes without mkdir")
	for _, p := range []string{"l_write", "l_write_rel"} {
		if _, err := d.C.WriteFile(ctx, id, p, strings.NewReader("inside"), client.WriteFileOptions{Mkdir: true}); err != nil {
			t.Fatalf("write %s with mkdir: %v", p, err)
		}
	}
	for _, p := range []string{"l_hostdir/new", "l_hostdir_rel/new"} {
		d.C.WriteFile(ctx, id, p, strings.NewReader("PWNED"), client.WriteFileOptions{Mkdir: true}) // a dangling parent: refused or inside
	}
	d.C.Mkdir(ctx, id, "l_hostdir/newdir", 0)
	checkHost("after writes with mkdir")
	for _, p := range []string{hostDir + "/written", hostDir + "/written_rel"} {
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Fatalf("a write through a symlink created %s on the host", p)
		}
	}
	// They landed in the sandbox, at the path the symlink names there.
	if out := dbxSh(t, d, id, fmt.Sprintf("cat %[1]s/written %[1]s/written_rel", hostDir)); out != "insideinside" {
		t.Fatalf("the sandbox's copy: %q", out)
	}

	// Other mounts: /proc (and its magic links), /dev, /dev/shm are refused.
	for _, p := range []string{"/proc/1/root/etc/passwd", "/proc/self/root/etc/passwd", "/proc/self/environ", "/proc/1/cwd",
		"/dev/null", "/dev/shm/in-shm", "l_proc/etc/passwd", "l_self/etc/passwd", "l_shm/in-shm"} {
		_, err := d.C.ReadFile(ctx, id, p)
		filesWantErr(t, "read "+p, err, errdefs.ErrInvalid, "another mount")
	}
	for _, p := range []string{"/proc/1/root" + hostDir + "/x", "/dev/shm/x", "/dev/x", "l_proc/tmp/x", "/proc"} {
		_, err := d.C.WriteFile(ctx, id, p, strings.NewReader("x"), client.WriteFileOptions{Mkdir: true})
		filesWantErr(t, "write "+p, err, errdefs.ErrInvalid, "another mount")
	}
	for _, p := range []string{"/proc", "/dev", "/dev/shm", "/proc/1/root"} {
		_, err := d.C.ListFiles(ctx, id, p, client.ListFilesOptions{})
		filesWantErr(t, "list "+p, err, errdefs.ErrInvalid, "another mount")
	}
	filesWantErr(t, "rm /proc", d.C.RemoveFile(ctx, id, "/proc", true), errdefs.ErrInvalid, "another mount")
	filesWantErr(t, "rm /dev/shm/in-shm", d.C.RemoveFile(ctx, id, "/dev/shm/in-shm", false), errdefs.ErrInvalid, "another mount")
	if st, err := d.C.StatFile(ctx, id, "/proc"); err != nil || !st.MountPoint {
		t.Fatalf("stat /proc: %+v %v, want a mount point", st, err)
	}
	l, err := d.C.ListFiles(ctx, id, "/", client.ListFilesOptions{Recursive: true, Depth: 2, MaxEntries: 100000})
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range l.Entries {
		if strings.HasPrefix(e.Path, "/proc/") || strings.HasPrefix(e.Path, "/dev/") {
			t.Fatalf("a recursive listing of / entered %s", e.Path)
		}
	}
	if out := dbxSh(t, d, id, "ls /dev/shm"); out != "in-shm\n" {
		t.Fatalf("/dev/shm changed: %q", out)
	}
	checkHost("at the end")
	if err := d.C.Health(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// TestFilesBusy: a file operation in progress holds the sandbox's state like a running
// command: checkpoint and restore answer 409 until it ends. The operation is a write
// whose body the test streams slowly, so it is held open for as long as needed.
func TestFilesBusy(t *testing.T) {
	d := testutil.StartDaemon(t)
	id := dbxCreate(t, d, "files4").ID
	ctx := dbxCtx(t)
	n0 := dbxCheckpoint(t, d, id, "before").Node.ID

	pr, pw := io.Pipe()
	type result struct {
		in  *files.Info
		err error
	}
	done := make(chan result, 1)
	go func() {
		in, err := d.C.WriteFile(ctx, id, "slow", pr, client.WriteFileOptions{})
		done <- result{in, err}
	}()
	if _, err := pw.Write([]byte("part1 ")); err != nil {
		t.Fatal(err)
	}
	// Until the daemon's handler is inside the write, checkpoints still succeed.
	deadline := time.Now().Add(20 * time.Second)
	for {
		_, err := d.C.Checkpoint(ctx, id, "probe")
		if errors.Is(err, errdefs.ErrConflict) {
			break
		}
		if err != nil {
			t.Fatalf("checkpoint during a write: %v, want 409", err)
		}
		if time.Now().After(deadline) {
			t.Fatal("checkpoint never answered 409 while a write was in progress")
		}
		time.Sleep(10 * time.Millisecond)
	}
	_, err := d.C.Restore(ctx, id, n0)
	filesWantErr(t, "restore during a write", err, errdefs.ErrConflict, "")
	// Other file operations and execs proceed meanwhile.
	filesWrite(t, d, id, "other", "x", client.WriteFileOptions{})
	dbxSh(t, d, id, "true")
	pw.Write([]byte("part2"))
	pw.Close()
	r := <-done
	if r.err != nil || r.in.Size != 11 {
		t.Fatalf("the slow write: %+v %v", r.in, r.err)
	}
	if got := filesRead(t, d, id, "slow"); got != "part1 part2" {
		t.Fatalf("the slow write wrote %q", got)
	}
	n1 := dbxCheckpoint(t, d, id, "after").Node.ID
	dbxRestore(t, d, id, n0)
	dbxRestore(t, d, id, n1)
	if got := filesRead(t, d, id, "slow"); got != "part1 part2" {
		t.Fatalf("after the round trip: %q", got)
	}
}
