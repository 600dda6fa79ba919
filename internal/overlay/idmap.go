package overlay

import (
	"errors"
	"fmt"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"

	_ "deltabox/internal/mainthread" // AsRoot may discard a thread (see there)
)

// IDMapped gives one sandbox its view of the store: an idmapped clone of the store's
// mount, whose files owned by id d on disk appear owned by host id Base+d, which the
// sandbox's user namespace shows as d again. Layers and images stay on disk with the
// ids they had (0 for root), shared by every sandbox whatever its range, and a layer
// of one sandbox restores into another. The alternative, shifting ids at import, would
// tie each layer to one range: a node could no longer be restored into a sandbox of
// another range, and an image would be copied per range.
//
// The clone is detached (open_tree OPEN_TREE_CLONE, then mount_setattr
// MOUNT_ATTR_IDMAP: 55 us with finding the mount's root, once per sandbox:
// BenchmarkNewIDMapped) and reached by path through its fd,
// /proc/self/fd/N/..., which is what overlayfs's layer options take. Nothing of it is
// attached anywhere, so nothing is left mounted if the daemon dies.
//
// Writes through an idmapped mount need the writer's fsuid and fsgid mapped in it,
// and overlayfs writes its upper with the credentials of the thread that created the
// mount: Mount creates overlays from a thread whose fsuid and fsgid are Base (root of
// the sandbox), with its effective capabilities raised again (changing the fsuid from
// 0 clears the file capabilities from the effective set). Without that the mount
// succeeds read-only, silently.
type IDMapped struct {
	// Base is the host id that the sandbox's root maps to (uid and gid alike).
	Base   uint32
	store  string // the root of the store's mount, as the daemon sees it
	tree   int    // the idmapped clone of the store's mount
	prefix string // /proc/self/fd/<tree>
	userns int    // the user namespace (a dup), for clones of other mounts

	mu sync.Mutex
	// +checklocks:mu
	others map[string]int // idmapped clones of other mounts (by their root) that hold layers
}

// NewIDMapped clones the mount that holds storeRoot, whole, idmapped through the user
// namespace usernsFD (whose map sends 0 to base). The caller closes it.
func NewIDMapped(storeRoot string, usernsFD int, base uint32) (*IDMapped, error) {
	top, err := mountRoot(storeRoot)
	if err != nil {
		return nil, err
	}
	t, err := clone(top, usernsFD)
	if err != nil {
		return nil, err
	}
	uns, err := unix.FcntlInt(uintptr(usernsFD), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		unix.Close(t)
		return nil, err
	}
	return &IDMapped{Base: base, store: top, tree: t, prefix: "/proc/self/fd/" + strconv.Itoa(t), userns: uns}, nil
}

// clone returns an idmapped clone of the mount whose root is top.
func clone(top string, userns int) (int, error) {
	t, err := unix.OpenTree(unix.AT_FDCWD, top, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
	if err != nil {
		return -1, fmt.Errorf("clone the mount %s for an idmapped view: %w", top, err)
	}
	attr := unix.MountAttr{Attr_set: unix.MOUNT_ATTR_IDMAP, Userns_fd: uint64(userns)}
	if err := unix.MountSetattr(t, "", unix.AT_EMPTY_PATH, &attr); err != nil {
		unix.Close(t)
		return -1, fmt.Errorf("idmap the mount %s (does the filesystem support idmapped mounts?): %w", top, err)
	}
	return t, nil
}

// mountRoot returns the root of the mount that holds dir (symbolic links resolved):
// the highest ancestor on the same mount.
func mountRoot(dir string) (string, error) {
	d, err := filepath.EvalSymlinks(dir)
	if err != nil {
		return "", err
	}
	id := func(p string) (uint64, error) {
		var st unix.Statx_t
		if err := unix.Statx(unix.AT_FDCWD, p, unix.AT_SYMLINK_NOFOLLOW, unix.STATX_MNT_ID, &st); err != nil {
			return 0, fmt.Errorf("statx %s: %w", p, err)
		}
		return st.Mnt_id, nil
	}
	mnt, err := id(d)
	if err != nil {
		return "", err
	}
	for d != "/" {
		up := filepath.Dir(d)
		m, err := id(up)
		if err != nil {
			return "", err
		}
		if m != mnt {
			break
		}
		d = up
	}
	return d, nil
}

// Close releases the clone (mounts made through it keep their own references).
func (m *IDMapped) Close() {
	if m != nil && m.tree >= 0 {
		unix.Close(m.tree)
		unix.Close(m.userns)
		m.tree = -1
		m.mu.Lock()
		for _, fd := range m.others {
			unix.Close(fd)
		}
		m.others = nil
		m.mu.Unlock()
	}
}

// path translates a path on the store's mount to the same path through the idmapped
// clone. p must have no symbolic link on its way (store.ImageRootfs resolves the one
// kind the store has).
func (m *IDMapped) path(p string) (string, error) {
	rel, err := filepath.Rel(m.store, p)
	if err == nil && rel != ".." && !strings.HasPrefix(rel, "../") {
		return m.prefix + "/" + rel, nil
	}
	// A layer on another mount (an image a test's store links to on the main store):
	// that mount gets an idmapped clone of its own, once.
	top, err := mountRoot(p)
	if err != nil {
		return "", fmt.Errorf("overlay: layer %s: %w", p, err)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	t, ok := m.others[top]
	if !ok {
		if t, err = clone(top, m.userns); err != nil {
			return "", err
		}
		if m.others == nil {
			m.others = map[string]int{}
		}
		m.others[top] = t
	}
	rel, err = filepath.Rel(top, p)
	if err != nil {
		return "", err
	}
	return "/proc/self/fd/" + strconv.Itoa(t) + "/" + rel, nil
}

// Mount is overlay.Mount with every layer seen through the idmapped clone, created as
// the sandbox's root (see IDMapped).
func (m *IDMapped) Mount(s Spec) (int, error) {
	t := s
	t.Lowers = make([]string, len(s.Lowers))
	var err error
	for i, l := range s.Lowers {
		if t.Lowers[i], err = m.path(l); err != nil {
			return -1, err
		}
	}
	if s.Upper != "" {
		if t.Upper, err = m.path(s.Upper); err != nil {
			return -1, err
		}
		if t.Work, err = m.path(s.Work); err != nil {
			return -1, err
		}
	}
	fd := -1
	err = m.AsRoot(func() error {
		var err error
		fd, err = Mount(t)
		return err
	})
	return fd, err
}

// AsRoot runs fn on a thread whose fsuid and fsgid are the sandbox's root (Base) while
// fn runs, the daemon's capabilities kept: files fn creates through the sandbox's
// overlay belong to root inside it. fn runs on a goroutine of its own, locked to its
// thread, which the caller waits for, so that a thread that cannot be put back (root
// setting its own fsuid back) is discarded: that goroutine exits locked and Go ends the
// thread with it (package mainthread keeps the main thread out of this), rather than
// give the runtime, or the caller's next work, a thread with the sandbox's ids. The
// five credential changes and the hand-off cost 18 us (BenchmarkAsRoot; inline on the
// caller's thread, with a panic for that failure, it was 13). A panic in fn is raised
// again in the caller, after the thread is put back.
func (m *IDMapped) AsRoot(fn func() error) error {
	type result struct {
		err error
		pv  any // fn's panic, raised again on the caller's goroutine
	}
	res := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		var r result
		caps, err := setFSIDs(m.Base)
		if err == nil {
			func() {
				defer func() { r.pv = recover() }()
				err = fn()
			}()
		}
		r.err = err
		if back := setBack(caps); back != nil {
			threadsDiscarded.Add(1)
			r.err = errors.Join(r.err, fmt.Errorf("overlay: the thread could not be given back the daemon's ids (discarded): %w", back))
			res <- r
			return // exits locked
		}
		runtime.UnlockOSThread()
		res <- r
	}()
	r := <-res
	if r.pv != nil {
		panic(r.pv)
	}
	return r.err
}

// setBack gives the calling thread fsuid and fsgid 0 again and its capabilities caps
// (nil: those setFSIDs(0) raises, after a setFSIDs that failed).
func setBack(caps *[2]unix.CapUserData) error {
	if _, err := setFSIDs(0); err != nil {
		return err
	}
	if caps == nil {
		return nil
	}
	return raise(caps)
}

// threadsDiscarded counts the threads AsRoot could not give back (tests check it).
var threadsDiscarded atomic.Int32

// setFSIDs sets the calling thread's fsuid and fsgid (raw syscalls: per thread, unlike
// Go's syscall.Setfsuid which would apply to all) and raises its effective capabilities
// to its permitted ones again. It returns the capabilities as they were.
func setFSIDs(id uint32) (*[2]unix.CapUserData, error) {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var caps [2]unix.CapUserData
	if err := unix.Capget(&hdr, &caps[0]); err != nil {
		return nil, fmt.Errorf("capget: %w", err)
	}
	unix.RawSyscall(unix.SYS_SETFSUID, uintptr(id), 0, 0)
	unix.RawSyscall(unix.SYS_SETFSGID, uintptr(id), 0, 0)
	// setfsuid returns the old id whatever happens: read the new one back (-1 changes
	// nothing and returns the current one).
	if got, _, _ := unix.RawSyscall(unix.SYS_SETFSUID, ^uintptr(0), 0, 0); uint32(got) != id {
		return nil, fmt.Errorf("setfsuid %d: still %d", id, got)
	}
	if err := raise(&caps); err != nil {
		return nil, err
	}
	return &caps, nil
}

// raise sets the calling thread's effective capabilities to caps' permitted ones.
func raise(caps *[2]unix.CapUserData) error {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	c := *caps
	c[0].Effective, c[1].Effective = c[0].Permitted, c[1].Permitted
	if err := unix.Capset(&hdr, &c[0]); err != nil {
		return fmt.Errorf("capset: %w", err)
	}
	return nil
}
