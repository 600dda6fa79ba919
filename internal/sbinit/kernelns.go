package sbinit

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// NS is the daemon's handle on a sandbox's IPC and UTS namespaces, where it reads and
// resets what the sandbox's processes share there and no file or process holds: System
// V IPC objects, POSIX message queues, the host and domain names.
//
// Each call runs on the caller's thread, which enters the namespaces for the call alone
// (do): a call costs 10-50 µs here, mostly the two setns (one each way: a pidfd names
// both namespaces, where nsfs fds took two calls each way, 5 µs more). A round trip to
// init would cost 0.2-0.3 ms, and init stays as small as it is.
//
// The thread runs the daemon's code only, and stays in the daemon's mount namespace, so
// the one path it opens, /proc/sysvipc/*, is the daemon's procfs (which answers for the
// opener's IPC namespace), never a path of the sandbox. POSIX message queues are read
// through a detached mount of the namespace's own mqueue instance (fsopen in the
// namespace), held as a directory fd: no path of the sandbox either. Everything else is
// a system call on an id or a name that the kernel hands out or the daemon recorded.
type NS struct {
	init, self int // pidfds: the sandbox's init, the daemon (setns takes both namespaces at once)
	mq         int // the namespace's mqueue root; -1 without CONFIG_POSIX_MQUEUE
}

// OpenNS opens the IPC and UTS namespaces of pid (the sandbox's init, a child of the
// daemon: the caller checks that it was not reaped before this returned, so that the
// PID was not reused).
func OpenNS(pid int) (_ *NS, err error) {
	n := &NS{init: -1, self: -1, mq: -1}
	defer func() {
		if err != nil {
			n.Close()
		}
	}()
	if n.init, err = unix.PidfdOpen(pid, 0); err != nil {
		return nil, fmt.Errorf("pidfd of the sandbox's init: %w", err)
	}
	// The daemon's thread group leader: the main thread never leaves its namespaces.
	if n.self, err = unix.PidfdOpen(os.Getpid(), 0); err != nil {
		return nil, fmt.Errorf("pidfd of the daemon: %w", err)
	}
	var mqErr error
	if err = n.do(func() { n.mq, mqErr = openMqueue() }); err == nil {
		err = mqErr
	}
	if err != nil {
		return nil, err
	}
	return n, nil
}

// Close releases the namespaces. No call may follow.
func (n *NS) Close() {
	for _, fd := range []int{n.init, n.self, n.mq} {
		if fd >= 0 {
			unix.Close(fd)
		}
	}
}

// do runs f on the caller's thread, locked to its goroutine, after it entered the
// sandbox's namespaces, and takes it back to the daemon's before unlocking it. Inline,
// because a hand-off to a goroutine of its own cost 33 us per call at p50 on this
// 2-core VM (bench fs, seize and publish phases), a thread parked in the namespaces
// 0.1 ms and more on a busy machine (wake-ups), and the calls themselves 10-50 us.
// A thread that cannot go back to the daemon's namespaces (setns to the daemon's own
// fails only without CAP_SYS_ADMIN, which the daemon has, or out of memory: retried
// for 0.1 s) is never given back to the runtime, where it would run any goroutine in
// the sandbox's namespaces: it stays locked to the caller's goroutine, and Go ends it
// when that goroutine exits (package mainthread keeps the main thread out of this).
// Until then only the caller runs on it, the daemon's own code, which uses neither
// System V IPC, message queues nor host names. A panic in f goes on after the thread
// went back.
func (n *NS) do(f func()) (err error) {
	const both = unix.CLONE_NEWIPC | unix.CLONE_NEWUTS
	runtime.LockOSThread()
	if err := unix.Setns(n.init, both); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("enter the sandbox's IPC and UTS namespaces: %w", err)
	}
	defer func() {
		var back error
		for try := 0; try < 100; try++ {
			if back = unix.Setns(n.self, both); back == nil {
				runtime.UnlockOSThread()
				return
			}
			time.Sleep(time.Millisecond)
		}
		err = errors.Join(err, fmt.Errorf("sbinit: a thread of the daemon could not go back to the daemon's IPC and UTS namespaces from a sandbox's (it ends with its goroutine): %w", back))
	}()
	f()
	return nil
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
func (n *NS) State() (st KernelState, err error) {
	e := n.do(func() {
		var u unix.Utsname
		if err = unix.Uname(&u); err != nil {
			return
		}
		st.UTS = UTS{unix.ByteSliceToString(u.Nodename[:]), unix.ByteSliceToString(u.Domainname[:])}
		st.IPC, err = n.listIPC(false)
	})
	if e != nil {
		return st, e
	}
	return st, err
}

// Reset removes every System V object of the namespace and sets its names to u. It
// returns the objects it removed. Precondition: no process of the sandbox runs (a
// restore, between its kill and its processes' resumption).
func (n *NS) Reset(u UTS) (removed []IPCObject, err error) {
	if len(u.Hostname) > 64 || len(u.Domainname) > 64 {
		return nil, fmt.Errorf("names over 64 bytes: %q, %q", u.Hostname, u.Domainname)
	}
	e := n.do(func() {
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
		if removed, err = n.listIPC(true); err != nil {
			return
		}
		for _, o := range removed {
			if o.k < 0 {
				if e := unix.Unlinkat(n.mq, o.Name, 0); e != nil && e != unix.ENOENT {
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
	if e != nil {
		return nil, e
	}
	return removed, err
}

// listIPC lists the objects of the thread's namespace, reading /proc/sysvipc only for
// the kinds *_INFO counts (none, usually); with removed, shared memory segments already
// removed are listed too. Precondition: on the thread.
func (n *NS) listIPC(removed bool) ([]IPCObject, error) {
	out, err := n.listMqueues()
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
func (n *NS) listMqueues() ([]IPCObject, error) {
	if n.mq < 0 {
		return nil, nil
	}
	// The root's size counts its entries (mqueue: 20 per queue, 40 empty): one fstat
	// instead of a seek and two reads when there is none.
	var st unix.Stat_t
	if err := unix.Fstat(n.mq, &st); err != nil {
		return nil, fmt.Errorf("mqueue: %w", err)
	}
	if st.Size <= 40 {
		return nil, nil
	}
	if _, err := unix.Seek(n.mq, 0, 0); err != nil {
		return nil, fmt.Errorf("mqueue: %w", err)
	}
	var out []IPCObject
	buf := make([]byte, 4096)
	for {
		k, err := unix.ReadDirent(n.mq, buf)
		if err != nil {
			return nil, fmt.Errorf("mqueue: %w", err)
		}
		if k == 0 {
			return out, nil
		}
		var names []string
		_, _, names = unix.ParseDirent(buf[:k], -1, names)
		for _, name := range names {
			out = append(out, IPCObject{Kind: "POSIX message queue", Name: name, k: -1})
		}
	}
}
