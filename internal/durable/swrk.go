package durable

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/checkpoint-restore/go-criu/v7/rpc"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"deltabox/internal/criu"
	"deltabox/internal/deadline"
	"deltabox/internal/landlock"
	_ "deltabox/internal/mainthread" // call.start may discard a thread whose pid_for_children it changed
)

// call is one request to a `criu swrk` server started for it, as runc's
// libcontainer/criu_linux.go drives CRIU: the request and CRIU's answers go over a
// SEQPACKET socketpair, and our copy of CRIU's end is closed right after the start, so
// that a CRIU that dies or is killed ends our read (EOF) instead of hanging it. The
// server runs under deadline.Command: past timeout its process group is killed and the
// error names what it was doing and quotes the end of its log.
type call struct {
	r       *criu.Runner
	typ     rpc.CriuReqType
	opts    *rpc.CriuOpts
	files   []*os.File // passed to CRIU as fds 4, 5... (fd 3 is the socket)
	what    string     // "criu dump of pid 42" in errors
	dir     string     // the images directory, where CRIU writes log
	log     string
	timeout time.Duration
	// pidNS, when set, is the PID namespace CRIU runs in, with a /proc of that
	// namespace in a mount namespace of its own (unshare --mount-proc): the restored
	// root task is then CRIU's child in the sandbox's PID namespace and, once CRIU
	// exits, the sandbox init's (a parent in the host's namespace hands its orphans to
	// the host's PID 1). CRIU's own PIDs and the /proc it reads must agree: with the
	// host's /proc it fails at start ("Can't open 43/maps on procfs").
	pidNS *os.File
	// cgroupNS, with pidNS, is the cgroup namespace CRIU starts in, which the restored
	// tree inherits (CRIU cannot join one: --join-ns has no cgroup).
	cgroupNS *os.File
	// netNS, when set, is the network namespace CRIU starts in: a dump's, the tree's
	// own (Dump says why).
	netNS *os.File
	// background lowers CRIU's CPU and I/O priority (nice 19, idle I/O class) right
	// after its start: a background dump must not slow the agents' operations.
	background bool
	// cgroups: CRIU is moved into these before the request is sent.
	cgroups []string
	// env is added to CRIU's environment (switches of DeltaBox's patches).
	env []string
	// owner, when not 0, is the uid CRIU runs as, with the daemon's capabilities: the
	// owner of the sandbox's user namespace, for a dump (owner.go says why).
	owner uint32
	// notify, when set, is called at each of CRIU's notifications (the request's
	// notify_scripts) with its name ("post-restore"...); an error fails the request
	// (CRIU aborts: after a post-restore, it kills the restored tree).
	notify func(script string) error
	// domain runs CRIU in a Landlock domain of its own (package landlock), which the
	// tree it restores inherits: CRIU's images do not carry the domain a process had,
	// and a restored process without one could trace every command the sandbox runs
	// next. Never for a dump: CRIU in a domain could not trace the tree it dumps.
	domain bool
}

// fdOf is the number the i-th of files has in CRIU.
func fdOf(i int) int32 { return int32(4 + i) }

// unshareBin runs CRIU in a new mount namespace with a /proc of its PID namespace
// (util-linux, installed by scripts/setup.sh).
const unshareBin = "unshare"

func (c *call) run(ctx context.Context) (*rpc.CriuResp, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("%s: socketpair: %w", c.what, err)
	}
	cln := os.NewFile(uintptr(fds[0]), "criu-client")
	srv := os.NewFile(uintptr(fds[1]), "criu-server")
	defer func() { _ = cln.Close() }() // a socket: nothing written back

	argv := []string{c.r.Bin, "swrk", "3"}
	if c.pidNS != nil {
		argv = append([]string{unshareBin, "--mount-proc", "--propagation", "private"}, argv...)
	}
	if c.domain {
		argv = landlock.Command(argv...)
	}
	until := time.Now().Add(c.timeout)
	cmd := deadline.Command(ctx, c.timeout, argv[0], argv[1:]...)
	cmd.What = c.what
	cmd.Env = append(append(criu.Environ(), c.r.Env()...), c.env...)
	cmd.ExtraFiles = append([]*os.File{srv}, c.files...)
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := c.start(cmd); err != nil {
		_ = srv.Close() // CRIU has its own copy
		return nil, err
	}
	_ = srv.Close() // CRIU's alone now: its exit is our EOF
	// Recorded before it gets its request, until it is reaped (runs.go).
	unrecord, err := recordRun(c.r.Runs, cmd.Process.Pid, c.what, until)
	if err != nil {
		_ = cln.Close() // CRIU exits when the socket closes, having done nothing
		_ = cmd.Wait()  // the record's error is the one to report; this reaps
		return nil, fmt.Errorf("%s: %w", c.what, err)
	}
	defer unrecord() // at return, once cmd.Wait below has reaped CRIU
	if c.background {
		lowerPriority(cmd.Process.Pid)
	}
	if err := joinCgroups(cmd.Process.Pid, c.cgroups); err != nil {
		_ = cln.Close() // CRIU exits when the socket closes
		_ = cmd.Wait()  // the cgroup error is the one to report; this reaps
		return nil, fmt.Errorf("%s: %w", c.what, err)
	}

	resp, rerr := c.exchange(cln)
	_ = cln.Close() // CRIU exits when the socket closes
	werr := cmd.Wait()
	if rerr == nil && werr != nil {
		// swrk exits 0 after a served request; a failure after the answer is CRIU's
		// own trouble, reported all the same.
		rerr = fmt.Errorf("criu swrk exited: %w", werr)
	}
	if rerr != nil {
		var te *deadline.TimeoutError
		if errors.As(werr, &te) {
			rerr = werr
		} else if werr != nil && !strings.HasPrefix(rerr.Error(), "criu swrk exited") {
			rerr = fmt.Errorf("%w (criu swrk: %v)", rerr, werr)
		}
		return resp, fmt.Errorf("%s: %w%s; the end of its log %s: %s", c.what, rerr, outputNote(out.String()),
			filepath.Join(c.dir, c.log), c.logTail())
	}
	return resp, nil
}

// start starts cmd; with pidNS (and cgroupNS), from a thread whose pid_for_children
// (and cgroup namespace) are the sandbox's for the fork, and ours again after it; with
// netNS, likewise in that network namespace; with owner, from a thread whose uids are
// owner for the fork (becomeOwner), and 0 again after it. The thread is given back rather than discarded: a thread's exit sends the
// parent-death signal (PR_SET_PDEATHSIG) of every child it forked, and a discarded
// thread that had started, say, a test's daemon with Pdeathsig killed that daemon, its
// sandboxes' inits and this CRIU with them (seen once in six runs). Only when the way
// back fails is the thread discarded.
func (c *call) start(cmd *deadline.Cmd) error {
	if c.pidNS == nil && c.netNS == nil && c.owner == 0 {
		return cmd.Start()
	}
	type ns struct {
		to    *os.File
		own   string
		flag  int
		name  string
		owned *os.File
	}
	var nss []*ns
	if c.pidNS != nil {
		nss = append(nss, &ns{to: c.pidNS, own: "/proc/self/ns/pid", flag: unix.CLONE_NEWPID, name: "PID"})
	}
	if c.pidNS != nil && c.cgroupNS != nil {
		nss = append(nss, &ns{to: c.cgroupNS, own: "/proc/thread-self/ns/cgroup", flag: unix.CLONE_NEWCGROUP, name: "cgroup"})
	}
	if c.netNS != nil {
		nss = append(nss, &ns{to: c.netNS, own: "/proc/thread-self/ns/net", flag: unix.CLONE_NEWNET, name: "network"})
	}
	for _, n := range nss {
		f, err := os.Open(n.own)
		if err != nil {
			return fmt.Errorf("%s: our %s namespace: %w", c.what, n.name, err)
		}
		defer func() { _ = f.Close() }() // read-only (setns)
		n.owned = f
	}
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		uidBack := func() bool { return true }
		back := func() {
			if !uidBack() {
				threadsDiscarded.Add(1)
				return // exits locked, and the thread with it (package mainthread)
			}
			for _, n := range nss {
				if unix.Setns(int(n.owned.Fd()), n.flag) != nil {
					threadsDiscarded.Add(1)
					return
				}
			}
			runtime.UnlockOSThread()
		}
		for _, n := range nss {
			if err := unix.Setns(int(n.to.Fd()), n.flag); err != nil {
				back()
				errc <- fmt.Errorf("%s: setns into the sandbox's %s namespace for CRIU: %w", c.what, n.name, err)
				return
			}
		}
		if c.owner != 0 {
			ambient, ub, err := becomeOwner(c.owner)
			if err != nil {
				back()
				errc <- fmt.Errorf("%s: %w", c.what, err)
				return
			}
			uidBack = ub
			if cmd.SysProcAttr == nil {
				cmd.SysProcAttr = &syscall.SysProcAttr{}
			}
			cmd.SysProcAttr.AmbientCaps = ambient
		}
		err := cmd.Start()
		// Back before start returns: its deferred Close of our namespaces' files
		// would otherwise race this setns (EBADF, or another file by then), and a
		// failed way back discards the thread (seen: 1 run in 5 lost its daemon).
		back()
		errc <- err
	}()
	return <-errc
}

// threadsDiscarded counts the threads start could not give back (tests check it).
var threadsDiscarded atomic.Int32

// I/O priority classes and the ioprio_set target (linux/ioprio.h).
const (
	ioprioWhoProcess = 1
	ioprioClassIdle  = 3
	ioprioClassShift = 13
)

// lowerPriority sets pid's nice to 19 and its I/O class to idle (a thread id sets that
// thread's alone: both are per thread); what it forks after inherits both. Best effort:
// a dump at normal priority is still a dump.
func lowerPriority(pid int) {
	_ = unix.Setpriority(unix.PRIO_PROCESS, pid, 19) // best effort, as said
	_, _, _ = unix.Syscall(unix.SYS_IOPRIO_SET, ioprioWhoProcess, uintptr(pid), ioprioClassIdle<<ioprioClassShift)
}

// exchange sends the request and answers CRIU's notifications until its final answer.
func (c *call) exchange(sk *os.File) (*rpc.CriuResp, error) {
	req := &rpc.CriuReq{Type: &c.typ, Opts: c.opts}
	buf := make([]byte, 64<<10)
	var notifyErr error
	for {
		b, err := proto.Marshal(req)
		if err != nil {
			return nil, err
		}
		if _, err := sk.Write(b); err != nil {
			return nil, fmt.Errorf("send the request to criu swrk: %w", err)
		}
		n, err := sk.Read(buf)
		if err != nil {
			return nil, fmt.Errorf("criu swrk gave no answer (it exited or was killed): %w", err)
		}
		if n == 0 {
			return nil, errors.New("criu swrk closed the socket without an answer")
		}
		resp := &rpc.CriuResp{}
		if err := proto.Unmarshal(buf[:n], resp); err != nil {
			return nil, fmt.Errorf("criu swrk's answer: %w", err)
		}
		if !resp.GetSuccess() && notifyErr != nil {
			return resp, fmt.Errorf("%w (criu %s failed: errno %d%s)", notifyErr, strings.ToLower(c.typ.String()), resp.GetCrErrno(),
				errmsg(resp.GetCrErrmsg()))
		}
		if !resp.GetSuccess() {
			return resp, fmt.Errorf("criu %s failed (errno %d%s)", strings.ToLower(c.typ.String()), resp.GetCrErrno(),
				errmsg(resp.GetCrErrmsg()))
		}
		if resp.GetType() != rpc.CriuReqType_NOTIFY {
			if resp.GetType() != c.typ {
				return resp, fmt.Errorf("criu swrk answered %v to %v", resp.GetType(), c.typ)
			}
			if notifyErr != nil { // CRIU went on (a notification whose failure it only logs)
				return resp, notifyErr
			}
			return resp, nil
		}
		// Any notification c.notify does not fail is answered with success; a failed
		// one makes CRIU abort, whose answer is then read (CRIU's cleanup is done) and
		// reported with the cause.
		if c.notify != nil && notifyErr == nil {
			if err := c.notify(resp.GetNotify().GetScript()); err != nil {
				notifyErr = fmt.Errorf("at CRIU's %s: %w", resp.GetNotify().GetScript(), err)
			}
		}
		t := rpc.CriuReqType_NOTIFY
		req = &rpc.CriuReq{Type: &t, NotifySuccess: proto.Bool(notifyErr == nil)}
	}
}

func errmsg(s string) string {
	if s == "" {
		return ""
	}
	return ": " + s
}

func outputNote(s string) string {
	s = strings.TrimSpace(s)
	if s == "" {
		return ""
	}
	return "; its output: " + strconv.Quote(criu.Tail(s, 500))
}

// logTail is the end of CRIU's log, its error lines first.
func (c *call) logTail() string {
	b, err := os.ReadFile(filepath.Join(c.dir, c.log))
	if err != nil {
		return "(no log: " + err.Error() + ")"
	}
	var errs []string
	for _, l := range strings.Split(string(b), "\n") {
		// "Can't setup RLIMIT_NOFILE" is logged on every run here (no CAP_SYS_RESOURCE
		// in the bounding set) and harmless.
		if strings.Contains(l, "Error") && !strings.Contains(l, "RLIMIT_NOFILE") {
			errs = append(errs, strings.TrimSpace(l))
		}
	}
	s := strings.Join(errs, " | ")
	if s == "" {
		s = criu.Tail(strings.TrimSpace(string(b)), 1000)
	}
	return strconv.Quote(criu.Tail(s, 1500))
}
