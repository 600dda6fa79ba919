package mountns

import (
	"os"
	"path/filepath"
	"runtime"
	"testing"

	"golang.org/x/sys/unix"

	"deltabox/internal/sbinit"
	"deltabox/internal/testutil/skip"
)

// BenchmarkBuild times what a checkpoint or restore waits for in Builder.Build, finish
// on a worker that has entered the base namespace, on a base namespace like a sandbox's
// (tmpfs root, /proc, a /dev tmpfs with null), with and without sbinit's /proc masks,
// which every state's recursive clone of /proc copies. The overlay is a tmpfs here
// (made outside the timer): the cost measured is the namespace's, not overlayfs's.
func BenchmarkBuild(b *testing.B) {
	skip.Require(b, os.Geteuid() == 0, "needs root (mount namespaces)")
	for _, masked := range []bool{false, true} {
		name := "unmasked"
		if masked {
			name = "masked"
		}
		b.Run(name, func(b *testing.B) {
			base := baseNS(b, masked)
			for b.Loop() {
				b.StopTimer()
				ov := overlayLike(b)
				done := make(chan error)
				go func() {
					runtime.LockOSThread() // never unlocked: the thread changes namespace
					if err := enter(base); err != nil {
						done <- err
						return
					}
					b.StartTimer()
					ns, err := finish(ov)
					b.StopTimer()
					unix.Close(ns)
					done <- err
				}()
				if err := <-done; err != nil {
					b.Fatal(err)
				}
				unix.Close(ov)
				b.StartTimer()
			}
		})
	}
}

// BenchmarkEnter times what a Builder's worker does ahead of an operation: enter a
// private copy of the base namespace (unshare copies every mount, masks included).
func BenchmarkEnter(b *testing.B) {
	skip.Require(b, os.Geteuid() == 0, "needs root (mount namespaces)")
	for _, masked := range []bool{false, true} {
		name := "unmasked"
		if masked {
			name = "masked"
		}
		b.Run(name, func(b *testing.B) {
			base := baseNS(b, masked)
			for b.Loop() {
				done := make(chan error)
				go func() {
					runtime.LockOSThread() // never unlocked: the thread changes namespace
					done <- enter(base)
				}()
				if err := <-done; err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// baseNS makes a base namespace as sbinit.setupRoot does, on a thread that is then
// discarded, and returns an nsfs fd for it.
func baseNS(b testing.TB, masked bool) int {
	if err := OpenHostProc(); err != nil {
		b.Fatal(err)
	}
	dir := b.TempDir()
	type res struct {
		fd  int
		err error
	}
	ch := make(chan res, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread leaves the test's namespace
		fail := func(err error) { ch <- res{-1, err} }
		if err := unix.Unshare(unix.CLONE_FS | unix.CLONE_NEWNS); err != nil {
			fail(err)
			return
		}
		if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
			fail(err)
			return
		}
		if err := unix.Mount("bench", dir, "tmpfs", 0, "size=1m"); err != nil {
			fail(err)
			return
		}
		for _, d := range []string{"proc", "dev"} {
			os.Mkdir(filepath.Join(dir, d), 0o755)
		}
		if err := unix.Mount("proc", filepath.Join(dir, "proc"), "proc", 0, ""); err != nil {
			fail(err)
			return
		}
		if err := unix.Mount("tmpfs", filepath.Join(dir, "dev"), "tmpfs", 0, "size=64k"); err != nil {
			fail(err)
			return
		}
		os.Mkdir(filepath.Join(dir, "dev", "shm"), 0o755)
		null := filepath.Join(dir, "dev", "null")
		if err := unix.Mknod(null, unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))); err != nil {
			fail(err)
			return
		}
		if masked {
			if err := sbinit.MaskProc(filepath.Join(dir, "proc"), null); err != nil {
				fail(err)
				return
			}
		}
		if err := unix.Chdir(dir); err != nil {
			fail(err)
			return
		}
		if err := unix.PivotRoot(".", "."); err != nil {
			fail(err)
			return
		}
		if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
			fail(err)
			return
		}
		fd, err := unix.Open("/proc/thread-self/ns/mnt", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		ch <- res{fd, err}
	}()
	r := <-ch
	if r.err != nil {
		b.Fatal(r.err)
	}
	b.Cleanup(func() { unix.Close(r.fd) })
	return r.fd
}

// overlayLike is a detached tmpfs mount with the mount points a state's overlay has.
func overlayLike(b testing.TB) int {
	fs, err := unix.Fsopen("tmpfs", unix.FSOPEN_CLOEXEC)
	if err != nil {
		b.Fatal(err)
	}
	defer unix.Close(fs)
	if err := unix.FsconfigCreate(fs); err != nil {
		b.Fatal(err)
	}
	m, err := unix.Fsmount(fs, unix.FSMOUNT_CLOEXEC, 0)
	if err != nil {
		b.Fatal(err)
	}
	for _, d := range []string{"dev", "dev/shm", "proc"} {
		if err := unix.Mkdirat(m, d, 0o755); err != nil {
			b.Fatal(err)
		}
	}
	return m
}
