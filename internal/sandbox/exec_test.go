package sandbox

import (
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/sbinit"
)

// A killed command that never exits (uninterruptible sleep) ends the wait at killWait
// with an error naming it; one that exits gives its status.
func TestExitAfterKillHasADeadline(t *testing.T) {
	defer func(d time.Duration) { killWait = d }(killWait)
	killWait = 50 * time.Millisecond
	never := make(chan unix.WaitStatus)
	t0 := time.Now()
	_, _, err := exitAfterKill(&sbinit.Process{Pid: 42, Exit: never}, "sleep")
	if err == nil || !strings.Contains(err.Error(), `"sleep" (pid 42 in the sandbox) did not exit`) {
		t.Fatalf("err = %v, want one naming the command and its pid", err)
	}
	if d := time.Since(t0); d > time.Second {
		t.Fatalf("waited %v for a 50ms deadline", d)
	}
	exited := make(chan unix.WaitStatus, 1)
	exited <- unix.WaitStatus(9) // killed by SIGKILL
	ws, ok, err := exitAfterKill(&sbinit.Process{Pid: 42, Exit: exited}, "sleep")
	if err != nil || !ok || !ws.Signaled() || ws.Signal() != unix.SIGKILL {
		t.Fatalf("got %v %v %v, want the SIGKILL status", ws, ok, err)
	}
}

// capture keeps the first quarter and the last three quarters of its limit, whatever
// the sizes of the reads, counts the rest, and streams the same bytes: the head live,
// then the marker and the tail at finish.
func TestCaptureKeepsHeadAndTail(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, limit := range []int{1, 3, 4, 100, 4096} {
		for _, total := range []int{0, 1, limit / 4, limit - 1, limit, limit + 1, 3 * limit, 10*limit + 7} {
			data := make([]byte, total)
			for i := range data {
				data[i] = byte(rng.IntN(256))
			}
			c := newCapture(limit)
			var streamed []byte
			c.live = func(b []byte) { streamed = append(streamed, b...) }
			for rest := data; len(rest) > 0; {
				n := min(len(rest), 1+rng.IntN(2*limit+2))
				c.write(rest[:n])
				rest = rest[n:]
			}
			c.finish("stdout", func(_ string, b []byte) { streamed = append(streamed, b...) },
				func(_, kind, text string, d int64) { streamed = append(streamed, text...) })
			want, wantDropped := string(data), int64(0)
			if total > limit {
				h := limit / 4
				wantDropped = int64(total - limit)
				want = string(data[:h]) + DroppedMarker(wantDropped, "stdout") + string(data[total-(limit-h):])
			}
			got, dropped := c.result("stdout")
			if got != want || dropped != wantDropped {
				t.Fatalf("limit %d, %d bytes: kept %q (dropped %d), want %q (%d)", limit, total, got, dropped, want, wantDropped)
			}
			if string(streamed) != want {
				t.Fatalf("limit %d, %d bytes: streamed %q, want %q", limit, total, streamed, want)
			}
		}
	}
}
