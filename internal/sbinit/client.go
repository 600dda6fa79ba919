package sbinit

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"sync"
	"sync/atomic"
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
	proc *os.Process // the init, a child of the daemon
	done chan struct{}

	mu        sync.Mutex
	nextID    int64
	pending   map[int64]chan *Message
	exits     map[int]chan unix.WaitStatus   // spawned pids still running
	spawnExit map[int64]chan unix.WaitStatus // spawn requests awaiting their reply
	closed    error
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
}

// Start launches a sandbox init and waits for it to report ready.
func Start(o StartOptions) (*Client, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	child := os.NewFile(uintptr(fds[1]), "init-ctl")
	o.Config.TaskFDs = nil
	for i := range o.CgroupTasks {
		o.Config.TaskFDs = append(o.Config.TaskFDs, ctlFD+1+i)
	}
	arg, _ := json.Marshal(o.Config)
	cmd := exec.Command("/proc/self/exe", InitArg, string(arg))
	cmd.Args[0] = "deltabox-init"
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
		Cloneflags:  unix.CLONE_NEWPID | unix.CLONE_NEWNS | unix.CLONE_NEWUTS | unix.CLONE_NEWIPC | unix.CLONE_NEWNET,
		UseCgroupFD: o.CgroupFD >= 0,
		CgroupFD:    o.CgroupFD,
	}
	err = cmd.Start()
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
	c := &Client{
		fd:        fds[0],
		proc:      cmd.Process,
		done:      make(chan struct{}),
		pending:   map[int64]chan *Message{},
		exits:     map[int]chan unix.WaitStatus{},
		spawnExit: map[int64]chan unix.WaitStatus{},
	}
	go func() { cmd.Wait(); close(c.done) }()
	// The first message is ready (or the setup error). Past readyTimeout init is
	// killed, which closes its end of the socket and ends the recv.
	var late atomic.Bool
	timer := time.AfterFunc(readyTimeout, func() { late.Store(true); cmd.Process.Kill() })
	buf := make([]byte, maxMessage)
	m, _, err := recv(c.fd, buf, nil)
	timer.Stop()
	if late.Load() {
		err = fmt.Errorf("sandbox init (pid %d) did not report ready within %v (killed)", cmd.Process.Pid, readyTimeout)
	} else if err == nil && m.Err != "" {
		err = fmt.Errorf("sandbox init setup: %s", m.Err)
	}
	if err != nil {
		c.Kill()
		return nil, fmt.Errorf("sandbox init did not start (see its log): %w", err)
	}
	go c.readLoop()
	return c, nil
}

// Pid is the init's PID in the daemon's PID namespace.
func (c *Client) Pid() int { return c.proc.Pid }

// Done is closed once the init has exited and been reaped.
func (c *Client) Done() <-chan struct{} { return c.done }

// Kill kills the init (and with it its PID namespace) and closes the socket.
func (c *Client) Kill() {
	c.proc.Kill()
	c.mu.Lock()
	if c.closed == nil {
		c.closed = fmt.Errorf("sandbox init was stopped: %w", ErrInitGone)
		unix.Shutdown(c.fd, unix.SHUT_RDWR)
	}
	c.mu.Unlock()
	<-c.done
}

func (c *Client) readLoop() {
	buf := make([]byte, maxMessage)
	oob := make([]byte, 64)
	var err error
	for {
		var m *Message
		var fds []int
		m, fds, err = recv(c.fd, buf, oob)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			break
		}
		closeAll(fds)
		c.mu.Lock()
		switch {
		case m.Op == "exit":
			if ch, ok := c.exits[m.Pid]; ok {
				ch <- unix.WaitStatus(m.Status)
				delete(c.exits, m.Pid)
			}
		default:
			if exit, ok := c.spawnExit[m.ID]; ok {
				delete(c.spawnExit, m.ID)
				if m.Err == "" && m.Pid > 0 {
					c.exits[m.Pid] = exit
				}
			}
			if ch, ok := c.pending[m.ID]; ok {
				delete(c.pending, m.ID)
				ch <- m
			}
		}
		c.mu.Unlock()
	}
	c.mu.Lock()
	if c.closed == nil {
		c.closed = fmt.Errorf("%w (%v)", ErrInitGone, err)
	}
	for id, ch := range c.pending {
		ch <- &Message{ID: id, Err: c.closed.Error()}
		delete(c.pending, id)
	}
	for pid, ch := range c.exits {
		close(ch)
		delete(c.exits, pid)
	}
	c.mu.Unlock()
	unix.Close(c.fd)
}

// call sends m with fds and waits for its reply. With exit non-nil, the readLoop
// registers exit for the pid named in the reply before it reads the next message, so
// the pid's exit event (which init always sends after the reply) finds it.
func (c *Client) call(m *Message, fds []int, exit chan unix.WaitStatus) (*Message, error) {
	ch := make(chan *Message, 1)
	c.mu.Lock()
	if c.closed != nil {
		c.mu.Unlock()
		return nil, c.closed
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
	timer := time.NewTimer(callTimeout)
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
			return nil, fmt.Errorf("sandbox init (pid %d) did not answer %s within %v", c.proc.Pid, m.Op, callTimeout)
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
}

// Spawn starts a process in the state mount namespace mntns with the given stdio.
func (c *Client) Spawn(o SpawnOptions, stdio [3]int, mntns int) (*Process, error) {
	exit := make(chan unix.WaitStatus, 1)
	m := &Message{Op: "spawn", Argv: o.Argv, Env: o.Env, Dir: o.Dir, Setsid: o.Setsid, Ctty: o.Ctty, User: o.User}
	r, err := c.call(m, []int{stdio[0], stdio[1], stdio[2], mntns}, exit)
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
	c.exits[pid] = ch
	return ch
}

// Unwatch drops a Watch that will not be needed (the clone failed).
func (c *Client) Unwatch(pid int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.exits, pid)
}

// Hold makes init keep a duplicate of fd; it returns the fd's number in init.
func (c *Client) Hold(fd int) (int, error) {
	r, err := c.call(&Message{Op: "hold"}, []int{fd}, nil)
	if err != nil {
		return -1, err
	}
	return r.Count, nil
}

// Release closes an fd kept by Hold.
func (c *Client) Release(n int) error {
	_, err := c.call(&Message{Op: "release", Pid: n}, nil, nil)
	return err
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
