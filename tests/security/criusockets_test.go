package security

import (
	"os"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/testutil"
)

// TestCRIUTreeSocketsDoNotDrainDaemonFds: a CRIU restore puts back the times of the
// files of the unix sockets the tree bound, through their directories, which the daemon
// holds open from before CRIU runs to its post-restore (durable/unixsk.go). The attack:
// a tree (two threads, so CRIU takes it) binds thousands of sockets; a checkpoint that
// moves it onto a new state restores it, and the daemon, one fd a socket, ran out of
// fds (its limit is shared by every sandbox's operations). The daemon's open fds must
// stay bounded during that checkpoint.
func TestCRIUTreeSocketsDoNotDrainDaemonFds(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id, marker, n = "sec-sk", "dbxmanysockets", 3000
	if _, err := d.C.Create(ctx(t), apitypes.CreateOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	sh(t, d, id, `mkdir -p /workspace/s; cd /workspace/s
nohup python3 -c "
import socket, threading, time, resource
resource.setrlimit(resource.RLIMIT_NOFILE, (`+strconv.Itoa(n+100)+`, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
ss = []
for i in range(`+strconv.Itoa(n)+`):
    s = socket.socket(socket.AF_UNIX); s.bind('/workspace/s/%d' % i); ss.append(s)
threading.Thread(target=time.sleep, args=(1000,), daemon=True).start()
open('/workspace/ready', 'w').close()
time.sleep(1000)" `+marker+` </dev/null >/dev/null 2>&1 &
for i in $(seq 1000); do [ -e /workspace/ready ] && exit 0; sleep 0.01; done; exit 1`)
	if got := sh(t, d, id, "ls /workspace/s | wc -l"); got != strconv.Itoa(n)+"\n" {
		t.Fatalf("the tree bound %q sockets, want %d", got, n)
	}
	fds := func() int {
		ents, _ := os.ReadDir("/proc/" + strconv.Itoa(d.Pid()) + "/fd")
		return len(ents)
	}
	base := fds()
	var peak atomic.Int64
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		for {
			if n := int64(fds()); n > peak.Load() {
				peak.Store(n)
			}
			select {
			case <-stop:
				return
			default:
				time.Sleep(200 * time.Microsecond)
			}
		}
	}()
	// A changed file: the checkpoint mounts a new state and moves the tree onto it by
	// a CRIU restore.
	sh(t, d, id, "echo x > /workspace/changed")
	cp, err := d.C.CheckpointWith(ctx(t), id, apitypes.CheckpointRequest{Label: "sockets"})
	close(stop)
	<-done
	if err != nil || cp.CRIUProcesses != 1 {
		t.Fatalf("checkpoint: %v %+v, want the tree taken through CRIU", err, cp)
	}
	if got := sh(t, d, id, "ps -eo args | grep -c [d]bxmanysockets; ls /workspace/s | wc -l"); got != "1\n"+strconv.Itoa(n)+"\n" {
		t.Fatalf("after the checkpoint: %q, want the tree and its %d sockets", got, n)
	}
	t.Logf("the daemon's fds: %d before, %d at the most during the checkpoint", base, peak.Load())
	if rise := int(peak.Load()) - base; rise > 1000 {
		t.Fatalf("the daemon's open fds rose by %d during the checkpoint (from %d), want a bound well under the tree's %d sockets", rise, base, n)
	}
}
