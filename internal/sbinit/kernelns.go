package sbinit

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// NSThread is one OS thread of the daemon that has entered a sandbox's IPC and UTS
// namespaces, where it reads and changes what the sandbox's processes share there and
// no file or process holds: System V IPC objects, POSIX message queues, the host and
// domain names. A call is a hand-off to that thread (~10 µs), not a round trip to init
// (0.2-0.3 ms), and init stays as small as it is.
//
// The thread runs the daemon's code only. It stays in the daemon's mount namespace, so
// the one path it opens, /proc/sysvipc/*, is the daemon's procfs (which answers for the
// opener's IPC namespace), never a path of the sandbox. POSIX message queues are read
// through a detached mount of the namespace's own mqueue instance (fsopen on the
// thread: the instance of the caller's IPC namespace), held as a directory fd: no path
// of the sandbox either. Everything else is a system call on an id or a name that the
// kernel hands out or the daemon recorded.
type NSThread struct {
	calls chan func()
	once  sync.Once
	mq    int // the namespace's mqueue root, open on the thread; -1 without CONFIG_POSIX_MQUEUE
}

// EnterNS starts a thread in the IPC and UTS namespaces of the process that pidfd
// refers to (the sandbox's init). The caller closes pidfd.
func EnterNS(pidfd int) (*NSThread, error) {
	t := &NSThread{calls: make(chan func())}
	errc := make(chan error, 1)
	go func() {
		// Never unlocked: the thread leaves the daemon's namespaces, so it ends with this
		// goroutine (Close) instead of going back to the runtime's pool.
		runtime.LockOSThread()
		if err := unix.Setns(pidfd, unix.CLONE_NEWIPC|unix.CLONE_NEWUTS); err != nil {
			errc <- fmt.Errorf("enter the sandbox's IPC and UTS namespaces: %w", err)
			return
		}
		var err error
		if t.mq, err = openMqueue(); err != nil {
			errc <- err
			return
		}
		errc <- nil
		for f := range t.calls {
			f()
		}
		if t.mq >= 0 {
			unix.Close(t.mq)
		}
	}()
	if err := <-errc; err != nil {
		return nil, err
	}
	return t, nil
}

// openMqueue opens the root of the calling thread's IPC namespace's mqueue instance
// (-1 when the kernel has no POSIX message queues).
func openMqueue() (int, error) {
	fs, err := unix.Fsopen("mqueue", unix.FSOPEN_CLOEXEC)
	if err == unix.ENODEV {
		return -1, nil
	}
	if err != nil {
		return -1, fmt.Errorf("fsopen mqueue: %w", err)
	}
	defer unix.Close(fs)
	if err := unix.FsconfigCreate(fs); err != nil {
		return -1, fmt.Errorf("mqueue: %w", err)
	}
	mnt, err := unix.Fsmount(fs, unix.FSMOUNT_CLOEXEC, unix.MOUNT_ATTR_NOEXEC|unix.MOUNT_ATTR_NOSUID|unix.MOUNT_ATTR_NODEV)
	if err != nil {
		return -1, fmt.Errorf("mount mqueue: %w", err)
	}
	defer unix.Close(mnt) // an O_PATH fd; the directory opened on it keeps the mount
	dir, err := unix.Openat(mnt, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("open mqueue root: %w", err)
	}
	return dir, nil
}

// do runs f on the thread and waits for it.
func (t *NSThread) do(f func()) {
	done := make(chan struct{})
	t.calls <- func() { f(); close(done) }
	<-done
}

// Close ends the thread. No call may follow.
func (t *NSThread) Close() { t.once.Do(func() { close(t.calls) }) }

// UTS is a UTS namespace's names.
type UTS struct{ Hostname, Domainname string }

// IPCObject is one System V IPC object or POSIX message queue of a namespace.
type IPCObject struct {
	Kind string // "message queue", "semaphore set", "shared memory segment", "POSIX message queue"
	ID   int    // System V
	Key  uint32 // System V
	Name string // POSIX
	Size string // what it holds: messages, semaphores, bytes (System V)
	k    int    // its index in sysvKinds; -1 for a POSIX message queue
}

func (o IPCObject) String() string {
	if o.k < 0 {
		return fmt.Sprintf("%s %q", o.Kind, "/"+o.Name)
	}
	return fmt.Sprintf("%s %d (key %#08x, %s)", o.Kind, o.ID, o.Key, o.Size)
}

// KernelState is what a sandbox's processes share in its IPC and UTS namespaces.
type KernelState struct {
	UTS UTS
	IPC []IPCObject
}

// sysvKinds are the three kinds of System V object, each with its ctl call and *_INFO
// command (linux/msg.h, sem.h, shm.h), and where that command's answer holds the count
// of objects in use: msginfo.msgpool, seminfo.semusz, shm_info.used_ids (ints).
var sysvKinds = []struct {
	kind, file string
	ctl        uintptr
	info       int
	count      int // byte offset of the count in the answer
}{
	{"message queue", "msg", unix.SYS_MSGCTL, 12, 0},         // MSG_INFO, msgpool
	{"semaphore set", "sem", unix.SYS_SEMCTL, 19, 7 * 4},     // SEM_INFO, semusz
	{"shared memory segment", "shm", unix.SYS_SHMCTL, 14, 0}, // SHM_INFO, used_ids
}

// inUse returns how many objects of kind k the thread's namespace holds, by *_INFO:
// one system call, no read of /proc. Precondition: on the thread.
func inUse(k int) (int, error) {
	var buf [128]byte // msginfo 32, seminfo 40, shm_info 48 bytes on x86-64
	kd := sysvKinds[k]
	var err unix.Errno
	if kd.ctl == unix.SYS_SEMCTL {
		// semctl(id, semnum, cmd, arg): the buffer is the fourth argument.
		_, _, err = unix.Syscall6(kd.ctl, 0, 0, uintptr(kd.info), uintptr(unsafe.Pointer(&buf[0])), 0, 0)
	} else {
		_, _, err = unix.Syscall(kd.ctl, 0, uintptr(kd.info), uintptr(unsafe.Pointer(&buf[0])))
	}
	if err != 0 {
		return 0, fmt.Errorf("%s info: %w", kd.file, err)
	}
	return int(*(*int32)(unsafe.Pointer(&buf[kd.count]))), nil
}

// State reads the namespaces' names and System V objects. Shared memory segments
// already removed (IPC_RMID) are left out: no key reaches them, they go with their
// last attachment, and whatever holds one attached is a process that a checkpoint
// refuses or ends (fastpath's eligibility) or a restore's memory holder (killed
// right after its restore).
func (t *NSThread) State() (st KernelState, err error) {
	t.do(func() {
		var u unix.Utsname
		if err = unix.Uname(&u); err != nil {
			return
		}
		st.UTS = UTS{unix.ByteSliceToString(u.Nodename[:]), unix.ByteSliceToString(u.Domainname[:])}
		st.IPC, err = t.listIPC(false)
	})
	return st, err
}

// Reset removes every System V object of the namespace and sets its names to u. It
// returns the objects it removed. Precondition: no process of the sandbox runs (a
// restore, between its kill and its processes' resumption).
func (t *NSThread) Reset(u UTS) (removed []IPCObject, err error) {
	if len(u.Hostname) > 64 || len(u.Domainname) > 64 {
		return nil, fmt.Errorf("names over 64 bytes: %q, %q", u.Hostname, u.Domainname)
	}
	t.do(func() {
		var cur unix.Utsname
		if err = unix.Uname(&cur); err != nil {
			return
		}
		if unix.ByteSliceToString(cur.Nodename[:]) != u.Hostname {
			if err = unix.Sethostname([]byte(u.Hostname)); err != nil {
				return
			}
		}
		if unix.ByteSliceToString(cur.Domainname[:]) != u.Domainname {
			if err = unix.Setdomainname([]byte(u.Domainname)); err != nil {
				return
			}
		}
		if removed, err = t.listIPC(true); err != nil {
			return
		}
		for _, o := range removed {
			if o.k < 0 {
				if e := unix.Unlinkat(t.mq, o.Name, 0); e != nil && e != unix.ENOENT {
					err = fmt.Errorf("remove %s: %w", o, e)
					return
				}
				continue
			}
			kd := sysvKinds[o.k]
			var e unix.Errno
			if kd.ctl == unix.SYS_SEMCTL {
				_, _, e = unix.Syscall6(kd.ctl, uintptr(o.ID), 0, unix.IPC_RMID, 0, 0, 0)
			} else {
				_, _, e = unix.Syscall(kd.ctl, uintptr(o.ID), unix.IPC_RMID, 0)
			}
			if e != 0 && e != unix.EINVAL && e != unix.EIDRM { // EINVAL, EIDRM: gone already
				err = fmt.Errorf("remove %s: %w", o, e)
				return
			}
		}
	})
	return removed, err
}

// listIPC lists the objects of the thread's namespace, reading /proc/sysvipc only for
// the kinds *_INFO counts (none, usually); with removed, shared memory segments already
// removed are listed too. Precondition: on the thread.
func (t *NSThread) listIPC(removed bool) ([]IPCObject, error) {
	out, err := t.listMqueues()
	if err != nil {
		return nil, err
	}
	for k, kind := range sysvKinds {
		n, err := inUse(k)
		if err != nil {
			return nil, err
		}
		if n == 0 {
			continue
		}
		// Opened on this thread: procfs's sysvipc files show the opener's namespace.
		b, err := os.ReadFile("/proc/sysvipc/" + kind.file)
		if err != nil {
			return nil, err
		}
		sc := bufio.NewScanner(bytes.NewReader(b))
		sc.Buffer(nil, 1<<20)
		sc.Scan() // the header
		for sc.Scan() {
			f := strings.Fields(sc.Text())
			if len(f) < 4 {
				continue
			}
			key, err1 := strconv.ParseInt(f[0], 10, 64)
			id, err2 := strconv.Atoi(f[1])
			mode, err3 := strconv.ParseUint(f[2], 8, 32)
			if err1 != nil || err2 != nil || err3 != nil {
				return nil, fmt.Errorf("/proc/sysvipc/%s: unexpected line %q", kind.file, sc.Text())
			}
			o := IPCObject{Kind: kind.kind, ID: id, Key: uint32(key), k: k}
			switch kind.file {
			case "msg": // key msqid perms cbytes qnum ...
				o.Size = f[4] + " messages, " + f[3] + " bytes"
			case "sem": // key semid perms nsems ...
				o.Size = f[3] + " semaphores"
			case "shm": // key shmid perms size cpid lpid nattch ...
				if mode&01000 != 0 && !removed { // SHM_DEST
					continue
				}
				o.Size = f[3] + " bytes, " + f[6] + " attached"
			}
			out = append(out, o)
		}
	}
	return out, nil
}

// listMqueues lists the namespace's POSIX message queues (a queue unlinked while open
// is gone from the list, as from mq_open's view). Precondition: on the thread.
func (t *NSThread) listMqueues() ([]IPCObject, error) {
	if t.mq < 0 {
		return nil, nil
	}
	if _, err := unix.Seek(t.mq, 0, 0); err != nil {
		return nil, fmt.Errorf("mqueue: %w", err)
	}
	var out []IPCObject
	buf := make([]byte, 4096)
	for {
		n, err := unix.ReadDirent(t.mq, buf)
		if err != nil {
			return nil, fmt.Errorf("mqueue: %w", err)
		}
		if n == 0 {
			return out, nil
		}
		var names []string
		_, _, names = unix.ParseDirent(buf[:n], -1, names)
		for _, name := range names {
			out = append(out, IPCObject{Kind: "POSIX message queue", Name: name, k: -1})
		}
	}
}
