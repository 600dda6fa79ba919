// Package mountns builds the mount namespace of one sandbox state.
//
// Every sandbox has a base mount namespace, made by its init (see package sbinit):
// its root is a small read-only tmpfs holding /proc (of the sandbox's PID namespace)
// and a minimal, read-only /dev with a private devpts. A state namespace is a copy of that base
// (unshare(CLONE_NEWNS) from inside it) in which the state's overlay is stacked on "/"
// and clones of /dev and /proc are mounted inside it (finish says why there is no
// pivot_root). The result is an nsfs fd: processes are started in it with setns, and
// dropping the last reference unmounts the overlay.
//
// Why a namespace per state rather than one namespace whose root is re-mounted: a
// process's root and cwd pin the mount they were taken on, so the only way to move
// processes onto a new overlay without leaving the old one alive is to give them a new
// namespace (setns resets root and cwd), which is also what the fast path injects into
// live processes.
package mountns

import (
	"fmt"
	"io"
	"os"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"

	_ "deltabox/internal/mainthread" // the main thread is never discarded (see there)
)

// hostProc is an fd on the host's /proc: inside a state namespace /proc belongs to the
// sandbox's PID namespace, where daemon threads are invisible, so /proc/thread-self must
// be reached through this fd. Opened by OpenHostProc at the daemon's start (NewBuilder
// checks it), from a goroutine that is not locked to a thread (such a goroutine never
// runs on a thread that changed namespace: those are locked and die with their
// goroutine). Not at package init: every process of the binary runs that, the sandbox's
// init too, which would then hold the host's /proc where the sandbox's processes reach
// it (/proc/1/fd/N).
var hostProc = sync.OnceValues(func() (int, error) {
	fd, err := unix.Open("/proc", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("mountns: open /proc: %w", err)
	}
	return fd, nil
})

// OpenHostProc opens the daemon's fd on the host's /proc (hostProc), once. The daemon
// calls it at start, before any sandbox; it is kept for the daemon's life.
func OpenHostProc() error {
	_, err := hostProc()
	return err
}

// Paths inside the base namespace (made by sbinit.setupRoot).
const (
	// Overlay directories that must exist in every image, because they are mount points.
	devDir  = "/dev"
	procDir = "/proc"
	shmDir  = "/dev/shm"
)

// LookedUp are the top-level names of a state's overlay that Build looks up: its mount
// points (/dev, /dev/shm, /proc). overlayfs keeps what it has looked up, with the layers
// each name was found in, so a state built before a layer under it was filled (the
// prepared next state) would not see that layer's dev/ or proc/.
var LookedUp = []string{"dev", "proc"}

// Builder makes state namespaces for one sandbox. It keeps a few OS threads ready
// that have already entered a private copy of the base namespace (unshare(CLONE_FS),
// setns, unshare(CLONE_NEWNS): about 100 us with thread creation), so that a checkpoint
// or restore only pays for stacking the overlay on the root and mounting /dev and /proc.
//
// Each worker thread is locked and never unlocked: after unshare(CLONE_FS) and setns it
// no longer shares root, cwd and mount namespace with the rest of the daemon, so it must
// die with its goroutine (Go terminates a thread whose goroutine exits while locked).
type Builder struct {
	baseNS int // owned (a dup); closed by Close
	// fresh, when set, gives a new private copy of the base namespace made inside the
	// sandbox's user namespace (by its init), which a worker enters instead of
	// unsharing one itself: a namespace belongs to the user namespace of its creator,
	// and the sandbox's processes may setns only into namespaces of theirs.
	fresh func() (int, error)
	ready chan *worker
	stop  chan struct{}
	done  chan struct{}
	// start is closed once workers may be prepared ahead: at once, or at a held
	// builder's second Build (NewBuilder).
	start  chan struct{}
	resume sync.Once
	// first is set while a held builder's first Build has not come.
	first atomic.Bool
}

type worker struct {
	err  error // preparing failed
	jobs chan job
}

type job struct {
	overlayFD int // -1: exit
	res       chan result
}

type result struct {
	fd  int
	err error
}

// NewBuilder starts a builder on baseNS (an nsfs fd of the sandbox's base mount
// namespace, which the builder duplicates) keeping depth workers ready. fresh, if not
// nil, makes each worker's namespace (see Builder.fresh). A held builder prepares no
// worker ahead until its second Build: its first prepares its own. A fork's branch is
// held: its one state is built in the fork, and the workers ahead (depth+1, each a
// thread and a namespace its init makes: 0.3-0.7 ms of CPU per branch) would take the
// CPUs the fork's other branches wait for, and then the CPUs its first calls need
// (made after the fork's answer, they delayed 64 branches' first answers); a branch
// that never checkpoints or restores never needs them.
func NewBuilder(baseNS, depth int, fresh func() (int, error), held bool) (*Builder, error) {
	if _, err := hostProc(); err != nil { // here, before any worker thread changes namespace
		return nil, err
	}
	fd, err := unix.FcntlInt(uintptr(baseNS), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	b := &Builder{baseNS: fd, fresh: fresh, ready: make(chan *worker, depth), stop: make(chan struct{}), done: make(chan struct{}), start: make(chan struct{})}
	if held {
		b.first.Store(true)
	} else {
		b.prepareAhead()
	}
	go b.fill()
	return b, nil
}

// prepareAhead lets the builder's fill prepare workers ahead.
func (b *Builder) prepareAhead() { b.resume.Do(func() { close(b.start) }) }

func (b *Builder) fill() {
	defer close(b.done)
	select {
	case <-b.start:
	case <-b.stop:
		return
	}
	for {
		w := b.prepare()
		select {
		case b.ready <- w:
		case <-b.stop:
			w.jobs <- job{overlayFD: -1}
			return
		}
	}
}

// prepare starts a worker thread and waits until it stands in a fresh namespace.
func (b *Builder) prepare() *worker {
	w := &worker{jobs: make(chan job)}
	prepared := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: see Builder
		var err error
		if b.fresh != nil {
			err = enterFresh(b.fresh)
		} else {
			err = enter(b.baseNS)
		}
		prepared <- err
		j := <-w.jobs
		if j.overlayFD < 0 || err != nil {
			if j.res != nil {
				j.res <- result{-1, err}
			}
			return
		}
		fd, err := finish(j.overlayFD)
		j.res <- result{fd, err}
	}()
	w.err = <-prepared
	return w
}

// Build makes a new state namespace with the detached overlay mount overlayFD as its
// root and returns an nsfs fd for it. On success overlayFD stays open and now refers to
// the root of the attached overlay (the caller keeps it as the state's root, for
// openat2 RESOLVE_IN_ROOT); on failure it is closed.
func (b *Builder) Build(overlayFD int) (int, error) {
	w, ok := b.take()
	if !ok {
		unix.Close(overlayFD)
		return -1, fmt.Errorf("namespace builder is closed")
	}
	res := make(chan result, 1)
	w.jobs <- job{overlayFD: overlayFD, res: res}
	r := <-res
	if w.err != nil {
		r.err = fmt.Errorf("prepare a mount namespace: %w", w.err)
	}
	if r.err != nil {
		unix.Close(overlayFD)
		return -1, r.err
	}
	return r.fd, nil
}

// take returns a ready worker: one prepared ahead, or for a held builder's first Build
// one prepared now (a later Build starts the preparing ahead, and waits for its first).
// It reports false once the builder is closed.
func (b *Builder) take() (*worker, bool) {
	if b.first.Swap(false) {
		select {
		case <-b.stop:
			return nil, false
		default:
			return b.prepare(), true
		}
	}
	b.prepareAhead()
	w, ok := <-b.ready
	return w, ok
}

// Close stops the builder and lets its ready workers exit.
func (b *Builder) Close() {
	close(b.stop)
	<-b.done
	close(b.ready)
	for w := range b.ready {
		w.jobs <- job{overlayFD: -1}
	}
	unix.Close(b.baseNS)
}

// enter puts the calling (locked) thread into a private copy of the base namespace.
func enter(baseNS int) error {
	if err := unix.Unshare(unix.CLONE_FS); err != nil {
		return fmt.Errorf("unshare CLONE_FS: %w", err)
	}
	if err := unix.Setns(baseNS, unix.CLONE_NEWNS); err != nil {
		return fmt.Errorf("setns into the sandbox's base mount namespace: %w", err)
	}
	if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
		return fmt.Errorf("unshare CLONE_NEWNS: %w", err)
	}
	return nil
}

// enterFresh puts the calling (locked) thread into a namespace that fresh makes.
func enterFresh(fresh func() (int, error)) error {
	ns, err := fresh()
	if err != nil {
		return err
	}
	defer unix.Close(ns)
	if err := unix.Unshare(unix.CLONE_FS); err != nil {
		return fmt.Errorf("unshare CLONE_FS: %w", err)
	}
	if err := unix.Setns(ns, unix.CLONE_NEWNS); err != nil {
		return fmt.Errorf("setns into a copy of the sandbox's base mount namespace: %w", err)
	}
	return nil
}

// finish stacks the overlay on the namespace's root and mounts /dev, /dev/shm and
// /proc inside it. Precondition: the calling thread ran enter.
//
// No pivot_root: setns(CLONE_NEWNS) looks up the new root with LOOKUP_DOWN, so a
// process entering the namespace lands on the topmost mount stacked on "/", the
// overlay. Pivoting instead would cost a detach of the old root, and with it an
// expedited RCU grace period (0.1-0.3 ms here), on every checkpoint and restore. The
// base's tmpfs stays underneath, unreachable from the overlay; it holds nothing but
// mount points.
func finish(overlayFD int) (int, error) {
	// Clones of the base's /dev (with devpts) and /proc, taken before the overlay
	// covers them.
	dev, err := unix.OpenTree(unix.AT_FDCWD, devDir, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_RECURSIVE)
	if err != nil {
		return -1, fmt.Errorf("clone /dev: %w", err)
	}
	defer unix.Close(dev)
	proc, err := unix.OpenTree(unix.AT_FDCWD, procDir, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_RECURSIVE)
	if err != nil {
		return -1, fmt.Errorf("clone /proc: %w", err)
	}
	defer unix.Close(proc)
	// /dev/shm is the overlay's own directory so that it rolls back with the state.
	// Images are checked for these mount points when a sandbox is created (CheckImage).
	shm, err := unix.OpenTree(overlayFD, "dev/shm", unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
	if err != nil {
		return -1, fmt.Errorf("clone /dev/shm (does the image have it?): %w", err)
	}
	defer unix.Close(shm)
	if err := unix.MoveMount(overlayFD, "", unix.AT_FDCWD, "/", unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return -1, fmt.Errorf("attach overlay on /: %w", err)
	}
	for _, m := range []struct {
		fd   int
		path string
	}{{dev, "dev"}, {shm, "dev/shm"}, {proc, "proc"}} {
		if err := unix.MoveMount(m.fd, "", overlayFD, m.path, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
			return -1, fmt.Errorf("mount /%s: %w", m.path, err)
		}
	}
	hp, err := hostProc() // opened by NewBuilder: no open here, in the new namespace
	if err != nil {
		return -1, err
	}
	fd, err := unix.Openat(hp, "thread-self/ns/mnt", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("open the new namespace: %w", err)
	}
	return fd, nil
}

// CheckImage verifies that rootfs has the directories every state mounts onto.
func CheckImage(rootfs string) error {
	for _, d := range []string{devDir, procDir, shmDir} {
		var st unix.Stat_t
		if err := unix.Stat(rootfs+d, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFDIR {
			return fmt.Errorf("the image has no directory %s, which every sandbox mounts onto: re-import the image", d)
		}
	}
	return nil
}

// Inspect returns an fd on the root of the state namespace nsfd (O_PATH, its overlay's
// root) and the layer id of its overlay's upper, read from the namespace's own
// mountinfo: the line of the mount on "/", whose options name the upper as
// ".../layers/ID/diff" (overlay.Mount). A thread enters the namespace for this and is
// discarded; so the root is the namespace's, whatever root a process in it chose
// (chroot). Used by a daemon that adopts a running sandbox (sandbox.Adopt).
func Inspect(nsfd int) (root int, upper uint64, err error) {
	type result struct {
		root  int
		upper uint64
		err   error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread leaves the daemon's namespace
		r := result{root: -1}
		defer func() { ch <- r }()
		hp, err := hostProc()
		if err != nil {
			r.err = err
			return
		}
		if err := unix.Unshare(unix.CLONE_FS); err != nil {
			r.err = fmt.Errorf("unshare CLONE_FS: %w", err)
			return
		}
		if err := unix.Setns(nsfd, unix.CLONE_NEWNS); err != nil {
			r.err = fmt.Errorf("setns into the state's namespace: %w", err)
			return
		}
		fd, err := unix.Openat(hp, "thread-self/mountinfo", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			r.err = fmt.Errorf("open the state's mountinfo: %w", err)
			return
		}
		f := os.NewFile(uintptr(fd), "mountinfo")
		b, err := io.ReadAll(f)
		f.Close()
		if err != nil {
			r.err = fmt.Errorf("read the state's mountinfo: %w", err)
			return
		}
		if r.upper, r.err = rootUpper(b); r.err != nil {
			return
		}
		if r.root, err = unix.Open("/", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0); err != nil {
			r.err = fmt.Errorf("open the state's root: %w", err)
		}
	}()
	r := <-ch
	return r.root, r.upper, r.err
}

// upperRE finds an overlay's upper layer id in its mount options.
var upperRE = regexp.MustCompile(`(?:^|,)upperdir=[^,]*/layers/([0-9]+)/diff(?:,|$)`)

// rootUpper returns the upper layer id of the overlay mounted on "/" in mountinfo (the
// topmost: the last such line).
func rootUpper(mountinfo []byte) (uint64, error) {
	var opts string
	for _, line := range strings.Split(string(mountinfo), "\n") {
		pre, post, ok := strings.Cut(line, " - ")
		f := strings.Fields(pre)
		if !ok || len(f) < 5 || f[4] != "/" {
			continue
		}
		g := strings.Fields(post)
		if len(g) >= 3 && g[0] == "overlay" {
			opts = g[2]
		}
	}
	if opts == "" {
		return 0, fmt.Errorf("no overlay on / in the state's mountinfo")
	}
	m := upperRE.FindStringSubmatch(opts)
	if m == nil {
		return 0, fmt.Errorf("the overlay on / names no upper layer (%s)", opts)
	}
	return strconv.ParseUint(m[1], 10, 64)
}
