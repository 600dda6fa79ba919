package fastpath

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/remote"
)

// TestHandFD: the tracee receives a duplicate of the daemon's fd (the same namespace),
// and holds nothing else of the hand-over afterwards (no socket left).
func TestHandFD(t *testing.T) {
	cmd := exec.Command("sleep", "100")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	// Counted once sleep runs: before its exec, the child still has the test's fds.
	for i := 0; i < 200; i++ {
		if exe, _ := os.Readlink("/proc/" + strconv.Itoa(cmd.Process.Pid) + "/exe"); filepath.Base(exe) == "sleep" {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	time.Sleep(50 * time.Millisecond) // exec closes close-on-exec fds after it sets exe
	fdsBefore := countFDs(t, cmd.Process.Pid)
	ns := ownMountNS(t)
	tr := remote.NewTracer()
	defer tr.Close()
	tt, err := tr.Seize(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	var got string
	err = tr.Do(func() error {
		h, err := handFD(tt, ns)
		if err != nil {
			return err
		}
		var b remote.Batch
		h.recvCalls(&b)
		if _, err := tt.RunBatch(&b); err != nil {
			return err
		}
		got, _ = readlinkProc(cmd.Process.Pid, h.tx)
		return tt.Close(h.tx)
	})
	if err != nil {
		t.Fatal(err)
	}
	want, _ := readlinkProc(os.Getpid(), ns)
	if got != want || got == "" {
		t.Fatalf("the tracee received %q, want %q", got, want)
	}
	if err := tt.Detach(); err != nil {
		t.Fatal(err)
	}
	if n := countFDs(t, cmd.Process.Pid); n != fdsBefore {
		out, _ := exec.Command("ls", "-l", "/proc/"+strconv.Itoa(cmd.Process.Pid)+"/fd").CombinedOutput()
		t.Fatalf("the tracee has %d fds after the hand-over, %d before:\n%s", n, fdsBefore, out)
	}
}

// BenchmarkHandFD: what handing a namespace to one process costs (once per process
// moved by a checkpoint or a restore, and per template parked), with the Restore
// that ends every injected sequence.
func BenchmarkHandFD(b *testing.B) {
	cmd := exec.Command("sleep", "100")
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	ns, err := unix.Open("/proc/self/ns/mnt", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		b.Fatal(err)
	}
	defer unix.Close(ns)
	tr := remote.NewTracer()
	defer tr.Close()
	tt, err := tr.Seize(cmd.Process.Pid)
	if err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	err = tr.Do(func() error {
		for i := 0; i < b.N; i++ {
			h, err := handFD(tt, ns)
			if err != nil {
				return err
			}
			var hb remote.Batch
			h.recvCalls(&hb)
			hb.Add("close", unix.SYS_CLOSE, h.tx)
			if _, err := tt.RunBatch(&hb); err != nil {
				return err
			}
			b.StopTimer()
			if err := tt.Restore(); err != nil { // frees the scratch memory, as a move's end does
				return err
			}
			b.StartTimer()
		}
		return nil
	})
	if err != nil {
		b.Fatal(err)
	}
	tt.Detach()
}

func readlinkProc(pid, fd int) (string, error) {
	return os.Readlink("/proc/" + strconv.Itoa(pid) + "/fd/" + strconv.Itoa(fd))
}

func countFDs(t *testing.T, pid int) int {
	ents, err := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// TestHandFDs: several fds handed over on one socket arrive in order, each as h.tx once
// the previous one was closed (what a placed copy's batch relies on to setns each), and
// nothing of the hand-over is left in the tracee.
func TestHandFDs(t *testing.T) {
	cmd := exec.Command("sleep", "100")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	for i := 0; i < 200; i++ {
		if exe, _ := os.Readlink("/proc/" + strconv.Itoa(cmd.Process.Pid) + "/exe"); filepath.Base(exe) == "sleep" {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	time.Sleep(50 * time.Millisecond)
	fdsBefore := countFDs(t, cmd.Process.Pid)
	var fds []int
	for _, k := range []string{"mnt", "uts", "ipc", "net"} {
		fd, err := unix.Open("/proc/self/ns/"+k, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Close(fd)
		fds = append(fds, fd)
	}
	tr := remote.NewTracer()
	defer tr.Close()
	tt, err := tr.Seize(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	const at = 200 // where the batch parks each received fd, to look at it afterwards
	got := make([]string, len(fds))
	err = tr.Do(func() error {
		h, err := handFDs(tt, fds)
		if err != nil {
			return err
		}
		var b remote.Batch
		h.openCalls(&b)
		for i := range fds {
			h.recvNext(&b, "a namespace")
			b.Add("park it", unix.SYS_DUP3, h.tx, at+i, 0)
			b.Add("close it", unix.SYS_CLOSE, h.tx)
		}
		h.closeRx(&b)
		if _, err := tt.RunBatch(&b); err != nil {
			h.cleanup(tt)
			return err
		}
		for i := range fds {
			got[i], _ = readlinkProc(cmd.Process.Pid, at+i)
			if err := tt.Close(at + i); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for i, fd := range fds {
		if want, _ := readlinkProc(os.Getpid(), fd); got[i] != want || want == "" {
			t.Fatalf("fd %d of %d handed over: the tracee received %q, want %q (all: %q)", i, len(fds), got[i], want, got)
		}
	}
	if err := tt.Detach(); err != nil {
		t.Fatal(err)
	}
	if n := countFDs(t, cmd.Process.Pid); n != fdsBefore {
		out, _ := exec.Command("ls", "-l", "/proc/"+strconv.Itoa(cmd.Process.Pid)+"/fd").CombinedOutput()
		t.Fatalf("the tracee has %d fds after the hand-over, %d before:\n%s", n, fdsBefore, out)
	}
}
