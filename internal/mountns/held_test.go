package mountns

import (
	"os"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/testutil/skip"
)

// TestBuilderHeld: a held builder (a fork's branch's) prepares no namespace ahead: its
// fresh is not called until a Build, which prepares its own worker and builds the
// state, and not after it either; its second Build starts the preparing ahead, depth
// ready and one more waiting beside the one it took.
func TestBuilderHeld(t *testing.T) {
	skip.Require(t, os.Geteuid() == 0, "needs root (mount namespaces)")
	base := baseNS(t, false)
	var made atomic.Int32
	// fresh makes a private copy of base, as a sandbox's init does (sbinit's mkns).
	fresh := func() (int, error) {
		made.Add(1)
		type res struct {
			fd  int
			err error
		}
		ch := make(chan res, 1)
		go func() {
			runtime.LockOSThread() // never unlocked: the thread leaves the test's namespace
			if err := unix.Unshare(unix.CLONE_FS); err != nil {
				ch <- res{-1, err}
				return
			}
			if err := unix.Setns(base, unix.CLONE_NEWNS); err != nil {
				ch <- res{-1, err}
				return
			}
			if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
				ch <- res{-1, err}
				return
			}
			fd, err := unix.Open("/proc/thread-self/ns/mnt", unix.O_RDONLY|unix.O_CLOEXEC, 0)
			ch <- res{fd, err}
		}()
		r := <-ch
		return r.fd, r.err
	}
	b, err := NewBuilder(base, 2, fresh, true)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	time.Sleep(100 * time.Millisecond)
	if n := made.Load(); n != 0 {
		t.Fatalf("a held builder prepared %d namespaces ahead", n)
	}
	build := func() {
		t.Helper()
		ov := overlayLike(t)
		ns, err := b.Build(ov)
		if err != nil {
			t.Fatal(err)
		}
		unix.Close(ns)
		unix.Close(ov)
	}
	build()
	time.Sleep(100 * time.Millisecond)
	if n := made.Load(); n != 1 {
		t.Fatalf("a held builder's first Build prepared %d namespaces, want its own one", n)
	}
	build()
	for deadline := time.Now().Add(10 * time.Second); made.Load() < 5; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("after the second Build: %d namespaces prepared, want 5 (the first Build's, the second's, 2 ready, 1 waiting)", made.Load())
		}
	}
	build()
}
