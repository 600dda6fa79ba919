package sbinit

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/landlock"
	_ "deltabox/internal/mainthread" // the main thread is never discarded (see there)
)

// InitArg is os.Args[1] of the re-executed binary when it is to run as a sandbox's init.
const InitArg = "__sandbox-init"

// Config is what the daemon tells init, as JSON in os.Args[2].
type Config struct {
	ID       string `json:"id"`
	Hostname string `json:"hostname"`
	// TaskFDs are fds (inherited) on the "tasks" files of the sandbox's v1 cgroups:
	// each spawn thread writes "0" into them before it forks (StartOptions.CgroupTasks).
	TaskFDs []int `json:"task_fds,omitempty"`
	// PidFloor: the sandbox's PIDs start above it (raisePidFloor), so that no process
	// or thread of a sandbox started afresh takes a PID a restore must give back.
	PidFloor int `json:"pid_floor,omitempty"`
	// DiskQuota is the sandbox's disk quota in bytes (0: none), which no call of its
	// processes can pass at once: a fallocate(2) longer than it fails with EDQUOT
	// (seccomp.go), and no file grows past it (RLIMIT_FSIZE: a write or truncate past it
	// fails with EFBIG, and SIGXFSZ ends a process that does not handle it).
	DiskQuota int64 `json:"disk_quota,omitempty"`
	// Nice is the init's nice until the daemon resets it (nice.go): a background spare's.
	Nice int `json:"nice,omitempty"`
}

// ctlFD is the init's end of the control socketpair (ExtraFiles[0]).
const ctlFD = 3

// taskFDs are Config.TaskFDs: the v1 cgroups (limits) each spawned process starts in.
var taskFDs []int

// Main runs the init. It does not return.
func Main(arg string) {
	var cfg Config
	if err := json.Unmarshal([]byte(arg), &cfg); err != nil {
		fatal("bad config: %v", err)
	}
	if os.Getpid() != 1 {
		fatal("init must be PID 1 of a new PID namespace (got pid %d)", os.Getpid())
	}
	if cfg.Nice != 0 {
		if err := niceSelf(cfg.Nice); err != nil {
			fatal("%v", err)
		}
	}
	// Not dumpable: ptrace, /proc/1/mem, /proc/1/fd and pidfd_getfd of init then need
	// CAP_SYS_PTRACE, which no process of the sandbox has (the spawn thread drops it),
	// though they share init's uid. Init's control socket, through which exits are
	// reported, is out of their reach; so is init's memory.
	if err := unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0); err != nil {
		fatal("prctl(PR_SET_DUMPABLE, 0): %v", err)
	}
	// Nothing init holds may reach the sandbox's processes: not the control socket
	// (a process holding it could command init), not what the daemon inherited.
	CloseOnExecFrom(3)
	for _, fd := range cfg.TaskFDs {
		unix.CloseOnExec(fd) // commands must not inherit them
	}
	taskFDs = cfg.TaskFDs
	// Reap from the start: SIGCHLD must not be lost between setup and serve.
	sigc := make(chan os.Signal, 16)
	signal.Notify(sigc, unix.SIGCHLD)
	// Ignored dispositions survive exec: a daemon started from a script in the
	// background has SIGINT and SIGQUIT ignored, and so would every command of the
	// sandbox (^C in a session would do nothing). Handling them here makes exec reset
	// them to the default in every child. As PID 1 of its namespace, init receives only
	// signals it handles, and drops these.
	drop := make(chan os.Signal, 4)
	signal.Notify(drop, unix.SIGINT, unix.SIGQUIT, unix.SIGTERM, unix.SIGHUP, unix.SIGPIPE, unix.SIGTSTP, unix.SIGTTIN, unix.SIGTTOU)
	go func() {
		for range drop {
		}
	}()
	if err := setupRoot(&cfg); err != nil {
		send(ctlFD, &Message{Op: "ready", Err: err.Error()}, nil)
		fatal("setup: %v", err)
	}
	fallocateMax = cfg.DiskQuota
	if q := uint64(cfg.DiskQuota); q > 0 {
		// Init's own limit, which every process of the sandbox inherits (CRIU restores a
		// process's own, templates are forked with theirs). The kernel has no XFS quotas
		// here (state/diskquota.go): this is what stops a runaway file in the write
		// that passes the quota, where the daemon's watcher stops it a pass later (a
		// `>>` loop: 71 MiB written at a 64 MiB quota). Without CAP_SYS_RESOURCE
		// (dropCapabilities) no process of the sandbox can raise it.
		if err := unix.Setrlimit(unix.RLIMIT_FSIZE, &unix.Rlimit{Cur: q, Max: q}); err != nil {
			fatal("setrlimit(RLIMIT_FSIZE, %d): %v", q, err)
		}
	}
	if _, err := filter(); err != nil { // a bad table fails the sandbox's start, not each spawn
		send(ctlFD, &Message{Op: "ready", Err: err.Error()}, nil)
		fatal("setup: %v", err)
	}
	if err := landlock.Check(); err != nil { // each command's domain: spawn
		send(ctlFD, &Message{Op: "ready", Err: err.Error()}, nil)
		fatal("setup: %v", err)
	}
	spare, err := newSpare()
	if err != nil {
		send(ctlFD, &Message{Op: "ready", Err: err.Error()}, nil)
		fatal("setup: %v", err)
	}
	s := &server{fd: ctlFD, spare: spare, kept: map[string]kept{}}
	go s.reapLoop(sigc)
	if err := s.send(&Message{Op: "ready"}, nil); err != nil {
		fatal("ready: %v", err)
	}
	// The main goroutine keeps the main thread (package mainthread) and parks for good:
	// serving from it, every wake-up after a wait (a spawn's answer) would need that one
	// thread handed the CPU.
	go s.serve()
	select {}
}

// CloseOnExecFrom marks every open fd >= from close-on-exec.
func CloseOnExecFrom(from int) {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return
	}
	for _, e := range ents {
		if fd, err := strconv.Atoi(e.Name()); err == nil && fd >= from {
			unix.CloseOnExec(fd)
		}
	}
}

func fatal(f string, a ...any) {
	fmt.Fprintf(os.Stderr, "deltabox-init: "+f+"\n", a...)
	os.Exit(1)
}

// setupRoot builds the base mount namespace: a tmpfs root with /proc and a minimal /dev
// (each state's overlay is stacked on it: mountns), then pivots into it so nothing of
// the host stays visible. Init starts in the empty directory to mount it on (see
// startIn); paths are relative: inside its user namespace init may not search the
// store's directories by path.
func setupRoot(cfg *Config) error {
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make / private: %w", err)
	}
	if cfg.Hostname != "" {
		if err := unix.Sethostname([]byte(cfg.Hostname)); err != nil {
			return fmt.Errorf("sethostname: %w", err)
		}
	}
	fsfd, err := unix.Fsopen("tmpfs", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return fmt.Errorf("fsopen tmpfs: %w", err)
	}
	defer unix.Close(fsfd)
	for _, kv := range [][2]string{{"mode", "0755"}, {"size", "1m"}} {
		if err := unix.FsconfigSetString(fsfd, kv[0], kv[1]); err != nil {
			return fmt.Errorf("tmpfs root option %s: %w", kv[0], err)
		}
	}
	if err := unix.FsconfigCreate(fsfd); err != nil {
		return fmt.Errorf("create the tmpfs root: %w", err)
	}
	mfd, err := unix.Fsmount(fsfd, unix.FSMOUNT_CLOEXEC, unix.MOUNT_ATTR_NOSUID|unix.MOUNT_ATTR_NODEV)
	if err != nil {
		return fmt.Errorf("fsmount the tmpfs root: %w", err)
	}
	defer unix.Close(mfd)
	if err := unix.MoveMount(mfd, "", unix.AT_FDCWD, ".", unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("attach the tmpfs root: %w", err)
	}
	if err := unix.Fchdir(mfd); err != nil {
		return err
	}
	for _, d := range []string{"proc", "dev"} {
		if err := os.Mkdir(d, 0o755); err != nil {
			return err
		}
	}
	if err := unix.Mount("proc", "proc", "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("mount proc: %w", err)
	}
	if cfg.PidFloor > 0 {
		if err := raisePidFloor("proc", cfg.PidFloor); err != nil {
			return fmt.Errorf("raise the next PID above %d: %w", cfg.PidFloor, err)
		}
	}
	if err := setupDev("dev"); err != nil {
		return err
	}
	if err := MaskProc("proc", "dev/null"); err != nil {
		return err
	}
	if err := loopbackUp(); err != nil {
		return err
	}
	if err := unix.PivotRoot(".", "."); err != nil {
		return fmt.Errorf("pivot_root: %w", err)
	}
	if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("detach host root: %w", err)
	}
	if err := unix.Chdir("/"); err != nil {
		return err
	}
	if err := unix.Mount("", "/", "", unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV, "mode=0755,size=1m"); err != nil {
		return fmt.Errorf("remount root read-only: %w", err)
	}
	return nil
}

// setupDev makes a minimal, read-only /dev: the harmless character devices, a private
// devpts instance (sessions' terminals), and the /dev/shm mount point that each state
// fills with the overlay's own /dev/shm directory.
func setupDev(dev string) error {
	if err := unix.Mount("tmpfs", dev, "tmpfs", unix.MS_NOSUID, "mode=0755,size=64k"); err != nil {
		return fmt.Errorf("mount /dev: %w", err)
	}
	// The devices are the host's own nodes, bound one by one (called before the pivot,
	// while the host's /dev is in view): inside a user namespace mknod is refused, and
	// a filesystem mounted there is nodev whatever its nodes. Each bind is one more mount
	// that every state namespace copies (mountns); the binds are what the sandbox can
	// open of the host's devices, and nothing else.
	for _, name := range []string{"null", "zero", "full", "random", "urandom", "tty"} {
		p := filepath.Join(dev, name)
		f, err := os.OpenFile(p, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o666)
		if err != nil {
			return err
		}
		f.Close()
		if err := unix.Mount("/dev/"+name, p, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("bind the host's /dev/%s: %w", name, err)
		}
		// Read-only: the node is the host's, and touch or chmod through a writable bind
		// would change the host's /dev/null. (Reading and writing the device is not a
		// write to the filesystem.) The flags the host's mount has are kept: inside a
		// user namespace a remount may add flags, never drop those it inherited.
		var st unix.Statfs_t
		if err := unix.Statfs(p, &st); err != nil {
			return err
		}
		keep := uintptr(0)
		for _, f := range [][2]uintptr{{unix.ST_NODEV, unix.MS_NODEV}, {unix.ST_NOATIME, unix.MS_NOATIME}, {unix.ST_NODIRATIME, unix.MS_NODIRATIME}, {unix.ST_RELATIME, unix.MS_RELATIME}} {
			if uintptr(st.Flags)&f[0] != 0 {
				keep |= f[1]
			}
		}
		if err := unix.Mount("", p, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NOEXEC|keep, ""); err != nil {
			return fmt.Errorf("make the bind of /dev/%s read-only: %w", name, err)
		}
	}
	for _, d := range []string{"pts", "shm"} {
		if err := os.Mkdir(filepath.Join(dev, d), 0o755); err != nil {
			return err
		}
	}
	if err := unix.Mount("devpts", filepath.Join(dev, "pts"), "devpts", unix.MS_NOSUID|unix.MS_NOEXEC,
		"newinstance,ptmxmode=0666,mode=0620,gid=5"); err != nil {
		return fmt.Errorf("mount devpts: %w", err)
	}
	links := [][2]string{
		{"pts/ptmx", "ptmx"}, {"/proc/self/fd", "fd"},
		{"/proc/self/fd/0", "stdin"}, {"/proc/self/fd/1", "stdout"}, {"/proc/self/fd/2", "stderr"},
	}
	for _, l := range links {
		if err := os.Symlink(l[0], filepath.Join(dev, l[1])); err != nil {
			return err
		}
	}
	// Read-only from here on (devices are still read and written, and /dev/pts and
	// /dev/shm are mounts of their own): every state of the sandbox mounts a clone of
	// this one tmpfs, so a file made in /dev would be in all of them and roll back with
	// none. Making a file there fails with EROFS instead. (A /dev of each state's own
	// costs 50-110 us more per mount, measured: docs/design/isolation.md.)
	if err := unix.Mount("", dev, "", unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_NOSUID, "mode=0755,size=64k"); err != nil {
		return fmt.Errorf("remount /dev read-only: %w", err)
	}
	return nil
}

// maskedProc are the files and directories of /proc that Docker masks (its default
// MaskedPaths): the kernel's memory (kcore), the host's keys, and what tells of other
// processes' timing or the hardware. A file is covered by /dev/null, a directory by an
// empty read-only tmpfs. Those a kernel lacks (this one has no kcore) are skipped.
var maskedProc = []string{"kcore", "keys", "latency_stats", "timer_list", "timer_stats", "sched_debug",
	"acpi", "asound", "scsi"}

// readOnlyProc are read-only as in Docker (its ReadonlyPaths): sysctls (core_pattern
// runs a program as host root), sysrq-trigger, and the bus, fs and irq knobs.
var readOnlyProc = []string{"bus", "fs", "irq", "sys", "sysrq-trigger"}

// MaskProc mounts the masks on the base namespace's /proc (null: a /dev/null to bind
// onto files). They are mounts under it, so every state's namespace, which clones /proc
// recursively (mountns), carries them, and the fast path sees them as the state's own
// (they are init's too); the sandbox cannot take them off: umount and the mount calls
// are filtered (seccomp.go). Cost: 10-15 us more per state build, for the clone of
// these mounts (mountns BenchmarkBuild).
func MaskProc(proc, null string) error {
	for _, name := range maskedProc {
		p := filepath.Join(proc, name)
		fi, err := os.Stat(p)
		if err != nil {
			continue // not in this kernel
		}
		if fi.IsDir() {
			err = unix.Mount("tmpfs", p, "tmpfs", unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "size=4k,mode=0555")
		} else {
			err = unix.Mount(null, p, "", unix.MS_BIND, "")
		}
		if err != nil {
			return fmt.Errorf("mask /proc/%s: %w", name, err)
		}
	}
	for _, name := range readOnlyProc {
		p := filepath.Join(proc, name)
		if _, err := os.Stat(p); err != nil {
			continue
		}
		if err := unix.Mount(p, p, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
			return fmt.Errorf("bind /proc/%s: %w", name, err)
		}
		if err := unix.Mount("", p, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
			return fmt.Errorf("make /proc/%s read-only: %w", name, err)
		}
	}
	return nil
}

// sandboxCaps is the bounding set of every process of the sandbox: Docker's default
// set, less CAP_MKNOD, plus CAP_SYS_ADMIN.
//
//   - CAP_MKNOD: /dev is read-only and holds what the sandbox needs, overlays are nodev
//     (a node in a layer cannot be opened), and a block device node was the way to the
//     store's loop devices (every sandbox's layers). FIFOs and sockets need no
//     capability. Docker keeps it behind its device cgroup, which DeltaBox has not.
//   - CAP_SYS_ADMIN: the fast path's injected calls run with the tracee's credentials:
//     setns into a state's mount namespace (CAP_SYS_ADMIN and CAP_SYS_CHROOT), clone3
//     with set_tid (CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE), TIOCSCTTY taking a session's
//     terminal back. The rest of what it grants is behind the seccomp filter (mount and
//     the new mount API, setns, unshare, bpf, perf, swapon, quotactl, fanotify, RT I/O
//     priority, keyrings: seccomp.go), so the sandbox's own code keeps what Docker's set
//     gives plus sethostname in its own UTS namespace (the node records it), trusted.*
//     xattrs on its own overlay (overlayfs escapes them), and exceeding RLIMIT_NPROC (the
//     pids cgroup still bounds it).
//
// Dropped, among others: CAP_SYS_PTRACE (gdb and strace on the sandbox's own processes
// need none: same uid and capabilities), CAP_DAC_READ_SEARCH (open_by_handle_at),
// CAP_SYS_MODULE, CAP_SYS_RAWIO, CAP_SYS_TIME, CAP_SYS_BOOT, CAP_NET_ADMIN,
// CAP_SYS_RESOURCE, CAP_BPF, CAP_PERFMON, CAP_SYSLOG (kallsyms shows zeros), CAP_MAC_*,
// CAP_AUDIT_CONTROL, CAP_IPC_LOCK, CAP_IPC_OWNER, CAP_SYS_NICE, CAP_LEASE,
// CAP_CHECKPOINT_RESTORE, CAP_WAKE_ALARM, CAP_BLOCK_SUSPEND, CAP_SYS_PACCT,
// CAP_SYS_TTY_CONFIG, and CAP_LINUX_IMMUTABLE: a checkpoint cannot carry chattr +i and +a
// (overlayfs keeps them of an upper file in trusted.overlay.protattr, which it reads on
// upper files only, so they would vanish when the layer is frozen).
var sandboxCaps = []int{
	unix.CAP_CHOWN, unix.CAP_DAC_OVERRIDE, unix.CAP_FSETID, unix.CAP_FOWNER, unix.CAP_SETGID,
	unix.CAP_SETUID, unix.CAP_SETFCAP, unix.CAP_SETPCAP, unix.CAP_NET_BIND_SERVICE, unix.CAP_NET_RAW,
	unix.CAP_SYS_CHROOT, unix.CAP_KILL, unix.CAP_AUDIT_WRITE, unix.CAP_SYS_ADMIN,
}

// dropCapabilities bounds the calling thread to sandboxCaps: the bounding set (exec
// gives a root process exactly its bounding set, and a setuid program no more), the
// permitted and effective sets, an empty inheritable set (exec adds it to a root
// process's capabilities, bounding set or not) and no ambient ones. Capabilities are
// per thread: each spawning thread (locked, then discarded) calls this before it forks.
func dropCapabilities() error {
	var keep uint64
	for _, c := range sandboxCaps {
		keep |= 1 << c
	}
	for c := 0; c < 64; c++ {
		if keep&(1<<c) != 0 {
			continue
		}
		if err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0); err == unix.EINVAL {
			break // past the kernel's last capability
		} else if err != nil {
			return fmt.Errorf("drop capability %d from the bounding set: %w", c, err)
		}
	}
	return setCaps(keep)
}

// setCaps sets the calling thread's permitted and effective sets to what it has of
// keep, its inheritable set to none, and clears its ambient set.
func setCaps(keep uint64) error {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capget: %w", err)
	}
	for i := range data {
		k := uint32(keep >> (32 * i))
		data[i].Permitted &= k
		data[i].Effective &= k
		data[i].Inheritable = 0
	}
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capset: %w", err)
	}
	if err := unix.Prctl(unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0); err != nil {
		return fmt.Errorf("clear ambient capabilities: %w", err)
	}
	return nil
}

// loopbackUp brings up lo in the sandbox's network namespace: the only interface it has.
func loopbackUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("socket: %w", err)
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return fmt.Errorf("get lo flags: %w", err)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP | unix.IFF_RUNNING)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("bring lo up: %w", err)
	}
	return nil
}

// server is init's request loop.
//
// Lock order: reapMu is taken by the reaper and by spawn/killall; sendMu is only taken
// inside send. spawn holds reapMu from fork to its reply, so a child's exit event is
// always sent after the reply that names its pid.
//
// fd, spare, orphaned, backlog and dropped are guarded by sendMu (serve, the only
// reader of fd, changes it under sendMu); kept is serve's alone.
type server struct {
	fd int // the control socket
	// +checklocks:sendMu
	spare int // init's end of the spare socket (restart.go); -1 while it serves as fd
	// +checklocks:sendMu
	orphaned bool
	backlog  []*Message // exit events queued while orphaned
	dropped  int        // exit events dropped from a full backlog
	kept     map[string]kept
	sendMu   sync.Mutex
	reapMu   sync.Mutex
}

// send sends m on the control socket. Exit events that cannot go (no daemon) are queued
// for the next one.
func (s *server) send(m *Message, fds []int) error {
	s.sendMu.Lock()
	defer s.sendMu.Unlock()
	if s.orphaned {
		if m.Op == "exit" {
			s.queueLocked(m)
		}
		return fmt.Errorf("no daemon connected")
	}
	err := send(s.fd, m, fds)
	if err != nil && m.Op == "exit" {
		s.queueLocked(m)
	}
	return err
}

func (s *server) reapLoop(sigc <-chan os.Signal) {
	for range sigc {
		s.reapMu.Lock()
		s.reap(false)
		s.reapMu.Unlock()
	}
}

// reap collects exited children and reports each; with block it waits until none is
// left. Returns how many it reaped. Precondition: reapMu held.
func (s *server) reap(block bool) int {
	n := 0
	for {
		var ws unix.WaitStatus
		opts := unix.WNOHANG
		if block {
			opts = 0
		}
		pid, err := unix.Wait4(-1, &ws, opts|unix.WALL, nil)
		if err == unix.EINTR {
			continue
		}
		if err != nil || pid <= 0 {
			return n
		}
		n++
		s.send(&Message{Op: "exit", Pid: pid, Status: int(ws)}, nil)
	}
}

func (s *server) serve() {
	buf := newBuf()
	oob := make([]byte, unix.CmsgSpace(8*4))
	for {
		m, fds, err := recv(s.fd, buf, oob)
		if err != nil {
			if errors.Is(err, unix.EINTR) {
				continue
			}
			// The daemon is gone: wait for the next one on the spare (restart.go).
			fmt.Fprintf(os.Stderr, "deltabox-init: control socket: %v; waiting for a daemon\n", err)
			s.orphan()
			continue
		}
		reply := &Message{ID: m.ID}
		switch m.Op {
		case "hello":
			closeAll(fds)
			s.hello(m)
			continue
		case "keep":
			if err := s.keep(m, fds); err != nil {
				reply.Err = err.Error()
				closeAll(fds)
			}
			s.send(reply, nil)
			continue
		case "forget":
			s.forget(m.Key)
		case "kept":
			closeAll(fds)
			s.send(reply, s.keptReply(reply))
			continue
		case "spawn":
			s.reapMu.Lock()
			pid, pidfd, err := spawn(m, fds)
			reply.Pid = pid
			var out []int
			if err != nil {
				reply.Err = err.Error()
			} else if pidfd >= 0 {
				out = []int{pidfd}
			}
			s.send(reply, out)
			s.reapMu.Unlock()
			if pidfd >= 0 {
				unix.Close(pidfd)
			}
			closeAll(fds)
			continue
		case "signal":
			target := m.Pid
			if m.Group {
				target = -m.Pid
			}
			if err := unix.Kill(target, syscall.Signal(m.Sig)); err != nil && err != unix.ESRCH {
				reply.Err = err.Error()
			}
		case "killall":
			s.reapMu.Lock()
			if len(m.Keep) == 0 {
				// kill(-1) from a PID namespace's init reaches every process of the
				// namespace but init itself.
				if err := unix.Kill(-1, unix.SIGKILL); err != nil && err != unix.ESRCH {
					reply.Err = err.Error()
				}
				reply.Count = s.reap(true)
			} else {
				n, err := s.killAllBut(m.Keep)
				reply.Count = n
				if err != nil {
					reply.Err = err.Error()
				}
			}
			s.reapMu.Unlock()
		case "reap":
			// The daemon killed these children of init and found nothing else to kill:
			// reap just them (and report their exits, before this reply), without
			// KillAll's scans of /proc.
			s.reapMu.Lock()
			n, err := s.reapPids(m.Keep)
			reply.Count = n
			if err != nil {
				reply.Err = err.Error()
			}
			s.reapMu.Unlock()
		case "branch":
			pid, pidfd, err := startBranch(m, fds)
			closeAll(fds)
			reply.Pid = pid
			if err != nil {
				reply.Err = err.Error()
				s.send(reply, nil)
				continue
			}
			s.send(reply, []int{pidfd})
			unix.Close(pidfd)
			continue
		case "mkns":
			fd, err := newMountNS()
			if err != nil {
				reply.Err = err.Error()
				break
			}
			closeAll(fds)
			s.send(reply, []int{fd})
			unix.Close(fd)
			continue
		case "cgns":
			fd, err := newCommandCgroupNS()
			if err != nil {
				reply.Err = err.Error()
				break
			}
			closeAll(fds)
			s.send(reply, []int{fd})
			unix.Close(fd)
			continue
		case "ping":
		default:
			reply.Err = fmt.Sprintf("unknown op %q", m.Op)
		}
		closeAll(fds)
		s.send(reply, nil)
	}
}

// raisePidFloor makes the sandbox's next PIDs (processes and threads, init's Go threads
// included) larger than floor, writing ns_last_pid through proc (init's proc mount,
// before MaskProc makes sys read-only; CAP_SYS_ADMIN in the PID namespace's user
// namespace allows it) if it is lower. A sandbox started afresh over a record counts PIDs from 2 again, and a thread
// init's Go runtime makes later took a PID a restore from an image needs (clone3 set_tid
// then fails with EEXIST, which no kill can clear: it is init's own thread).
func raisePidFloor(proc string, floor int) error {
	path := filepath.Join(proc, "sys/kernel/ns_last_pid")
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	last, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return fmt.Errorf("%s: %q", path, b)
	}
	if last >= floor {
		return nil
	}
	return os.WriteFile(path, []byte(strconv.Itoa(floor)), 0)
}

// newCommandCgroupNS returns an nsfs fd on a new cgroup namespace rooted where the
// sandbox's commands run (see Client.CommandCgroupNS): made as spawn makes each
// command's, by a thread that joins the v1 limit groups and unshares. The thread is
// locked and never unlocked: it is in the limit groups and a namespace of its own, so
// it dies with its goroutine (and leaves the groups).
func newCommandCgroupNS() (int, error) {
	type result struct {
		fd  int
		err error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		for _, fd := range taskFDs {
			if _, err := unix.Write(fd, []byte("0")); err != nil {
				ch <- result{-1, fmt.Errorf("join the sandbox's cgroup (limits): %w", err)}
				return
			}
		}
		if err := unix.Unshare(unix.CLONE_NEWCGROUP); err != nil {
			ch <- result{-1, fmt.Errorf("unshare CLONE_NEWCGROUP: %w", err)}
			return
		}
		fd, err := unix.Open("/proc/thread-self/ns/cgroup", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			err = fmt.Errorf("open the new cgroup namespace: %w", err)
		}
		ch <- result{fd, err}
	}()
	r := <-ch
	return r.fd, r.err
}

// newMountNS returns an nsfs fd on a new private copy of init's (base) mount namespace,
// made by a thread of init so that the sandbox's user namespace owns it (see
// Client.NewMountNS). The thread is locked and never unlocked: it no longer shares
// init's filesystem state, so it dies with its goroutine.
func newMountNS() (int, error) {
	type result struct {
		fd  int
		err error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_FS | unix.CLONE_NEWNS); err != nil {
			ch <- result{-1, fmt.Errorf("unshare a mount namespace: %w", err)}
			return
		}
		fd, err := unix.Open("/proc/thread-self/ns/mnt", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			err = fmt.Errorf("open the new mount namespace: %w", err)
		}
		ch <- result{fd, err}
	}()
	r := <-ch
	return r.fd, r.err
}

// killAllBut kills every process of the namespace except init and keep (templates and
// live sessions on the fast path), and reaps them. It waits on pidfds (woken when a
// process exits) rather than polling /proc on a timer: a restore waits for this.
// Precondition: reapMu held.
func (s *server) killAllBut(keep []int) (int, error) {
	spare := map[int]bool{1: true}
	for _, p := range keep {
		spare[p] = true
	}
	killed := 0
	deadline := time.Now().Add(10 * time.Second)
	for {
		ents, err := os.ReadDir("/proc")
		if err != nil {
			return killed, err
		}
		var pfds []unix.PollFd
		for _, e := range ents {
			pid, err := strconv.Atoi(e.Name())
			if err != nil || spare[pid] {
				continue
			}
			fd, err := unix.PidfdOpen(pid, 0)
			if err != nil {
				continue // gone
			}
			if unix.Kill(pid, unix.SIGKILL) == nil {
				killed++
			}
			pfds = append(pfds, unix.PollFd{Fd: int32(fd), Events: unix.POLLIN})
		}
		if len(pfds) == 0 {
			return killed, nil
		}
		// A pidfd polls readable once its process has exited (a zombie).
		for _, pf := range pfds {
			for {
				one := []unix.PollFd{pf}
				n, err := unix.Poll(one, int(time.Until(deadline).Milliseconds()))
				if err == unix.EINTR {
					continue
				}
				if n == 0 || err != nil {
					break
				}
				break
			}
			unix.Close(int(pf.Fd))
		}
		// Reap them (the sandbox's processes are init's children, or become so when
		// their parent dies), then look again for any that were forked meanwhile.
		s.reap(false)
		if time.Now().After(deadline) {
			return killed, fmt.Errorf("processes did not die within 10s")
		}
	}
}

// reapPids waits (up to 10 s in all) for each of pids, children of init that were sent
// SIGKILL, to exit, reaps it and reports its exit. One already reaped is skipped.
// Precondition: reapMu held.
func (s *server) reapPids(pids []int) (int, error) {
	n := 0
	deadline := time.Now().Add(10 * time.Second)
	for _, pid := range pids {
		fd, err := unix.PidfdOpen(pid, 0)
		if err != nil {
			continue // reaped already
		}
		one := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		for {
			k, err := unix.Poll(one, int(max(time.Until(deadline).Milliseconds(), 0)))
			if err == unix.EINTR {
				continue
			}
			if k == 0 || err != nil {
				unix.Close(fd)
				return n, fmt.Errorf("process %d did not exit within 10s", pid)
			}
			break
		}
		unix.Close(fd)
		var ws unix.WaitStatus
		for {
			got, err := unix.Wait4(pid, &ws, unix.WALL|unix.WNOHANG, nil)
			if err == unix.EINTR {
				continue
			}
			if err == nil && got == pid {
				n++
				s.send(&Message{Op: "exit", Pid: pid, Status: int(ws)}, nil)
			}
			break
		}
	}
	return n, nil
}

func closeAll(fds []int) {
	for _, f := range fds {
		unix.Close(f)
	}
}

// spawn starts m.Argv with fds[0..2] as stdio in the state mount namespace fds[3] (and
// in the v1 cgroup whose tasks file is fds[4], if sent: SpawnOptions.Tasks), and
// returns its PID and a pidfd of it (-1 on error).
// It forks from a fresh locked thread that first enters that namespace (setns resets
// the thread's root and cwd to the namespace's root), so the child starts there; the
// thread is discarded afterwards because it no longer shares the process's fs state.
func spawn(m *Message, fds []int) (pid, pidfd int, _ error) {
	if len(fds) != 4 && len(fds) != 5 {
		return 0, -1, fmt.Errorf("spawn needs 4 or 5 fds (stdin, stdout, stderr, mntns[, exec cgroup tasks]), got %d", len(fds))
	}
	if len(m.Argv) == 0 {
		return 0, -1, fmt.Errorf("empty command")
	}
	type result struct {
		pid, pidfd int
		err        error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread dies with this goroutine
		if err := dropCapabilities(); err != nil {
			ch <- result{0, -1, err}
			return
		}
		// Join the sandbox's limits, this thread only (v1 places threads; "0" is the
		// writer): the child inherits them, init's other threads stay outside, so a
		// command at its pids limit cannot stop init from making threads. While the
		// thread is locked the Go runtime makes no threads from it (newm delegates
		// to its template thread).
		for _, fd := range taskFDs {
			if _, err := unix.Write(fd, []byte("0")); err != nil {
				ch <- result{0, -1, fmt.Errorf("join the sandbox's cgroup (limits): %w", err)}
				return
			}
		}
		if len(fds) == 5 { // the exec's own group, under the limits' pids group
			if _, err := unix.Write(fds[4], []byte("0")); err != nil {
				ch <- result{0, -1, fmt.Errorf("join the exec's cgroup: %w", err)}
				return
			}
		}
		// A cgroup namespace rooted where the command starts (the sandbox's cgroup2
		// group, the v1 limit groups just joined): a cgroup mount inside shows the
		// sandbox's own groups, not the host's or another sandbox's. Init's own
		// (CLONE_NEWCGROUP at its clone) is rooted at the v1 groups it was started in.
		if err := unix.Unshare(unix.CLONE_NEWCGROUP); err != nil {
			ch <- result{0, -1, fmt.Errorf("unshare CLONE_NEWCGROUP: %w", err)}
			return
		}
		if err := unix.Unshare(unix.CLONE_FS); err != nil {
			ch <- result{0, -1, fmt.Errorf("unshare CLONE_FS: %w", err)}
			return
		}
		if err := unix.Setns(fds[3], unix.CLONE_NEWNS); err != nil {
			ch <- result{0, -1, fmt.Errorf("enter the sandbox's mount namespace: %w", err)}
			return
		}
		path, err := lookPath(m.Argv[0], m.Env)
		if err != nil {
			ch <- result{0, -1, err}
			return
		}
		dir := m.Dir
		if dir == "" {
			dir = "/"
		}
		if fi, err := os.Stat(dir); err != nil || !fi.IsDir() {
			ch <- result{0, -1, fmt.Errorf("working directory %s does not exist in the sandbox", dir)}
			return
		}
		// A pidfd made by the clone itself (no window in which the PID could be
		// reaped and reused): the daemon reads the exit status from it (Client.Spawn).
		pidfd := -1
		attr := &syscall.ProcAttr{
			Dir:   dir,
			Env:   m.Env,
			Files: []uintptr{uintptr(fds[0]), uintptr(fds[1]), uintptr(fds[2])},
			Sys:   &syscall.SysProcAttr{Setsid: m.Setsid, Setpgid: !m.Setsid, Setctty: m.Setsid && m.Ctty, Ctty: 0, PidFD: &pidfd},
		}
		if err := runAs(m, attr, fds[0]); err != nil {
			ch <- result{0, -1, err}
			return
		}
		// A Landlock domain of the command's own (package landlock): no other process of
		// the sandbox may trace, signal or write the memory of what it starts, and its
		// own children stay within its reach. Before the filter, which refuses the
		// landlock calls to the sandbox (seccomp.go).
		if err := landlock.Restrict(); err != nil {
			ch <- result{0, -1, err}
			return
		}
		// Last, on this thread alone: it has entered the namespace (setns is filtered) and
		// forks next; the child and everything it starts inherit the filter.
		if err := installFilter(); err != nil {
			ch <- result{0, -1, err}
			return
		}
		pid, err := syscall.ForkExec(path, m.Argv, attr)
		if err != nil {
			err = fmt.Errorf("exec %s: %w", m.Argv[0], err)
		}
		ch <- result{pid, pidfd, err}
	}()
	r := <-ch
	return r.pid, r.pidfd, r.err
}

// runAs makes attr start the process as m.User, resolved in the sandbox's own
// /etc/passwd and /etc/group (LookupUser), through the calling thread's root: the state's,
// since the spawn thread has entered its mount namespace. It sets HOME, USER and LOGNAME
// unless the request's environment has them, and gives a session's terminal (stdin, with
// Ctty) to the user, as login(1) does, so that tools that reopen or chmod their tty
// work. No m.User: root, as before. Precondition: on the spawn thread, after its setns.
func runAs(m *Message, attr *syscall.ProcAttr, stdin int) error {
	if m.User == "" {
		return nil
	}
	root, err := unix.Open("/", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	u, err := LookupUser(root, m.User)
	unix.Close(root)
	if err != nil {
		return err
	}
	attr.Sys.Credential = &syscall.Credential{Uid: u.UID, Gid: u.GID, Groups: u.Groups}
	set := map[string]bool{}
	for _, e := range attr.Env {
		k, _, _ := strings.Cut(e, "=")
		set[k] = true
	}
	add := func(k, v string) {
		if !set[k] {
			attr.Env = append(attr.Env, k+"="+v)
		}
	}
	add("HOME", u.Home)
	if u.Name != "" {
		add("USER", u.Name)
		add("LOGNAME", u.Name)
	}
	if m.Setsid && m.Ctty {
		if err := unix.Fchown(stdin, int(u.UID), -1); err != nil {
			return fmt.Errorf("give the terminal to user %s: %w", m.User, err)
		}
	}
	return nil
}

// lookPath resolves name with the PATH of env, in the calling thread's filesystem view.
func lookPath(name string, env []string) (string, error) {
	if strings.Contains(name, "/") {
		return name, nil
	}
	path := "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	for _, e := range env {
		if strings.HasPrefix(e, "PATH=") {
			path = e[5:]
		}
	}
	for _, dir := range filepath.SplitList(path) {
		p := filepath.Join(dir, name)
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s: command not found in the sandbox (PATH=%s)", name, path)
}
