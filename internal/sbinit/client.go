package sbinit

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// ErrInitGone: the sandbox's init has exited (killed from outside, or crashed).
var ErrInitGone = errors.New("the sandbox's init is gone")

// Deadlines on init. It reports ready after a few mounts (milliseconds), and answers
// every request at once except reap and kill-all-but, which it bounds at 10 s itself:
// past these, init is stuck, and the caller gets an error naming it instead of a
// goroutine that waits for ever.
var (
	readyTimeout = 30 * time.Second
	callTimeout  = time.Minute
)

// Client is the daemon's end of one init's control socket.
//
// One goroutine (readLoop) owns reading; callers send under mu and wait on their own
// channel. mu protects nextID, pending, exits and closed.
type Client struct {
	fd   int
	pid  int          // the init's host PID
	kill func() error // SIGKILL to the init, by pidfd (never by a PID that may be reused)
	done chan struct{}

	mu sync.Mutex
	// +checklocks:mu
	nextID int64
	// +checklocks:mu
	pending map[int64]chan *Message
	// +checklocks:mu
	exits map[int]*watch // spawned (or watched) pids still running
	// +checklocks:mu
	spawnExit map[int64]chan unix.WaitStatus // spawn requests awaiting their reply
	// +checklocks:mu
	closed error
	// early holds the exits init queued while no daemon was connected, for processes
	// no Watch names yet (Reconnect: a session's process found later); nil otherwise.
	// +checklocks:mu
	early map[int]unix.WaitStatus
}

// watch is one pid whose exit the daemon waits for: its channel, and a pidfd of the
// process when init made one at the spawn (-1 for Watch).
type watch struct {
	ch    chan unix.WaitStatus
	pidfd int
}

// StartOptions configures a new init.
type StartOptions struct {
	Config   Config
	CgroupFD int // the sandbox's cgroup2 directory: init starts inside it
	// Log receives init's stdout and stderr, through a pipe (init holds no file of the
	// store, which its fds would expose to the sandbox: /proc/1/fd/N), at most logCap
	// bytes of it. Start dups it; the caller keeps its own.
	Log *os.File
	// CgroupTasks are the "tasks" files of the sandbox's v1 cgroups (its limits). Init
	// stays outside them; its spawn thread joins them just before each fork, so every
	// command starts inside the limits (see internal/cgroup/v1.go).
	CgroupTasks []*os.File
	// RootDir is an fd on an empty directory of the daemon's (the sandbox's directory
	// in the store) that init mounts its base tmpfs on and pivots into. Init starts with
	// it as its working directory, so it needs no path to it: root only in its user
	// namespace, init may not search the store's directories (0700, root's).
	RootDir *os.File
	// IDs is the sandbox's user namespace's map (root inside is IDs.Base outside);
	// nil starts init without a user namespace (isolation off: for comparisons only).
	IDs *IDRange
}

// IDRange is a range of host uids and gids, the same for both, that a sandbox's user
// namespace maps 0..Size-1 onto.
type IDRange struct {
	Base, Size uint32
}

// Start launches a sandbox init and waits for it to report ready.
func Start(o StartOptions) (*Client, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	// Every message then carries its sender's PID, set by the kernel: readLoop drops
	// what does not come from init (a process of the sandbox holding init's end of the
	// socket, taken with pidfd_getfd, could otherwise speak for init).
	if err := unix.SetsockoptInt(fds[0], unix.SOL_SOCKET, unix.SO_PASSCRED, 1); err != nil {
		unix.Close(fds[0])
		unix.Close(fds[1])
		return nil, fmt.Errorf("init socket: SO_PASSCRED: %w", err)
	}
	child := os.NewFile(uintptr(fds[1]), "init-ctl")
	o.Config.TaskFDs = nil
	for i := range o.CgroupTasks {
		o.Config.TaskFDs = append(o.Config.TaskFDs, ctlFD+1+i)
	}
	arg, _ := json.Marshal(o.Config)
	cmd := exec.Command(initExe(), InitArg, string(arg))
	cmd.Args[0] = "deltabox-init"
	if o.RootDir == nil {
		child.Close()
		unix.Close(fds[0])
		return nil, fmt.Errorf("start sandbox init: no root directory")
	}
	cmd.ExtraFiles = append([]*os.File{child}, o.CgroupTasks...)
	logR, logW, err := os.Pipe()
	if err != nil {
		child.Close()
		unix.Close(fds[0])
		return nil, err
	}
	cmd.Stdout, cmd.Stderr = logW, logW
	cmd.Env = []string{}
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags:  unix.CLONE_NEWPID | unix.CLONE_NEWNS | unix.CLONE_NEWUTS | unix.CLONE_NEWIPC | unix.CLONE_NEWNET | unix.CLONE_NEWCGROUP,
		UseCgroupFD: o.CgroupFD >= 0,
		CgroupFD:    o.CgroupFD,
		// Init leads a session of its own (1 inside), which the execs' jobs join: a
		// session led from outside the sandbox's PID namespace would make them
		// undumpable by CRIU (internal/state/criutrees.go), and would tie the sandbox
		// to the daemon's session.
		Setsid: true,
	}
	if o.IDs != nil {
		// One clone makes the user namespace and the others, so it owns them all: root
		// inside has capabilities over the sandbox's namespaces and nothing else. Go
		// writes the maps before init execs; setgroups stays allowed (the daemon, root
		// outside, writes the maps), so root inside may drop groups.
		cmd.SysProcAttr.Cloneflags |= unix.CLONE_NEWUSER
		m := []syscall.SysProcIDMap{{ContainerID: 0, HostID: int(o.IDs.Base), Size: int(o.IDs.Size)}}
		cmd.SysProcAttr.UidMappings, cmd.SysProcAttr.GidMappings = m, m
		cmd.SysProcAttr.GidMappingsEnableSetgroups = true
		// The clone keeps the daemon's ids (host root, unmapped inside): init must take
		// root of its namespace before it execs, or exec drops every capability.
		cmd.SysProcAttr.Credential = &syscall.Credential{Uid: 0, Gid: 0}
	}
	var owner uint32 // the daemon's own euid: no user namespace, or isolation off
	if o.IDs != nil {
		owner = o.IDs.Base
	}
	err = startIn(cmd, o.RootDir, owner)
	// Only init holds its end now: if init dies, the recv below sees the socket close
	// instead of waiting for ever.
	child.Close()
	logW.Close()
	if err != nil {
		logR.Close()
		unix.Close(fds[0])
		return nil, fmt.Errorf("start sandbox init: %w", err)
	}
	var logDup *os.File // the caller may close o.Log when Start returns
	if o.Log != nil {
		if fd, err := unix.FcntlInt(o.Log.Fd(), unix.F_DUPFD_CLOEXEC, 0); err == nil {
			logDup = os.NewFile(uintptr(fd), o.Log.Name())
		}
	}
	go copyLog(logR, logDup)
	c := newClient(fds[0], cmd.Process.Pid, cmd.Process.Kill)
	go func() { cmd.Wait(); close(c.done) }()
	// The first message is ready (or the setup error).
	if err := c.awaitReady(); err != nil {
		c.Kill()
		return nil, fmt.Errorf("sandbox init did not start (see its log): %w", err)
	}
	go c.readLoop()
	return c, nil
}

// startIn starts cmd with dir as its working directory, which it inherits from the
// thread that forks it: a locked thread with a filesystem state of its own
// (unshare(CLONE_FS)) that has changed into dir, discarded afterwards (its goroutine
// ends locked). cmd.Dir would not do: Go changes directory after taking the new
// credentials, and root of a user namespace may not search the store's directories.
// With CLONE_NEWNS the child's working directory is the same directory in its copy of
// the namespace.
//
// owner, when not 0, is the effective uid the thread forks with, which makes it the
// owner of the user namespace the clone creates (the kernel takes the creator's euid:
// create_user_ns). The owner is where the kernel charges the sandbox's per-user budgets
// at the host's level: inc_ucount and inc_rlimit_ucounts walk from the charged user up
// the namespaces, and at each parent level charge the child namespace's owner. Owned
// by host root, every sandbox's inotify instances and watches, message-queue bytes and
// queued signals were root's, and one sandbox used them up for all the others and for
// the host's root; owned by its own uid base, each sandbox has the host's per-user
// limits of its own (fs.inotify.max_user_*, and RLIMIT_MSGQUEUE and RLIMIT_SIGPENDING
// as the daemon has them when it creates the namespace: the namespace's rlimit maxima).
// Only the euid changes: the real uid stays 0, so that RLIMIT_NPROC is not enforced on
// the namespace (enforced_nproc_rlimit) nor on the fork; the effective capabilities,
// which the kernel clears when the euid leaves 0, are raised again, so the daemon
// still writes the child's id maps and starts it inside its cgroup (CLONE_INTO_CGROUP
// checks the forker's write access to cgroup.procs). The owner gains nothing over the
// namespace that the daemon, root of the parent namespace, does not already have, and
// no process on the host runs as that uid (the sandbox's own processes are inside).
func startIn(cmd *exec.Cmd, dir *os.File, owner uint32) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: see above
		if err := unix.Unshare(unix.CLONE_FS); err != nil {
			errc <- fmt.Errorf("unshare CLONE_FS: %w", err)
			return
		}
		if err := unix.Fchdir(int(dir.Fd())); err != nil {
			errc <- fmt.Errorf("change into the init's root directory: %w", err)
			return
		}
		if owner != 0 {
			if err := setOwnEUID(owner); err != nil {
				errc <- err
				return
			}
		}
		errc <- cmd.Start()
	}()
	return <-errc
}

// setOwnEUID sets the calling thread's effective uid (and its fsuid with it) to uid,
// alone (a raw setresuid: Go's syscall.Setresuid changes every thread), and raises its
// effective capabilities back to its permitted set. Precondition: the OS thread is
// locked and is never given back to the runtime.
func setOwnEUID(uid uint32) error {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var caps [2]unix.CapUserData
	if err := unix.Capget(&hdr, &caps[0]); err != nil {
		return fmt.Errorf("capget: %w", err)
	}
	keep := ^uintptr(0) // -1: unchanged
	if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, keep, uintptr(uid), keep); e != 0 {
		return fmt.Errorf("set the euid that owns the sandbox's user namespace to %d: %w", uid, e)
	}
	caps[0].Effective, caps[1].Effective = caps[0].Permitted, caps[1].Permitted
	if err := unix.Capset(&hdr, &caps[0]); err != nil {
		return fmt.Errorf("raise the capabilities again after setting the euid to %d: %w", uid, err)
	}
	return nil
}

func newClient(fd, pid int, kill func() error) *Client {
	return &Client{
		fd:        fd,
		pid:       pid,
		kill:      kill,
		done:      make(chan struct{}),
		pending:   map[int64]chan *Message{},
		exits:     map[int]*watch{},
		spawnExit: map[int64]chan unix.WaitStatus{},
	}
}

// Pid is the init's PID in the daemon's PID namespace.
func (c *Client) Pid() int { return c.pid }

// Done is closed once the init has exited and been reaped.
func (c *Client) Done() <-chan struct{} { return c.done }

// killWait bounds how long Kill waits for init to exit. A killed init exits once every
// process of its PID namespace is reaped (the kernel's zap_pid_ns_processes): ~1 ms
// for a sandbox of a few processes, more for thousands. A process traced from outside
// the namespace is reaped only by its tracer; one whose tracer never waits (a bug of
// the daemon) would keep init, and its caller, waiting for ever.
const killWait = 10 * time.Second

// Kill kills the init (and with it its PID namespace), closes the socket and waits,
// killWait at most, for init to exit.
func (c *Client) Kill() error {
	c.kill()
	c.mu.Lock()
	if c.closed == nil {
		c.closed = fmt.Errorf("sandbox init was stopped: %w", ErrInitGone)
		unix.Shutdown(c.fd, unix.SHUT_RDWR)
	}
	c.mu.Unlock()
	select {
	case <-c.done:
		return nil
	case <-time.After(killWait):
		return fmt.Errorf("sandbox init (pid %d) did not exit within %v of its SIGKILL: a process of its PID namespace is not reaped (a traced one waits for its tracer; see /proc/%d/task/*/children and their TracerPid)", c.pid, killWait, c.pid)
	}
}

func (c *Client) readLoop() {
	buf := newBuf()
	oob := make([]byte, unix.CmsgSpace(4*8)+unix.CmsgSpace(unix.SizeofUcred))
	var err error
	for {
		var m *Message
		var fds []int
		var from int
		m, fds, from, err = recvFrom(c.fd, buf, oob)
		if err == unix.EINTR {
			continue
		}
		if from != c.pid && (err == nil || from != 0) {
			// Not init: a process of the sandbox that holds init's end of the socket
			// (its garbage, or an empty datagram, must not end the sandbox either).
			closeAll(fds)
			continue
		}
		if err != nil {
			break
		}
		c.mu.Lock()
		switch {
		case m.Op == "exit":
			if _, ok := c.exits[m.Pid]; !ok && c.early != nil && len(c.early) < maxBacklog {
				c.early[m.Pid] = unix.WaitStatus(m.Status)
			}
			if w, ok := c.exits[m.Pid]; ok {
				if st, ok := exitStatus(w.pidfd, m.Status); ok {
					w.ch <- st
					delete(c.exits, m.Pid)
					if w.pidfd >= 0 {
						unix.Close(w.pidfd)
					}
				}
			}
		default:
			if exit, ok := c.spawnExit[m.ID]; ok {
				delete(c.spawnExit, m.ID)
				if m.Err == "" && m.Pid > 0 {
					w := &watch{ch: exit, pidfd: -1}
					if len(fds) == 1 && isChildOf(fds[0], c.pid) {
						w.pidfd, fds = fds[0], nil
					}
					c.exits[m.Pid] = w
				}
				// A spawn reply's pidfd is the watch's alone. One that isChildOf refused
				// (a process already reaped when its reply is read: a short command on a
				// loaded machine) is closed here, not handed to Spawn, which keeps no fds
				// (TestSpawnReplyPidfdNotKept).
				closeAll(fds)
				fds = nil
			}
			if ch, ok := c.pending[m.ID]; ok {
				delete(c.pending, m.ID)
				m.fds, fds = fds, nil
				ch <- m
			}
		}
		c.mu.Unlock()
		closeAll(fds)
	}
	c.mu.Lock()
	if c.closed == nil {
		c.closed = fmt.Errorf("%w (%v)", ErrInitGone, err)
	}
	for id, ch := range c.pending {
		ch <- &Message{ID: id, Err: c.closed.Error()}
		delete(c.pending, id)
	}
	for pid, w := range c.exits {
		close(w.ch)
		if w.pidfd >= 0 {
			unix.Close(w.pidfd)
		}
		delete(c.exits, pid)
	}
	c.mu.Unlock()
	unix.Close(c.fd)
}

// call sends m with fds and waits for its reply. With exit non-nil, the readLoop
// registers exit for the pid named in the reply before it reads the next message, so
// the pid's exit event (which init always sends after the reply) finds it.
func (c *Client) call(m *Message, fds []int, exit chan unix.WaitStatus) (*Message, error) {
	return c.callWithin(m, fds, exit, callTimeout)
}

func (c *Client) callWithin(m *Message, fds []int, exit chan unix.WaitStatus, timeout time.Duration) (*Message, error) {
	ch := make(chan *Message, 1)
	c.mu.Lock()
	if err := c.closed; err != nil {
		c.mu.Unlock()
		return nil, err
	}
	c.nextID++
	m.ID = c.nextID
	c.pending[m.ID] = ch
	if exit != nil {
		c.spawnExit[m.ID] = exit
	}
	err := send(c.fd, m, fds)
	if err != nil {
		delete(c.pending, m.ID)
		delete(c.spawnExit, m.ID)
		c.mu.Unlock()
		return nil, fmt.Errorf("send to sandbox init: %w", err)
	}
	c.mu.Unlock()
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	var r *Message
	select {
	case r = <-ch:
	case <-timer.C:
		c.mu.Lock()
		delete(c.pending, m.ID)
		delete(c.spawnExit, m.ID)
		c.mu.Unlock()
		select {
		case r = <-ch: // the reply came as the timer fired
		default:
			// A reply that comes later finds no one waiting: readLoop closes its fds.
			return nil, fmt.Errorf("sandbox init (pid %d) did not answer %s within %v", c.pid, m.Op, timeout)
		}
	}
	if r.Err != "" {
		return r, fmt.Errorf("%s", r.Err)
	}
	return r, nil
}

// Process is a process spawned by init.
type Process struct {
	Pid  int                    // in the sandbox's PID namespace
	Exit <-chan unix.WaitStatus // one value when init reaps it; closed without a value if init dies
}

// SpawnOptions says how a process starts.
type SpawnOptions struct {
	Argv []string
	Env  []string
	Dir  string
	// Setsid makes the process lead a new session (else a new process group); either
	// way its PID is its group id, so Signal(pid, sig, true) reaches what it started.
	Setsid bool
	// Ctty (with Setsid) makes stdin, a pty, the session's controlling terminal.
	Ctty bool
	// User, if set, is who the process runs as: "NAME", "UID", "NAME:GROUP" or
	// "UID:GID", resolved by init in the state's /etc/passwd and /etc/group
	// (LookupUser). HOME, USER and LOGNAME come from passwd unless Env sets them.
	User string
	// Tasks, if > 0, is an fd on a v1 cgroup's tasks file (cgroup.ExecGroup) that the
	// spawn thread joins last: the process and all it starts are there, whatever
	// session they move to, and the group's kill ends them all.
	Tasks int
}

// Spawn starts a process in the state mount namespace mntns with the given stdio.
func (c *Client) Spawn(o SpawnOptions, stdio [3]int, mntns int) (*Process, error) {
	exit := make(chan unix.WaitStatus, 1)
	m := &Message{Op: "spawn", Argv: o.Argv, Env: o.Env, Dir: o.Dir, Setsid: o.Setsid, Ctty: o.Ctty, User: o.User}
	fds := []int{stdio[0], stdio[1], stdio[2], mntns}
	if o.Tasks > 0 {
		fds = append(fds, o.Tasks)
	}
	r, err := c.call(m, fds, exit)
	if err != nil {
		return nil, err
	}
	return &Process{Pid: r.Pid, Exit: exit}, nil
}

// Watch returns a channel that receives pid's wait status when init reaps it (pid in
// the sandbox). Register before the process can exit: a process the daemon did not
// spawn (a fork made by injection) is watched from before its clone.
func (c *Client) Watch(pid int) <-chan unix.WaitStatus {
	ch := make(chan unix.WaitStatus, 1)
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed != nil {
		close(ch)
		return ch
	}
	if st, ok := c.early[pid]; ok { // it exited while no daemon was connected
		delete(c.early, pid)
		ch <- st
		return ch
	}
	c.exits[pid] = &watch{ch: ch, pidfd: -1}
	return ch
}

// Unwatch drops a Watch that will not be needed (the clone failed).
func (c *Client) Unwatch(pid int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if w, ok := c.exits[pid]; ok && w.pidfd >= 0 {
		unix.Close(w.pidfd)
	}
	delete(c.exits, pid)
}

// NewMountNS returns an nsfs fd on a fresh private copy of init's base mount
// namespace, made by a thread of init: a namespace's owner is the user namespace of
// the task that creates it, and an injected setns by a process of the sandbox (root
// only in the sandbox's user namespace) is refused for a namespace the daemon made.
// The daemon then mounts a state's overlay in it (mountns.Builder).
func (c *Client) NewMountNS() (int, error) {
	r, err := c.call(&Message{Op: "mkns"}, nil, nil)
	if err != nil {
		if r != nil {
			closeAll(r.fds)
		}
		return -1, fmt.Errorf("a mount namespace from the sandbox's init: %w", err)
	}
	if len(r.fds) != 1 {
		closeAll(r.fds)
		return -1, fmt.Errorf("the sandbox's init answered mkns with %d fds, not 1", len(r.fds))
	}
	return r.fds[0], nil
}

// CommandCgroupNS returns an nsfs fd on a cgroup namespace like the one each command
// of the sandbox runs in: rooted at the sandbox's cgroup2 group and its v1 limit groups.
// Init's own is not: it is rooted at the v1 groups init started in (the daemon's), and
// a process restored into it sees host paths in /proc/self/cgroup (and CRIU refuses to
// dump it again: "invalid cgroup configuration").
func (c *Client) CommandCgroupNS() (*os.File, error) {
	r, err := c.call(&Message{Op: "cgns"}, nil, nil)
	if err != nil {
		if r != nil {
			closeAll(r.fds)
		}
		return nil, fmt.Errorf("a cgroup namespace from the sandbox's init: %w", err)
	}
	if len(r.fds) != 1 {
		closeAll(r.fds)
		return nil, fmt.Errorf("the sandbox's init answered cgns with %d fds, not 1", len(r.fds))
	}
	return os.NewFile(uintptr(r.fds[0]), "commands-cgroup-ns"), nil
}

// Signal sends sig to pid (or its process group) inside the sandbox.
func (c *Client) Signal(pid int, sig unix.Signal, group bool) error {
	_, err := c.call(&Message{Op: "signal", Pid: pid, Sig: int(sig), Group: group}, nil, nil)
	return err
}

// Reap asks init to reap pids, its children, which were sent SIGKILL (waiting up to 10 s
// for them to exit), reporting their exits (Watch) before it answers. It returns how
// many it reaped.
func (c *Client) Reap(pids ...int) (int, error) {
	r, err := c.call(&Message{Op: "reap", Keep: pids}, nil, nil)
	if r == nil {
		return 0, err
	}
	return r.Count, err
}

// KillAll kills every process of the sandbox but init and keep (PIDs in the sandbox),
// and waits until all are reaped.
func (c *Client) KillAll(keep ...int) (int, error) {
	r, err := c.call(&Message{Op: "killall", Keep: keep}, nil, nil)
	if err != nil {
		return 0, err
	}
	return r.Count, nil
}

// logCap bounds what init's log keeps: init writes a line or two (its setup error), but
// a process of the sandbox can reach the pipe's write end (/proc/1/fd/1) and must not
// fill the store through it.
const logCap = 1 << 20

// copyLog copies init's output from r to log (which it closes), up to logCap bytes,
// and drains the rest, until every writer is gone (init, and anything of the sandbox
// that opened its stdout).
func copyLog(r *os.File, log *os.File) {
	defer r.Close()
	var w io.Writer = io.Discard
	if log != nil {
		defer log.Close()
		w = log
	}
	n, _ := io.CopyN(w, r, logCap)
	if n == logCap {
		fmt.Fprintf(w, "\n[deltabox: init's log cut at %d bytes]\n", logCap)
	}
	io.Copy(io.Discard, r)
}
