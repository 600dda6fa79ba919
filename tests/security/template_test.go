package security

import (
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

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

// TestAPISignalCannotReachTemplates: `ps` in a sandbox lists its templates (stopped
// forks of its processes, in its PID namespace), and the API's signal goes through the
// sandbox's init, which no command's Landlock domain confines: a caller that signals
// every PID it sees (a grader's cleanup, `deltabox kill` of a listed PID) must not
// end a template or let it run. Before the refusal a SIGKILL to a template's PID
// answered 200 and ended it, and the next restore of its node came back from the
// durable image instead of the template.
func TestAPISignalCannotReachTemplates(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "sec-tmpl-sig"
	if _, err := d.C.Create(ctx(t), apitypes.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	// A background process outside the sessions, as `deltabox exec` leaves one.
	if _, err := d.C.Exec(ctx(t), id, apitypes.ExecRequest{Argv: []string{"bash", "-c", "nohup sleep 1000 >/dev/null 2>&1 </dev/null &"}}); err != nil {
		t.Fatal(err)
	}
	// The exec returns when bash exits, maybe before its child has exec'd sleep: the
	// template would then be a copy of bash or nohup.
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		r, err := d.C.Exec(ctx(t), id, apitypes.ExecRequest{Argv: []string{"ps", "-eo", "comm="}})
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(r.Stdout, "sleep\n") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the background sleep never ran: ps lists %q", r.Stdout)
		}
	}
	cp, err := d.C.Checkpoint(ctx(t), id, "one")
	if err != nil {
		t.Fatal(err)
	}
	// Until the node's durable image is written, a copy of the template for it is
	// stopped beside it (and ends at any moment): wait for the image, then for the
	// template alone (parking may run it for an instant: retry).
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		n, err := d.C.Node(ctx(t), cp.Node.ID)
		if err != nil {
			t.Fatal(err)
		}
		if im := n.ProcessImage; im != nil && (im.State == "complete" || strings.Contains(im.Error, "CRIU is unusable")) {
			break // no copy left (or none made: no durable images on this machine)
		} else if time.Now().After(deadline) || (im != nil && im.State == "failed") {
			t.Fatalf("node %s's durable image: %+v", cp.Node.ID, im)
		}
	}
	stopped := func() []int {
		t.Helper()
		r, err := d.C.Exec(ctx(t), id, apitypes.ExecRequest{Argv: []string{"ps", "-eo", "pid=,stat=,comm="}})
		if err != nil {
			t.Fatal(err)
		}
		var pids []int
		for _, l := range strings.Split(r.Stdout, "\n") {
			var pid int
			var st, comm string
			if n, _ := fmt.Sscan(l, &pid, &st, &comm); n == 3 && comm == "sleep" && strings.HasPrefix(strings.ToLower(st), "t") {
				pids = append(pids, pid)
			}
		}
		return pids
	}
	var tmpls []int
	for deadline := time.Now().Add(15 * time.Second); len(tmpls) != 1 && time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		tmpls = stopped()
	}
	if len(tmpls) != 1 {
		t.Fatalf("want the sleep's template alone stopped in ps, got %v (the test is blind); checkpoint: %+v", tmpls, cp)
	}
	for _, pid := range tmpls {
		for _, sig := range []int{int(unix.SIGKILL), int(unix.SIGCONT), int(unix.SIGTERM)} {
			_, err := d.C.Signal(ctx(t), id, pid, sig)
			if err == nil || !strings.Contains(err.Error(), "template") {
				t.Errorf("signal %d to held pid %d: err = %v, want a refusal naming the template", sig, pid, err)
			}
		}
	}
	if got := stopped(); len(got) != 1 || got[0] != tmpls[0] {
		t.Errorf("stopped sleeps after the signals: %v, want the template %d still stopped", got, tmpls[0])
	}
	res, err := d.C.Restore(ctx(t), id, cp.Node.ID)
	if err != nil {
		t.Fatal(err)
	}
	if res.FromImage || res.Processes == 0 {
		t.Errorf("restore after the signals: from_image %v, processes %d; want the templates forked back", res.FromImage, res.Processes)
	}
	// A command's own process is still signalled.
	r, err := d.C.Exec(ctx(t), id, apitypes.ExecRequest{Argv: []string{"bash", "-c", "nohup sleep 1000 >/dev/null 2>&1 </dev/null & echo $!"}})
	if err != nil {
		t.Fatal(err)
	}
	live, err := strconv.Atoi(strings.TrimSpace(r.Stdout))
	if err != nil {
		t.Fatalf("the background sleep's pid: %q: %v", r.Stdout, err)
	}
	if _, err := d.C.Signal(ctx(t), id, live, int(unix.SIGKILL)); err != nil {
		t.Errorf("signal to a command's process %d: %v", live, err)
	}
}
