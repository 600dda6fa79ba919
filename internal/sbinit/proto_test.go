package sbinit

import (
	"os"
	"runtime"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestRecvFitsBuffer: a reader's buffer starts small (firstBuf) and grows to the
// longest datagram it met: a message four times firstBuf arrives whole, with its fd,
// and the next small one is read into the same buffer.
func TestRecvFitsBuffer(t *testing.T) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fds[0])
	defer unix.Close(fds[1])
	null, err := os.Open("/dev/null")
	if err != nil {
		t.Fatal(err)
	}
	defer null.Close()
	long := strings.Repeat("x", 4*firstBuf)
	if err := send(fds[1], &Message{ID: 1, Data: long}, []int{int(null.Fd())}); err != nil {
		t.Fatal(err)
	}
	buf := newBuf()
	oob := make([]byte, unix.CmsgSpace(4*8))
	m, got, err := recv(fds[0], buf, oob)
	if err != nil {
		t.Fatal(err)
	}
	closeAll(got)
	if m.ID != 1 || m.Data != long || len(got) != 1 {
		t.Fatalf("a %d-byte message came as id %d, %d bytes of data, %d fds: want it whole with its fd", len(long), m.ID, len(m.Data), len(got))
	}
	grown := &(*buf)[0]
	if err := send(fds[1], &Message{ID: 2, Data: "short"}, nil); err != nil {
		t.Fatal(err)
	}
	if m, _, err := recv(fds[0], buf, oob); err != nil || m.ID != 2 || m.Data != "short" {
		t.Fatalf("the next message: %+v %v", m, err)
	}
	if &(*buf)[0] != grown {
		t.Fatal("the grown buffer was not kept for the next message")
	}
}

// TestAwaitReadyAllocatesLittle: waiting for an init's ready allocates far less than
// maxMessage (a buffer of 1 MiB per sandbox start was 7% of the daemon's CPU in a
// 64-branch fork: zeroed, faulted in, collected).
func TestAwaitReadyAllocatesLittle(t *testing.T) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fds[0])
	defer unix.Close(fds[1])
	c := newClient(fds[0], os.Getpid(), func() error { return nil })
	var before, after runtime.MemStats
	const n = 8
	runtime.ReadMemStats(&before)
	for range n {
		if err := send(fds[1], &Message{Op: "ready"}, nil); err != nil {
			t.Fatal(err)
		}
		if err := c.awaitReady(); err != nil {
			t.Fatal(err)
		}
	}
	runtime.ReadMemStats(&after)
	if per := (after.TotalAlloc - before.TotalAlloc) / n; per > maxMessage/8 {
		t.Fatalf("awaitReady allocated %d bytes per ready, want under %d", per, maxMessage/8)
	}
}
