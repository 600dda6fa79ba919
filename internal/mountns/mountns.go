// Package mountns builds the mount namespace of one sandbox state.
//
// Every sandbox has a base mount namespace, made by its init (see package sbinit):
// its root is a small read-only tmpfs holding /proc (of the sandbox's PID namespace),
// a minimal /dev with a private devpts, and an empty /rootfs directory. A state
// namespace is a copy of that base (unshare(CLONE_NEWNS) from inside it) in which the
// state's overlay is attached at /rootfs, /dev and /proc are bound into it, and
// pivot_root makes the overlay the root. The result is an nsfs fd: processes are started
// in it with setns, and dropping the last reference unmounts the overlay.
//
// Why a namespace per state rather than one namespace whose root is re-mounted: a
// process's root and cwd pin the mount they were taken on, so the only way to move
// processes onto a new overlay without leaving the old one alive is to give them a new
// namespace (setns resets root and cwd), which is also what the fast path injects into
// live processes.
package mountns

import (
	"fmt"
	"runtime"

	"golang.org/x/sys/unix"
)

// hostProc is an fd on the host's /proc, opened before any thread changes namespace:
// inside a state namespace /proc belongs to the sandbox's PID namespace, where daemon
// threads are invisible, so /proc/thread-self must be reached through this fd.
var hostProc = func() int {
	fd, err := unix.Open("/proc", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		panic(fmt.Sprintf("mountns: open /proc: %v", err))
	}
	return fd
}()

// Paths inside the base namespace (made by sbinit.setupRoot).
const (
	RootfsDir = "/rootfs"
	// Overlay directories that must exist in every image, because they are mount points.
	devDir  = "/dev"
	procDir = "/proc"
	shmDir  = "/dev/shm"
)

// Build makes a new state namespace from baseNS (an nsfs fd of the sandbox's base mount
// namespace) with the detached overlay mount overlayFD as its root, and returns an nsfs
// fd for it. overlayFD is consumed on success and on failure.
//
// It runs on a fresh OS thread that is locked and never unlocked: after
// unshare(CLONE_FS) and setns the thread no longer shares root, cwd and mount namespace
// with the rest of the daemon, so it must die with the goroutine (Go terminates a
// thread whose goroutine exits while locked).
func Build(baseNS, overlayFD int) (int, error) {
	type result struct {
		fd  int
		err error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: see above
		fd, err := build(baseNS, overlayFD)
		ch <- result{fd, err}
	}()
	r := <-ch
	unix.Close(overlayFD)
	return r.fd, r.err
}

func build(baseNS, overlayFD int) (int, error) {
	if err := unix.Unshare(unix.CLONE_FS); err != nil {
		return -1, fmt.Errorf("unshare CLONE_FS: %w", err)
	}
	if err := unix.Setns(baseNS, unix.CLONE_NEWNS); err != nil {
		return -1, fmt.Errorf("setns into the sandbox's base mount namespace: %w", err)
	}
	if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
		return -1, fmt.Errorf("unshare CLONE_NEWNS: %w", err)
	}
	if err := unix.MoveMount(overlayFD, "", unix.AT_FDCWD, RootfsDir, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return -1, fmt.Errorf("attach overlay at %s: %w", RootfsDir, err)
	}
	for _, d := range []string{devDir, procDir, shmDir} {
		var st unix.Stat_t
		if err := unix.Stat(RootfsDir+d, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFDIR {
			return -1, fmt.Errorf("the image has no directory %s (a mount point): re-import the image", d)
		}
	}
	// /dev/shm is the overlay's own directory so that it rolls back with the state; take
	// a clone of it before /dev (the base's tmpfs) covers it.
	shm, err := unix.OpenTree(unix.AT_FDCWD, RootfsDir+shmDir, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
	if err != nil {
		return -1, fmt.Errorf("clone %s: %w", shmDir, err)
	}
	defer unix.Close(shm)
	if err := unix.Mount(devDir, RootfsDir+devDir, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		return -1, fmt.Errorf("bind /dev: %w", err)
	}
	if err := unix.MoveMount(shm, "", unix.AT_FDCWD, RootfsDir+shmDir, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return -1, fmt.Errorf("attach /dev/shm: %w", err)
	}
	if err := unix.Mount(procDir, RootfsDir+procDir, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		return -1, fmt.Errorf("bind /proc: %w", err)
	}
	// pivot_root(".", ".") stacks the old root under the new one; detaching "." then
	// drops the base's tmpfs (and its /proc and /dev, already bound into the overlay)
	// from this namespace only. This is runc's pivotRoot.
	oldRoot, err := unix.Open("/", unix.O_DIRECTORY|unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	defer unix.Close(oldRoot)
	if err := unix.Chdir(RootfsDir); err != nil {
		return -1, err
	}
	if err := unix.PivotRoot(".", "."); err != nil {
		return -1, fmt.Errorf("pivot_root: %w", err)
	}
	if err := unix.Fchdir(oldRoot); err != nil {
		return -1, err
	}
	if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
		return -1, fmt.Errorf("detach old root: %w", err)
	}
	if err := unix.Chdir("/"); err != nil {
		return -1, err
	}
	fd, err := unix.Openat(hostProc, "thread-self/ns/mnt", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("open the new namespace: %w", err)
	}
	return fd, nil
}
