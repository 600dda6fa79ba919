package security

import (
	"strings"
	"testing"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/client"
	"deltabox/internal/testutil"
)

// TestTemplateMemoryUnreachable: a checkpoint's templates (stopped forks of the
// session's processes, in the sandbox's PID namespace with the sandbox's uid) cannot
// be opened, read or written through /proc by the sandbox's own code. The attack: open
// /proc/TEMPLATE/mem for writing and rewrite the state a restore brings back; the fd,
// once open, stays usable. Before templates were made non-dumpable, the open worked
// ("opened /proc/N/mem rw" for the template) and a variable rewritten there came back
// with the restore.
func TestTemplateMemoryUnreachable(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "sec-tmpl"
	if _, err := d.C.Create(ctx(t), apitypes.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	r0, err := d.C.Run(ctx(t), id, "main", "x=checkpointed; echo $$", 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	pid := strings.TrimSpace(r0.Stdout)
	cp, err := d.C.Checkpoint(ctx(t), id, "one")
	if err != nil {
		t.Fatal(err)
	}
	// Every stopped process of the sandbox (the templates are), opened every way.
	// Parking moves a template onto its node's view after the answer, and lets it run
	// for that instant: a scan may find none stopped then, and is made again (5 s).
	scan := `
for s in /proc/[0-9]*/stat; do
  p=${s#/proc/}; p=${p%/stat}
  read -r _ comm st _ < "$s" 2>/dev/null || continue
  [ "$st" = T ] || [ "$st" = t ] || continue
  echo "stopped $p $comm"
  exec 7<>/proc/$p/mem 2>/dev/null && echo "OPENED /proc/$p/mem rw" && exec 7>&-
  cat /proc/$p/environ >/dev/null 2>&1 && echo "READ /proc/$p/environ"
  for f in /proc/$p/fd/*; do readlink "$f" >/dev/null 2>&1 && echo "READLINK $f"; done
done`
	// Run from the session: its templates are forks of its shell, in the shell's Landlock
	// domain, which another command could not reach anyway (internal/landlock); only
	// their being non-dumpable keeps them from the session's own children.
	if _, err := d.C.WriteFile(ctx(t), id, "/tmp/scan.sh", strings.NewReader(scan), client.WriteFileOptions{}); err != nil {
		t.Fatal(err)
	}
	scanIn := func() string {
		t.Helper()
		r, err := d.C.Run(ctx(t), id, "main", "bash /tmp/scan.sh", 30*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		return r.Stdout
	}
	out := scanIn()
	for deadline := time.Now().Add(5 * time.Second); !strings.Contains(out, "stopped ") && time.Now().Before(deadline); {
		time.Sleep(50 * time.Millisecond)
		out = scanIn()
	}
	if !strings.Contains(out, "stopped ") {
		t.Fatalf("no template seen from inside (the scan is blind): %q", out)
	}
	for _, bad := range []string{"OPENED", "READ"} {
		if strings.Contains(out, bad) {
			t.Errorf("a template is reachable from inside the sandbox:\n%s", out)
			break
		}
	}
	// The node still restores with its process state.
	if _, err := d.C.Run(ctx(t), id, "main", "x=changed", 30*time.Second); err != nil {
		t.Fatal(err)
	}
	if _, err := d.C.Restore(ctx(t), id, cp.Node.ID); err != nil {
		t.Fatal(err)
	}
	r, err := d.C.Run(ctx(t), id, "main", "echo $x", 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if strings.TrimSpace(r.Stdout) != "checkpointed" {
		t.Fatalf("after the restore x = %q, want checkpointed", r.Stdout)
	}
	// And the restored process is dumpable again, as it was: the sandbox may debug its
	// own processes. From the session's own children: another command's are outside its
	// Landlock domain (internal/landlock).
	if got, err := d.C.Run(ctx(t), id, "main", "cat /proc/"+pid+"/environ >/dev/null && echo ok", 30*time.Second); err != nil || !strings.Contains(got.Stdout, "ok") {
		t.Errorf("the restored session's /proc/%s/environ is unreadable from the session: %v %+v", pid, err, got)
	}
}
