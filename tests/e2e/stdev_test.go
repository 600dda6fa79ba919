package e2e

import (
	"fmt"
	"strings"
	"testing"

	"deltabox/internal/state"
	"deltabox/internal/testutil"
)

// TestSessionOpenFileStDev pins down a documented deviation (README's Limits, API.md):
// each state is a new overlay mount, so st_dev of a path, and of a file a process holds
// open across a checkpoint or a restore, changes at each; st_ino stays, through a
// copy-up too, and the fd stays on the same file (its content as the state has it).
// Tools that take (st_dev, st_ino) as a file's identity across the operation see
// another file system. Nothing but one mount per sandbox could keep st_dev.
func TestSessionOpenFileStDev(t *testing.T) {
	d := testutil.StartDaemon(t)
	dbxCreate(t, d, "dev")
	if _, err := d.C.StartSession(dbxCtx(t), "dev", state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	sessRun(t, d, "dev", "py", "import os\nopen('/workspace/f', 'w').write('one')\nfd = os.open('/workspace/f', os.O_RDWR)\ndef ids():\n    a, b = os.fstat(fd), os.stat('/workspace/f')\n    return '%d %d %d %d %s' % (a.st_dev, a.st_ino, b.st_dev, b.st_ino, os.pread(fd, 16, 0).decode())")
	parse := func(s string) (fdDev, fdIno, pathDev, pathIno int, content string) {
		if _, err := fmt.Sscanf(strings.Trim(s, "'\n"), "%d %d %d %d %s", &fdDev, &fdIno, &pathDev, &pathIno, &content); err != nil {
			t.Fatalf("ids %q: %v", s, err)
		}
		if fdDev != pathDev || fdIno != pathIno {
			t.Fatalf("the fd and the path name different files: %q", s)
		}
		return
	}
	dev0, ino0, _, _, _ := parse(sessRun(t, d, "dev", "py", "ids()"))
	n := dbxCheckpoint(t, d, "dev", "one").Node.ID
	dev1, ino1, _, _, c := parse(sessRun(t, d, "dev", "py", "os.pwrite(fd, b'two', 0); ids()")) // a copy-up
	if dev1 == dev0 || ino1 != ino0 || c != "two" {
		t.Fatalf("after a checkpoint: st_dev %d (was %d), st_ino %d (was %d), %q: want a new st_dev, the same st_ino", dev1, dev0, ino1, ino0, c)
	}
	dbxRestore(t, d, "dev", n)
	dev2, ino2, _, _, c := parse(sessRun(t, d, "dev", "py", "ids()"))
	// (Not compared with dev0: that mount may be gone, and its number given again.)
	if dev2 == dev1 || ino2 != ino0 || c != "one" {
		t.Fatalf("after a restore: st_dev %d (was %d), st_ino %d (was %d), %q: want a new st_dev, the same st_ino, the node's content", dev2, dev1, ino2, ino0, c)
	}
}
