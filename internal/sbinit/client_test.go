package sbinit

import (
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// A request that init never answers returns an error naming it after callTimeout,
// and leaves nothing pending.
func TestCallDeadline(t *testing.T) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fds[0])
	defer unix.Close(fds[1]) // a stuck init: it holds the socket and never reads
	defer func(d time.Duration) { callTimeout = d }(callTimeout)
	callTimeout = 100 * time.Millisecond
	c := newClient(fds[0], 4242, func() error { return nil })
	start := time.Now()
	err = c.Signal(7, unix.SIGTERM, false)
	if err == nil || !strings.Contains(err.Error(), "sandbox init (pid 4242) did not answer signal within 100ms") {
		t.Fatalf("error %v", err)
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Errorf("returned after %v", took)
	}
	if len(c.pending) != 0 { // +checklocksignore: the call is over
		t.Errorf("%d requests still pending", len(c.pending)) // +checklocksignore
	}
}

// pidfds counts this process's open pidfds.
func pidfds(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range ents {
		if l, _ := os.Readlink("/proc/self/fd/" + e.Name()); l == "anon_inode:[pidfd]" {
			n++
		}
	}
	return n
}

// TestSpawnReplyPidfdNotKept: the pidfd in a spawn reply of a process that init has
// already reaped when the reply is read (a short command on a loaded machine) is not
// the watch's (isChildOf refuses it) and must be closed, not left open in the daemon
// (TestLifecycleTeardownLeaks saw one such pidfd per short exec under load).
func TestSpawnReplyPidfdNotKept(t *testing.T) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fds[1])
	if err := unix.SetsockoptInt(fds[0], unix.SOL_SOCKET, unix.SO_PASSCRED, 1); err != nil {
		t.Fatal(err)
	}
	// A process already reaped, and a pidfd of it, as init's reply would carry.
	cmd := exec.Command("true")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pidfd, err := unix.PidfdOpen(cmd.Process.Pid, 0)
	if err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
	// The fake init is this process: its messages carry its PID (SO_PASSCRED).
	c := newClient(fds[0], os.Getpid(), func() error { return nil })
	go c.readLoop()
	before := pidfds(t)
	sent := make(chan struct{})
	go func() {
		defer close(sent)
		buf := newBuf()
		req, rfds, err := recv(fds[1], buf, nil)
		closeAll(rfds)
		if err != nil {
			return
		}
		send(fds[1], &Message{ID: req.ID, Pid: 4321}, []int{pidfd})
		unix.Close(pidfd)
	}()
	null, err := os.Open("/dev/null")
	if err != nil {
		t.Fatal(err)
	}
	defer null.Close()
	nfd := int(null.Fd())
	p, err := c.Spawn(SpawnOptions{Argv: []string{"true"}}, [3]int{nfd, nfd, nfd}, nfd)
	if err != nil {
		t.Fatal(err)
	}
	if p.Pid != 4321 {
		t.Fatalf("spawn answered pid %d, want 4321", p.Pid)
	}
	<-sent
	// The fake init closed its own pidfd after sending; the received copy must be gone too.
	if after := pidfds(t); after != before-1 {
		t.Fatalf("%d pidfds open before the spawn reply (its sender's included), %d after: the reply's pidfd of a reaped process is left open", before, after)
	}
}
