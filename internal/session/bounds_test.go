package session

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestLogBufKeepsTailAndCounts: the log keeps exactly the last size bytes, counts
// exactly what went, however the writes are split, and never holds more than size.
func TestLogBufKeepsTailAndCounts(t *testing.T) {
	var all bytes.Buffer
	for i := 0; i < 3000; i++ {
		fmt.Fprintf(&all, "line %d\n", i)
	}
	data := all.Bytes()
	for _, size := range []int{1, 7, 1000, len(data), len(data) + 5} {
		for _, step := range []int{1, 13, 999, 4096, len(data)} {
			l := newLogBuf(size)
			for i := 0; i < len(data); i += step {
				l.write(data[i:min(i+step, len(data))])
			}
			keep := min(size, len(data))
			if got := l.bytes(); !bytes.Equal(got, data[len(data)-keep:]) {
				t.Fatalf("size %d step %d: kept %d bytes, not the last %d", size, step, len(got), keep)
			}
			if l.dropped != int64(len(data)-keep) {
				t.Fatalf("size %d step %d: dropped %d, want %d", size, step, l.dropped, len(data)-keep)
			}
			if cap(l.b) > size {
				t.Fatalf("size %d step %d: holds %d bytes", size, step, cap(l.b))
			}
			m := string(l.withMarker())
			if (keep < len(data)) != strings.HasPrefix(m, fmt.Sprintf("[deltabox: %d earlier bytes dropped; the last %d kept]\n", len(data)-keep, keep)) {
				t.Fatalf("size %d step %d: marker %q", size, step, m[:min(80, len(m))])
			}
		}
	}
	l := newLogBuf(10)
	l.set([]byte("0123456789abc"), 5)
	if string(l.bytes()) != "3456789abc" || l.dropped != 8 {
		t.Fatalf("set: %q dropped %d", l.bytes(), l.dropped)
	}
}

// ptySession is a session on a real terminal with no process: the test writes into
// the slave what a sandbox's process would.
func ptySession(t *testing.T) (*Session, *os.File) {
	t.Helper()
	mfd, err := unix.Open("/dev/ptmx", unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Skipf("no /dev/ptmx: %v", err)
	}
	if err := unix.IoctlSetPointerInt(mfd, unix.TIOCSPTLCK, 0); err != nil {
		t.Fatal(err)
	}
	sfd, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(mfd), unix.TIOCGPTPEER, uintptr(unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC))
	if errno != 0 {
		t.Fatal(errno)
	}
	slave := os.NewFile(sfd, "pts")
	// Raw: no "\n" -> "\r\n", no echo; the bytes arrive as written.
	tio, err := unix.IoctlGetTermios(int(sfd), unix.TCGETS)
	if err != nil {
		t.Fatal(err)
	}
	tio.Oflag &^= unix.OPOST
	tio.Lflag &^= unix.ECHO | unix.ICANON
	if err := unix.IoctlSetTermios(int(sfd), unix.TCSETS, tio); err != nil {
		t.Fatal(err)
	}
	master, err := pollable(os.NewFile(uintptr(mfd), "ptmx"))
	if err != nil {
		t.Fatal(err)
	}
	s := &Session{name: "t", kind: Python, master: master, log: newLogBuf(logCap)}
	s.cond = sync.NewCond(&s.mu) // +checklocksignore: construction
	go s.readLoop()
	t.Cleanup(func() { slave.Close(); s.Release() })
	return s, slave
}

// TestIdleFloodBounded: 50 MB printed with no call running (a thread still writing
// after its call returned) leaves the session holding its last logCap bytes and the
// exact count of the rest.
func TestIdleFloodBounded(t *testing.T) {
	s, slave := ptySession(t)
	const total = 50 << 20
	chunk := bytes.Repeat([]byte("x"), 64<<10)
	for n := 0; n < total; n += len(chunk) {
		if _, err := slave.Write(chunk); err != nil {
			t.Fatal(err)
		}
	}
	slave.Write([]byte("end"))
	deadline := time.Now().Add(10 * time.Second)
	for !bytes.HasSuffix(s.Logs(), []byte("end")) {
		if time.Now().After(deadline) {
			t.Fatalf("the log has not seen the end after 10 s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	logs := s.Logs()
	want := fmt.Sprintf("[deltabox: %d earlier bytes dropped; the last %d kept]\n", total+3-logCap, logCap)
	if !bytes.HasPrefix(logs, []byte(want)) || len(logs) != len(want)+logCap {
		t.Fatalf("logs: %d bytes starting %q", len(logs), logs[:min(100, len(logs))])
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if cap(s.log.b) > logCap || cap(s.buf) != 0 {
		t.Fatalf("an idle session holds %d + %d bytes", cap(s.log.b), cap(s.buf))
	}
}

// TestCallFloodBounded: a call's 20 MB after a lone 0x1e (the sentinel's lead byte),
// read by a slow consumer, never piles up past pendingCap in the session (readLoop
// waits, the terminal pushes back on the writer); the answer keeps its head and tail
// with the exact count, and the call ends on its sentinel.
func TestCallFloodBounded(t *testing.T) {
	s, slave := ptySession(t)
	const total = 20 << 20
	go func() {
		slave.Write([]byte("\x1e"))
		chunk := bytes.Repeat([]byte("a"), 64<<10)
		for n := 0; n < total; n += len(chunk) {
			if _, err := slave.Write(chunk); err != nil {
				return
			}
		}
		slave.Write([]byte("\x1eDBX:ID:0\x1e"))
	}()
	s.mu.Lock()
	s.busy = true
	s.mu.Unlock()
	most, calls := 0, 0
	out := newOutput(1<<20, func([]byte) {
		// Called under s.mu, as await passes output on.
		most = max(most, len(s.buf)) // +checklocksignore: await holds s.mu

		if calls++; calls%64 == 0 {
			time.Sleep(time.Millisecond) // a slow reader of a streamed answer
		}
	})
	sen, err := s.await(context.Background(), "ID", 60*time.Second, out)
	s.endCall()
	if err != nil || sen.id != "ID" {
		t.Fatalf("await: %v %+v", err, sen)
	}
	if most > pendingCap+32<<10 {
		t.Errorf("the session held %d bytes the call had not consumed (cap %d)", most, pendingCap)
	}
	res, trunc := out.result()
	wantMarker := fmt.Sprintf("[deltabox: output truncated: %d bytes dropped here;", total+1-(1<<20))
	if out.total != total+1 || !trunc || !strings.Contains(res, wantMarker) {
		t.Errorf("answer: %d bytes passed, truncated %v, %q", out.total, trunc, res[max(0, len(res)/4-40):len(res)/4+120])
	}
}

// TestEndedCallKeepsTheLastOutput: the session's process is reported ended (init's
// exit message, watch) before its last output has been read from the terminal; the
// call still answers with that output, read up to the terminal's end. Before, the call
// answered at the exit report and "echo bye; builtin exit 9" lost "bye" on a loaded
// machine (TestBashSessionExitEndsTheCallNotTheShell).
func TestEndedCallKeepsTheLastOutput(t *testing.T) {
	s, slave := ptySession(t)
	exit := make(chan unix.WaitStatus, 1)
	s.watch(exit, 0)
	s.mu.Lock()
	s.busy = true
	s.mu.Unlock()
	exit <- unix.WaitStatus(9 << 8) // exited with status 9, reported first
	go func() {
		// What the process wrote last reaches the terminal after the report.
		time.Sleep(50 * time.Millisecond)
		slave.Write([]byte("bye\n"))
		slave.Close() // the last holder: readLoop reads the rest, then EIO
	}()
	out := newOutput(1<<20, nil)
	_, err := s.await(context.Background(), "ID", 10*time.Second, out)
	s.endCall()
	var ended *endedError
	if !errors.As(err, &ended) || ended.status != 9 {
		t.Fatalf("await: %v, want the session ended with status 9", err)
	}
	out.finish(false) // as Run does for an ended call (addNote)
	if res, _ := out.result(); res != "bye\n" {
		t.Fatalf("output %q, want %q", res, "bye\n")
	}
}
