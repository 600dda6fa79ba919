package sbinit

import (
	"fmt"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/procfs"
)

// A sandbox outlives its daemon. Init does not end when its control socket closes (the
// daemon stopped, crashed or was killed with SIGKILL): it goes on reaping, queues the
// exit events it cannot send (maxBacklog), and serves its spare socket, whose daemon end
// it keeps at spareFD for the next daemon to take with pidfd_getfd (Reconnect). Only a
// holder of CAP_SYS_PTRACE over init can take it: init is not dumpable and no process of
// the sandbox has that capability (dropCapabilities), so the sandbox cannot speak on the
// spare either (tests/security: TestInitSpareUnreachable).
//
// What the next daemon needs and cannot read from the kernel, init keeps for it (keep):
// each session's terminal master with the session's description. The terminal must
// outlive the daemon for the session to: when its last master closes, the session's
// leader gets SIGHUP, and bash and python end.

// FeatureLevel is what this binary's init does for the commands it spawns, recorded with
// each init the daemon starts (store.InitRef.Level) and checked before a next daemon
// adopts it: an init keeps running the code of the daemon that started it, so a sandbox
// adopted across an upgrade would go on spawning commands without what came since. Raise
// it with each protection init gives commands; a daemon adopts no init below its own.
//
//	0  (no level recorded) the daemons before levels
//	1  a Landlock domain per command with the signal scope (package landlock); the disk
//	   quota's RLIMIT_FSIZE and fallocate filter (seccomp.go); a user namespace owned
//	   by the sandbox's uid base, not host root (user.go)
const FeatureLevel = 1

// FeatureLevelNames says what an init below FeatureLevel lacks, for the log.
const FeatureLevelNames = "Landlock domains per command, the disk quota's RLIMIT_FSIZE and fallocate filter, a user namespace owned by its uid base"

// spareFD is where init keeps the daemon end of its spare socket.
const spareFD = 100

// maxBacklog bounds the exit events init queues while no daemon is connected (a fork
// bomb must not grow init without bound); past it the oldest go, counted.
const maxBacklog = 4096

// maxKept bounds what init keeps: one reply carries every kept fd, and SCM_RIGHTS
// carries at most 253 (SCM_MAX_FD). A sandbox has at most 64 sessions.
const maxKept = 250

type kept struct {
	data string
	fd   int
}

// newSpare makes a fresh spare socket pair: init's end is returned, the daemon's end is
// put at spareFD (replacing what was there: the end a daemon took is no longer init's
// to keep, or init would hold both ends and never see that daemon go).
func newSpare() (int, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("spare socket: %w", err)
	}
	if err := unix.Dup3(fds[1], spareFD, unix.O_CLOEXEC); err != nil {
		unix.Close(fds[0])
		unix.Close(fds[1])
		return -1, fmt.Errorf("spare socket at fd %d: %w", spareFD, err)
	}
	unix.Close(fds[1])
	return fds[0], nil
}

// orphan switches the server to its spare socket after the control socket closed.
// Called by serve, the only reader of s.fd.
func (s *server) orphan() {
	s.sendMu.Lock()
	defer s.sendMu.Unlock()
	if s.spare < 0 {
		fatal("control socket closed and no spare socket (its remaking failed): no daemon can reconnect")
	}
	unix.Close(s.fd)
	s.fd, s.spare = s.spare, -1
	s.orphaned = true
}

// queueLocked keeps an exit event for the next daemon. Precondition: sendMu held.
func (s *server) queueLocked(m *Message) {
	if len(s.backlog) >= maxBacklog {
		s.backlog = s.backlog[1:]
		s.dropped++
	}
	s.backlog = append(s.backlog, m)
}

// hello adopts the daemon that spoke on the spare: a new spare replaces spareFD, the
// queued exits go out, then the reply (count: exits dropped). Called by serve.
func (s *server) hello(m *Message) {
	s.sendMu.Lock()
	defer s.sendMu.Unlock()
	reply := &Message{ID: m.ID}
	if !s.orphaned {
		reply.Err = "hello on a connected init"
		send(s.fd, reply, nil)
		return
	}
	spare, err := newSpare()
	if err != nil {
		reply.Err = err.Error()
		send(s.fd, reply, nil)
		return
	}
	s.spare = spare
	s.orphaned = false
	for _, e := range s.backlog {
		if send(s.fd, e, nil) != nil {
			break
		}
	}
	s.backlog = nil
	reply.Count, s.dropped = s.dropped, 0
	send(s.fd, reply, nil)
}

// keep, forget and kept serve the ops of the same names (called by serve; kept is only
// touched there).
func (s *server) keep(m *Message, fds []int) error {
	if m.Key == "" || len(fds) != 1 {
		return fmt.Errorf("keep needs a key and one fd")
	}
	if old, ok := s.kept[m.Key]; ok {
		unix.Close(old.fd)
	} else if len(s.kept) >= maxKept {
		return fmt.Errorf("init keeps %d things already", maxKept)
	}
	s.kept[m.Key] = kept{data: m.Data, fd: fds[0]}
	return nil
}

func (s *server) forget(key string) {
	if k, ok := s.kept[key]; ok {
		unix.Close(k.fd)
		delete(s.kept, key)
	}
}

func (s *server) keptReply(reply *Message) []int {
	var fds []int
	for key, k := range s.kept {
		reply.Keys = append(reply.Keys, key)
		reply.Datas = append(reply.Datas, k.data)
		fds = append(fds, k.fd)
	}
	return fds
}

// helloTimeout bounds a reconnecting daemon's wait for init's answer. Init answers a
// hello as soon as it reads it; it does not read its spare while a daemon is connected.
var helloTimeout = 5 * time.Second

// Reconnect connects to the init of a sandbox a previous daemon started: pid and start
// (its /proc/PID/stat starttime) as that daemon recorded them. It checks that pid is
// still that process (a pidfd first, then the start time: no window for a reused PID),
// takes init's spare socket (spareFD) with pidfd_getfd and says hello. The exits init
// queued meanwhile are kept for Watch (until DropEarly). The returned client's Done
// closes when init exits (polled through its pidfd; init is no longer the daemon's
// child). An init that is gone wraps ErrInitGone.
func Reconnect(pid int, start uint64) (_ *Client, err error) {
	pidfd, err := unix.PidfdOpen(pid, unix.PIDFD_NONBLOCK)
	if err != nil {
		return nil, fmt.Errorf("sandbox init (pid %d): %v: %w", pid, err, ErrInitGone)
	}
	f := os.NewFile(uintptr(pidfd), "init-pidfd") // nonblocking: on Go's poller
	defer func() {
		if err != nil {
			f.Close()
		}
	}()
	if got, err := procfs.StartTime(pid); err != nil || got != start {
		return nil, fmt.Errorf("sandbox init (pid %d): not the recorded process (start time %d, recorded %d, %v): %w", pid, got, start, err, ErrInitGone)
	}
	rc, err := f.SyscallConn()
	if err != nil {
		return nil, err
	}
	fd := -1
	var gerr error
	rc.Control(func(p uintptr) { fd, gerr = unix.PidfdGetfd(int(p), spareFD, 0) })
	if gerr != nil {
		return nil, fmt.Errorf("take sandbox init's spare socket (pid %d, fd %d): %w", pid, spareFD, gerr)
	}
	if t, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_TYPE); err != nil || t != unix.SOCK_SEQPACKET {
		unix.Close(fd)
		return nil, fmt.Errorf("sandbox init (pid %d): fd %d is not its spare socket (type %d, %v)", pid, spareFD, t, err)
	}
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_PASSCRED, 1); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("init socket: SO_PASSCRED: %w", err)
	}
	kill := func() error {
		var err error
		rc.Control(func(p uintptr) { err = unix.PidfdSendSignal(int(p), unix.SIGKILL, nil, 0) })
		return err
	}
	c := newClient(fd, pid, kill)
	c.early = map[int]unix.WaitStatus{} // +checklocksignore: c is not shared yet
	go func() {
		// A pidfd polls readable once its process has exited.
		rc.Read(func(p uintptr) bool {
			n, _ := unix.Poll([]unix.PollFd{{Fd: int32(p), Events: unix.POLLIN}}, 0)
			return n > 0
		})
		f.Close()
		close(c.done)
	}()
	go c.readLoop()
	r, err := c.callWithin(&Message{Op: "hello"}, nil, nil, helloTimeout)
	if err != nil {
		c.Detach()
		return nil, fmt.Errorf("sandbox init (pid %d) did not take the new daemon (is another daemon connected to it?): %w", pid, err)
	}
	if r.Count > 0 {
		// Not an error: those processes' exits are unknown, and Watch of one waits until
		// the daemon finds it gone some other way (its pidfd, its cgroup).
		err = fmt.Errorf("sandbox init dropped %d exit events while no daemon was connected", r.Count)
	}
	return c, err
}

// StartTime is the init's /proc/PID/stat starttime, to record beside its PID for
// Reconnect.
func (c *Client) StartTime() (uint64, error) { return procfs.StartTime(c.pid) }

// DropEarly forgets the exits queued before Reconnect that no Watch asked for.
func (c *Client) DropEarly() {
	c.mu.Lock()
	c.early = nil
	c.mu.Unlock()
}

// Detach closes the daemon's end of the control socket and leaves the init running,
// for the next daemon (Reconnect). Calls after it fail; exits not yet reported are
// queued by init.
func (c *Client) Detach() {
	c.mu.Lock()
	if c.closed == nil {
		c.closed = fmt.Errorf("the daemon let go of sandbox init: %w", ErrInitGone)
		unix.Shutdown(c.fd, unix.SHUT_RDWR)
	}
	c.mu.Unlock()
}

// Keep hands init fd (the caller keeps its own) and data under key, replacing what it
// kept there; Kept gives them to the next daemon.
func (c *Client) Keep(key, data string, fd int) error {
	_, err := c.call(&Message{Op: "keep", Key: key, Data: data}, []int{fd}, nil)
	return err
}

// Forget makes init close what it keeps under key.
func (c *Client) Forget(key string) error {
	_, err := c.call(&Message{Op: "forget", Key: key}, nil, nil)
	return err
}

// KeptFile is one thing init keeps: its data and a duplicate of its fd (the caller's).
type KeptFile struct {
	Data string
	FD   int
}

// Kept returns everything init keeps, by key.
func (c *Client) Kept() (map[string]KeptFile, error) {
	r, err := c.call(&Message{Op: "kept"}, nil, nil)
	if err != nil {
		if r != nil {
			closeAll(r.fds)
		}
		return nil, err
	}
	if len(r.Keys) != len(r.fds) || len(r.Datas) != len(r.Keys) {
		closeAll(r.fds)
		return nil, fmt.Errorf("sandbox init answered kept with %d keys, %d data and %d fds", len(r.Keys), len(r.Datas), len(r.fds))
	}
	out := map[string]KeptFile{}
	for i, k := range r.Keys {
		out[k] = KeptFile{Data: r.Datas[i], FD: r.fds[i]}
	}
	return out, nil
}
