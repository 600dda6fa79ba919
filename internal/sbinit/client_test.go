package sbinit

import (
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
