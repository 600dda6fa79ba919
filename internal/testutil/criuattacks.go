package testutil

import (
	"context"
	"fmt"
	"testing"
	"time"

	"deltabox/internal/apitypes"
)

// Processes whose checkpoint lost them, before the daemon refused them (issue 24: a
// failed checkpoint must change nothing): a checkpoint moves a CRIU tree by ending it and
// restoring it from its images, and a restore that fails there fails the undo's restore
// too. Shared by the e2e tests of what CRIU carries and the security tests of the
// attacks they are.

// FullSendQueue is python code (socket imported) that leaves c, one end of a loopback
// TCP connection, with its send queue full (sent counts the bytes), and a, the other
// end, which reads nothing: a queue past what a CRIU restore in the sandbox can queue
// again, whose buffers the sandbox's user namespace caps (zdtm socket-tcpbuf;
// durable/tcp.go: bigQueues).
const FullSendQueue = `s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
c = socket.socket(); c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 30)
c.connect(s.getsockname()); a, _ = s.accept(); s.close(); c.setblocking(False); sent = 0
try:
    while True: sent += c.send(b"x" * 65536)
except BlockingIOError: pass`

// FullSendQueueState is a python expression of FullSendQueue's connection as it
// stands: the first bytes waiting for a (a peek in repair mode fails: EINVAL), c's TCP
// state (1: established) and whether c is in repair mode (TCP_REPAIR, 19: only CRIU
// sets it).
const FullSendQueueState = `"%r %d %d" % (a.recv(4, socket.MSG_PEEK), c.getsockopt(socket.SOL_TCP, socket.TCP_INFO, 1)[0], c.getsockopt(socket.SOL_TCP, 19))`

// tcpSharers' two grandchildren each lead a tree of its own once their parents have
// exited (init is their parent), have a second thread (the fast path refuses them: each
// tree goes to CRIU) and hold both ends of one loopback TCP connection.
const tcpSharers = `import os, socket, threading, time
l = socket.socket(); l.bind(("127.0.0.1", 0)); l.listen()
c = socket.create_connection(l.getsockname()); a, _ = l.accept(); l.close()
for i in range(2):
    if os.fork() == 0:
        if os.fork() == 0:
            threading.Thread(target=time.sleep, args=(100000,), daemon=True).start()
            open("/workspace/held%d" % i, "w").write(str(os.getpid()))
            while True:
                if os.path.exists("/workspace/ping%d" % i):
                    os.unlink("/workspace/ping%d" % i); c.sendall(b"%d" % i)
                    open("/workspace/got%d" % i, "w").write(a.recv(1).decode())
                time.sleep(0.02)
        os._exit(0)
    os.wait()
`

// StartTCPSharers starts in sandbox id two processes, each a CRIU tree of its own, that
// hold one TCP connection (tcpSharers), and returns their PIDs in the sandbox and ping:
// ping(i) has holder i send its digit through one end and returns what it read from
// the other, within 5 s ("" past that).
func StartTCPSharers(t testing.TB, d *Daemon, id string) (pids [2]string, ping func(i int) string) {
	t.Helper()
	run := func(script string, args ...string) *apitypes.ExecResult {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		r, err := d.C.Exec(ctx, id, apitypes.ExecRequest{Argv: append([]string{"bash", "-c", script, "sh"}, args...), TimeoutMS: 30_000})
		if err != nil {
			t.Fatalf("%q in %s: %v", script, id, err)
		}
		return r
	}
	if r := run(`printf %s "$1" > /workspace/share.py; cd /workspace; nohup python3 share.py </dev/null >/dev/null 2>&1 &
for i in $(seq 500); do [ -s held0 ] && [ -s held1 ] && exec echo $(cat held0) $(cat held1); sleep 0.01; done; exit 1`, tcpSharers); r.ExitCode != 0 {
		t.Fatalf("start the two holders of one TCP connection in %s: %+v", id, r)
	} else if _, err := fmt.Sscan(r.Stdout, &pids[0], &pids[1]); err != nil {
		t.Fatalf("the holders' PIDs %q: %v", r.Stdout, err)
	}
	return pids, func(i int) string {
		t.Helper()
		return run(fmt.Sprintf(`rm -f /workspace/got%[1]d; touch /workspace/ping%[1]d; for i in $(seq 500); do [ -s /workspace/got%[1]d ] && exec cat /workspace/got%[1]d; sleep 0.01; done`, i)).Stdout
	}
}
