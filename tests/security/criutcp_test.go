package security

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"deltabox/internal/apitypes"
	"deltabox/internal/errdefs"
	"deltabox/internal/testutil"
)

// A checkpoint moves each CRIU tree onto its new state by ending it and restoring it
// from its images (state/criutrees.go), and the undo of a failed move restores it the
// same way: what the sandbox's code makes such a restore fail on lost the process with
// the checkpoint. Each of these is refused at the dump, before anything is ended.

// nodeCount is how many nodes d's tree has.
func nodeCount(t *testing.T, d *testutil.Daemon) int {
	t.Helper()
	tr, err := d.C.Tree(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	return len(tr.Nodes)
}

// tcpQueueHolder runs testutil.FullSendQueue in a process with a second thread (the
// fast path refuses it): /tmp/q.ask has it write FullSendQueueState to /tmp/q.state,
// /tmp/q.drain has it read what its connection carries, 10 s at most, and write "GOT
// SENT" to /tmp/q.drained.
const tcpQueueHolder = "import os, socket, threading, time\n" +
	"threading.Thread(target=time.sleep, args=(100000,), daemon=True).start()\n" +
	testutil.FullSendQueue + `
open("/tmp/q.pid", "w").write(str(os.getpid()))
while True:
    if os.path.exists("/tmp/q.ask"):
        try: st = ` + testutil.FullSendQueueState + `
        except Exception as e: st = repr(e)
        open("/tmp/q.state", "w").write(st); os.unlink("/tmp/q.ask")
    if os.path.exists("/tmp/q.drain"):
        a.settimeout(10); got = 0
        try:
            while got < sent: got += len(a.recv(1 << 20))
        except OSError: pass
        open("/tmp/q.drained", "w").write("%d %d" % (got, sent)); os.unlink("/tmp/q.drain")
    time.sleep(0.02)
`

// TestCRIUTreeSendQueuePastRestoreRefused: the attack: a background process fills a TCP
// connection's send queue up to what the sandbox's user namespace lets a socket's
// buffer hold, which a restore may not fit again, its own skbs counting (an 8,284,464-byte
// queue did not go back into an 8 MiB buffer: durable/tcp.go; zdtm socket-tcpbuf):
// the move's restore then failed after the process was ended, the undo's too, and the
// checkpoint lost it. What must hold: the checkpoint refuses (409, naming the queue)
// and makes no node; the process runs on, the same one (its host PID), its connection
// as it was (the same bytes waiting, established, out of CRIU's repair mode), and every
// byte it sent arrives.
func TestCRIUTreeSendQueuePastRestoreRefused(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id, marker = "sec-tcpq", "dbxtcpqueue"
	if _, err := d.C.Create(ctx(t), apitypes.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	sh(t, d, id, "cat > /tmp/q.py <<'PY'\n"+tcpQueueHolder+"PY\nnohup python3 /tmp/q.py "+marker+` </dev/null >/dev/null 2>&1 &
for i in $(seq 1000); do [ -s /tmp/q.pid ] && exit 0; sleep 0.01; done; exit 1`)
	ask := func(what string) string {
		t.Helper()
		out := sh(t, d, id, `rm -f /tmp/q.state; touch /tmp/q.ask; for i in $(seq 500); do [ -s /tmp/q.state ] && exec cat /tmp/q.state; sleep 0.01; done`)
		if out == "" {
			t.Fatalf("%s: the queue's holder did not answer within 5 s", what)
		}
		return out
	}
	host, before, nodes := hostPidsWith(t, marker), ask("before"), nodeCount(t, d)
	if len(host) != 1 || !strings.HasSuffix(before, " 1 0") {
		t.Fatalf("the holder: host PIDs %v, its connection %q; want one process, established, out of repair mode", host, before)
	}
	_, err := d.C.Checkpoint(ctx(t), id, "full queue")
	if !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "more than a restore in the sandbox can queue again") {
		t.Fatalf("checkpoint: %v, want a conflict naming the queue", err)
	}
	if n := nodeCount(t, d); n != nodes {
		t.Fatalf("the refused checkpoint made a node: %d nodes, %d before", n, nodes)
	}
	if after := hostPidsWith(t, marker); fmt.Sprint(after) != fmt.Sprint(host) {
		t.Fatalf("the holder after the refusal: host PIDs %v, want the same process (%v)", after, host)
	}
	if after := ask("after the refusal"); after != before {
		t.Fatalf("the holder's connection after the refusal: %q, want %q", after, before)
	}
	got := sh(t, d, id, `touch /tmp/q.drain; for i in $(seq 1500); do [ -s /tmp/q.drained ] && exec cat /tmp/q.drained; sleep 0.01; done`)
	if f := strings.Fields(got); len(f) != 2 || f[0] != f[1] || f[0] == "0" {
		t.Fatalf("bytes read from the connection, and sent: %q; want every byte sent to arrive", got)
	}
}

// TestCRIUTreesSharingATCPConnectionRefused: CRIU dumps and restores each tree apart.
// The attack: two processes left to init, each a tree of its own, hold one TCP
// connection, so that both trees' images hold it: the move restored it twice, the second
// restore failed on the address the first had taken, the undo's too, and both processes
// were lost. What must hold: the checkpoint refuses (409, naming the shared socket) and
// makes no node; both processes run on, the same ones (their start times), each sending
// and receiving through the connection.
func TestCRIUTreesSharingATCPConnectionRefused(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "sec-tcps"
	if _, err := d.C.Create(ctx(t), apitypes.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	pids, ping := testutil.StartTCPSharers(t, d, id)
	starts := func() string {
		return sh(t, d, id, fmt.Sprintf("cut -d' ' -f22 /proc/%s/stat /proc/%s/stat", pids[0], pids[1]))
	}
	before, nodes := starts(), nodeCount(t, d)
	if len(strings.Fields(before)) != 2 {
		t.Fatalf("the holders' start times: %q, want two", before)
	}
	_, err := d.C.Checkpoint(ctx(t), id, "shared")
	if !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "share socket:") {
		t.Fatalf("checkpoint: %v, want a conflict naming the shared socket", err)
	}
	if n := nodeCount(t, d); n != nodes {
		t.Fatalf("the refused checkpoint made a node: %d nodes, %d before", n, nodes)
	}
	if after := starts(); after != before {
		t.Fatalf("the holders (%v) after the refusal: start times %q, want the same processes (%q)", pids, after, before)
	}
	for i := range 2 {
		if got := ping(i); got != fmt.Sprint(i) {
			t.Fatalf("holder %d after the refusal: %q through the connection, want its byte back", i, got)
		}
	}
}
