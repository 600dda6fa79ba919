package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"deltabox/internal/api"
	"deltabox/internal/criu"
	"deltabox/internal/testutil"
)

// tcpPair is a background python with two threads (CRIU carries it) that holds a
// loopback TCP connection with itself: its main thread sends the count each 50 ms, the
// other appends what it reads to /workspace/got.
const tcpPair = `import os, socket, threading, time
l = socket.socket(); l.bind(("127.0.0.1", 0)); l.listen()
c = socket.create_connection(l.getsockname()); a, _ = l.accept()
def serve():
    while True:
        b = a.recv(100)
        if not b: break
        with open("/workspace/got", "a") as f: f.write(b.decode())
threading.Thread(target=serve, daemon=True).start()
open("/workspace/pair.pid", "w").write(str(os.getpid()))
i = 0
while True:
    c.sendall(b"%d," % i); i += 1; time.sleep(0.05)
`

// TestCRIUTreeTCPWithoutKernelCache: a checkpoint of a tree that holds a TCP connection
// while CRIU's kernel-features cache is missing (after a boot, or an upgrade of CRIU,
// which makes it stale) answers at once, and the connection carries on. CRIU first
// connects a socket to itself, in the sandbox's namespace where it dumps, to rebuild its
// cache: a lock of all the sandbox's TCP traffic from before the dump made every such
// dump hang to its deadline (durable/tcp.go).
func TestCRIUTreeTCPWithoutKernelCache(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "tcpkdat"
	dbxCreate(t, d, id)
	if r := dbxExec(t, d, id, api.ExecRequest{Argv: []string{"bash", "-c", `printf %s "$1" > /workspace/pair.py`, "sh", tcpPair}}); r.ExitCode != 0 {
		t.Fatalf("write pair.py: %+v", r)
	}
	startJob(t, d, id, "python3 /workspace/pair.py", "/workspace/pair.pid")
	for _, f := range []string{filepath.Join(criu.KdatDir, "criu.kdat"), filepath.Join(criu.KdatDir, "unprivileged", "criu.kdat")} {
		if err := os.Remove(f); err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
	}
	start := time.Now()
	cp, err := d.C.Checkpoint(dbxCtx(t), id, "a")
	took := time.Since(start)
	if err != nil {
		t.Fatalf("checkpoint after %v: %v", took, err)
	}
	if cp.CRIUProcesses == 0 || took > 10*time.Second {
		t.Fatalf("checkpoint: %d processes through CRIU in %v, want the tree in well under CRIU's 30 s deadline", cp.CRIUProcesses, took)
	}
	count := func() int { return strings.Count(dbxSh(t, d, id, "cat /workspace/got"), ",") }
	n := count()
	time.Sleep(500 * time.Millisecond)
	if m := count(); m <= n {
		t.Fatalf("the connection carried nothing after the checkpoint: %d then %d numbers", n, m)
	}
}
