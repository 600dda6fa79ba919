package sbinit

import (
	"encoding/json"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// A branch init is the init of one branch of a fast fork (docs/design/fork.md): PID 1 of
// a PID namespace P_i that is a child of the family's P_S, with its own user namespace
// U_i (a child of the family's U_S, mapping 0..size-1 onto the same ids: every branch
// runs as the family's host range), mount, UTS, IPC, network and cgroup namespaces. It
// runs the same Main as any init and speaks the same protocol to the daemon, on a
// socket the daemon made; only its start differs:
//
//	daemon                                   family init (PID 1 of P_S)
//	  |-- {id,op:branch,data:Config} --------->|   fds: the branch's control socket end,
//	  |     + fds                              |   its log, its v1 tasks files
//	  |                                        |-- clone NEWUSER|NEWPID|NEWNS|NEWUTS|
//	  |                                        |   NEWIPC|NEWNET|NEWCGROUP, exec Main
//	  |<------------- {id,pid} + pidfd --------|
//	  |<======= {op:ready} on the branch's own socket ==========  branch init
//
// Made by the family init, not the daemon: a child can be placed only in its maker's PID
// namespace or a descendant, and P_i must be a child of P_S for the family's templates
// (in P_S) to fork into it with clone3 set_tid. Its user namespace must be a child of
// U_S for the same reason (set_tid needs CAP_CHECKPOINT_RESTORE in the owner of P_i,
// which the templates, root of U_S, have over U_i).
//
// /proc: a new proc instance may be mounted from a child user namespace only if the
// mount namespace already holds a fully visible one (the kernel's mount_too_revealing):
// a proc whose children mounts, locked when copied into a less privileged namespace,
// cover nothing but empty directories. The base namespace's /proc is masked (MaskProc:
// files covered by /dev/null), so the clone is made from a thread of the family init
// that has a private mount namespace (same owner as the base: nothing locked) whose
// root is a small tmpfs holding a fresh, unmasked proc of P_S and what the exec needs
// (branchexec.go). No process of the sandbox can enter that namespace (it lives only on
// that thread, kept for the init's next branches: branchMaker). The branch init's
// setupRoot then mounts its own proc, masks it, and pivots into a fresh tmpfs,
// detaching its copy of the exec root, the unmasked proc with it. Measured: 86-281 ms for three branches (inits, states and
// copies placed) on a loaded 2-core VM (TestForkFastPlacesCopies).

// BranchOptions configures a branch init.
type BranchOptions struct {
	Config Config // as for Start; TaskFDs are set from CgroupTasks
	// Log receives the branch init's stdout and stderr (as StartOptions.Log).
	Log *os.File
	// CgroupTasks are the branch's v1 limit groups' "tasks" files (StartOptions).
	CgroupTasks []*os.File
}

// Branch asks this init (a family's) to make a branch init, and returns the daemon's
// client of it once it reported ready. The branch init is in the family init's cgroups
// until the caller moves it (its Pid is its host PID).
func (c *Client) Branch(o BranchOptions) (_ *Client, err error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			unix.Close(fds[0])
		}
	}()
	// The branch init holds its own copy of fds[1]; the daemon's goes once handed over
	// (below): kept until Branch returned, it kept awaitReady's recv from seeing the
	// branch init's end, and a branch init killed before it was ready (its family
	// ending meanwhile: a spare being made as the daemon stops) hung Branch for good.
	peerOpen := true
	closePeer := func() {
		if peerOpen {
			unix.Close(fds[1])
			peerOpen = false
		}
	}
	defer closePeer()
	if err := unix.SetsockoptInt(fds[0], unix.SOL_SOCKET, unix.SO_PASSCRED, 1); err != nil {
		return nil, fmt.Errorf("branch init socket: SO_PASSCRED: %w", err)
	}
	logR, logW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer logW.Close()
	tree, clones, err := cloneExecTree()
	if err != nil {
		logR.Close()
		return nil, err
	}
	defer closeAll(clones)
	send := append([]int{fds[1], int(logW.Fd())}, clones...)
	for _, f := range o.CgroupTasks {
		send = append(send, int(f.Fd()))
	}
	arg, _ := json.Marshal(branchRequest{Config: o.Config, Tree: tree})
	r, err := c.call(&Message{Op: "branch", Data: string(arg)}, send, nil)
	closePeer()
	if err != nil {
		logR.Close()
		if r != nil {
			closeAll(r.fds)
		}
		return nil, fmt.Errorf("a branch init from the family's init: %w", err)
	}
	if len(r.fds) != 1 {
		logR.Close()
		closeAll(r.fds)
		return nil, fmt.Errorf("the family's init answered branch with %d fds, not 1", len(r.fds))
	}
	pidfd := r.fds[0]
	info, err := getPidfdInfo(pidfd, pidfdInfoPid)
	if err != nil || info.Pid == 0 {
		logR.Close()
		unix.PidfdSendSignal(pidfd, unix.SIGKILL, nil, 0)
		unix.Close(pidfd)
		return nil, fmt.Errorf("the branch init's host PID (PIDFD_GET_INFO): %v", err)
	}
	var logDup *os.File
	if o.Log != nil {
		if fd, err := unix.FcntlInt(o.Log.Fd(), unix.F_DUPFD_CLOEXEC, 0); err == nil {
			logDup = os.NewFile(uintptr(fd), o.Log.Name())
		}
	}
	go copyLog(logR, logDup)
	p := &pidfdProc{fd: pidfd}
	bc := newClient(fds[0], int(info.Pid), p.kill)
	go func() { p.wait(); close(bc.done) }()
	if err := bc.awaitReady(); err != nil {
		bc.Kill()
		return nil, fmt.Errorf("branch init did not start (see its log): %w", err)
	}
	go bc.readLoop()
	return bc, nil
}

// pidfdProc is a process the daemon did not fork (a branch init, the family init's
// child), known by its pidfd: killed through it, waited for by polling it.
type pidfdProc struct {
	mu     sync.Mutex
	fd     int // -1 once the process has exited (the pidfd is closed)
	exited bool
}

func (p *pidfdProc) kill() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.fd < 0 {
		return nil
	}
	if err := unix.PidfdSendSignal(p.fd, unix.SIGKILL, nil, 0); err != nil && err != unix.ESRCH {
		return err
	}
	return nil
}

// wait returns once the process has exited (its parent, the family init, reaps it).
func (p *pidfdProc) wait() {
	pf := []unix.PollFd{{Fd: int32(p.fd), Events: unix.POLLIN}}
	for {
		if _, err := unix.Poll(pf, -1); err == unix.EINTR {
			continue
		}
		break
	}
	p.mu.Lock()
	unix.Close(p.fd)
	p.fd = -1
	p.mu.Unlock()
}

// awaitReady reads init's first message, ready or its setup error; past readyTimeout
// init is killed (which closes its end of the socket and ends the recv).
func (c *Client) awaitReady() error {
	var late sync.Mutex
	lateSet := false
	timer := time.AfterFunc(readyTimeout, func() { late.Lock(); lateSet = true; late.Unlock(); c.kill() })
	buf := newBuf()
	m, _, err := recv(c.fd, buf, nil)
	timer.Stop()
	late.Lock()
	defer late.Unlock()
	switch {
	case lateSet:
		return fmt.Errorf("sandbox init (pid %d) did not report ready within %v (killed)", c.pid, readyTimeout)
	case err != nil:
		return err
	case m.Err != "":
		return fmt.Errorf("sandbox init setup: %s", m.Err)
	}
	return nil
}

// branchRequest is a branch request's data.
type branchRequest struct {
	Config Config      `json:"config"`
	Tree   []execEntry `json:"tree"` // branchexec.go
}

// startBranch is the family init's side of "branch": fds are the branch's control
// socket end, its log, the exec tree's files (branchexec.go) and its v1 tasks files;
// m.Data a branchRequest. It returns the branch init's PID (in P_S) and a pidfd of it.
func startBranch(m *Message, fds []int) (pid, pidfd int, _ error) {
	var req branchRequest
	if err := json.Unmarshal([]byte(m.Data), &req); err != nil {
		return 0, -1, fmt.Errorf("branch request: %w", err)
	}
	cfg := req.Config
	nfiles := 0
	for _, e := range req.Tree {
		if e.Target == "" {
			nfiles++
		}
	}
	if len(fds) < 2+nfiles {
		return 0, -1, fmt.Errorf("branch needs %d fds or more (control socket, log, %d exec files, v1 tasks files), got %d", 2+nfiles, nfiles, len(fds))
	}
	size, err := ownIDSize()
	if err != nil {
		return 0, -1, err
	}
	files := []uintptr{uintptr(fds[1]), uintptr(fds[1]), uintptr(fds[1]), uintptr(fds[0])}
	cfg.TaskFDs = nil
	for i, fd := range fds[2+nfiles:] {
		files = append(files, uintptr(fd))
		cfg.TaskFDs = append(cfg.TaskFDs, ctlFD+1+i)
	}
	arg, _ := json.Marshal(cfg)
	type result struct {
		pid, pidfd int
		err        error
	}
	mk, err := makerFor(req.Tree, fds[2:2+nfiles])
	if err != nil {
		return 0, -1, err
	}
	exe := mk.exe
	if mk.memfd >= 0 {
		// The request's copy of the small init's memfd, at 100 or above (clear of the
		// fds the exec installs at 0, 1, 2, 3...), exec'd through the root's proc and
		// closed here after the exec: the family init keeps none (TestInitMemfdSealed).
		hi, err := unix.FcntlInt(uintptr(fds[2+mk.memfd]), unix.F_DUPFD_CLOEXEC, 100)
		if err != nil {
			return 0, -1, fmt.Errorf("dup the small init's memfd: %w", err)
		}
		defer unix.Close(hi)
		exe = "/proc/self/fd/" + strconv.Itoa(hi)
	}
	ch := make(chan result, 1)
	mk.jobs <- func() {
		m := []syscall.SysProcIDMap{{ContainerID: 0, HostID: 0, Size: size}}
		pidfd := -1
		attr := &syscall.ProcAttr{
			// One P: an init's work is syscalls and waits, and the Go runtime's start
			// with two (threads made, spinning in futex and usleep) was a fifth of a
			// branch init's CPU; 64 branches' sandbox CPU 558-645 ms against 660-738
			// (docs/research/fork/forkspeed2-ab.txt). The init passes none of its
			// environment on (Config.Env is its commands').
			Env:   []string{"GOMAXPROCS=1"},
			Files: files,
			Sys: &syscall.SysProcAttr{
				Cloneflags: unix.CLONE_NEWUSER | unix.CLONE_NEWPID | unix.CLONE_NEWNS | unix.CLONE_NEWUTS |
					unix.CLONE_NEWIPC | unix.CLONE_NEWNET | unix.CLONE_NEWCGROUP,
				UidMappings: m, GidMappings: m, GidMappingsEnableSetgroups: true,
				Credential: &syscall.Credential{Uid: 0, Gid: 0},
				Setsid:     true,
				PidFD:      &pidfd,
			},
		}
		pid, err := syscall.ForkExec(exe, []string{"deltabox-init", InitArg, string(arg)}, attr)
		if err != nil {
			err = fmt.Errorf("start the branch init: %w", err)
		}
		ch <- result{pid, pidfd, err}
	}
	r := <-ch
	if r.err != nil {
		// The next request builds the exec root afresh: whatever failed here may be
		// the root's.
		mk.stop()
		maker = nil
	}
	return r.pid, r.pidfd, r.err
}

// branchMaker is the family init's branch-making thread: locked, with a private mount
// namespace whose root is the exec root (buildExecRoot), built once, at the first
// branch request, and used for every branch after (a 64-branch fork built it 64 times:
// an unshare copying the base namespace's mounts, a tmpfs, 6 binds, a proc, a
// pivot_root walking every thread of the host, the base tree detached, and a thread
// made and ended, each time). It lives as long as the init, or until a request
// brings another exec tree (a new daemon, another binary) or a branch fails to start.
//
// Why it may stay: the namespace holds an unmasked proc of P_S, but no process of the
// sandbox can reach it. It is on this thread alone (no process is in it; each branch
// init's clone copies it and pivots away); entering it takes
// /proc/1/task/TID/ns/mnt, which needs ptrace access to the init, which is not dumpable
// (Main), in another Landlock domain than every command, to a sandbox root without
// CAP_SYS_PTRACE; a pidfd of the init names its main thread's namespaces, not this
// one's. It holds no fd of the small init's memfd: each request brings a copy, exec'd
// and closed.
type branchMaker struct {
	key string // the exec tree it was built from (execRootKey)
	exe string // what a branch init execs in it (the daemon's binary), or "" (memfd)
	// memfd is the index, among a request's exec tree files, of the small init's memfd
	// (exec'd as /proc/self/fd/N of a copy: the root holds no file of it), or -1.
	memfd int
	jobs  chan func() // run on the thread, one at a time
}

// maker is the init's branch maker, or nil. Used only by the init's request loop,
// which serves one request at a time.
var maker *branchMaker

// makerFor returns the branch maker for exec tree list (files fds), making it if there
// is none or the one there was built from another tree. fds stay the caller's.
func makerFor(list []execEntry, fds []int) (*branchMaker, error) {
	key, err := execRootKey(list, fds)
	if err != nil {
		return nil, err
	}
	if maker != nil && maker.key == key {
		return maker, nil
	}
	if maker != nil {
		maker.stop()
		maker = nil
	}
	mk := &branchMaker{key: key, memfd: -1, jobs: make(chan func())}
	k := 0
	for _, e := range list {
		if e.Memfd {
			mk.memfd = k
		}
		if e.Target == "" {
			k++
		}
	}
	ready := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread has a mount namespace of its own
		if err := unix.Unshare(unix.CLONE_FS | unix.CLONE_NEWNS); err != nil {
			ready <- fmt.Errorf("unshare a mount namespace for the branch init: %w", err)
			return
		}
		exe, memfd, err := buildExecRoot(list, fds)
		if memfd >= 0 {
			unix.Close(memfd) // each request brings its own (startBranch)
			exe = ""
		}
		if err != nil {
			ready <- err
			return // the thread ends with its namespace
		}
		mk.exe = exe
		ready <- nil
		for job := range mk.jobs {
			job()
		}
	}()
	if err := <-ready; err != nil {
		return nil, err
	}
	maker = mk
	return mk, nil
}

// stop ends the maker's thread, and its namespace with it.
func (mk *branchMaker) stop() { close(mk.jobs) }

// execRootKey names what an exec root built from list and fds holds: the list and each
// file's device and inode (the small init's memfd, or the daemon's binary and its
// libraries), so that a new daemon's tree, or another binary, builds a new root.
func execRootKey(list []execEntry, fds []int) (string, error) {
	var b strings.Builder
	for _, e := range list {
		fmt.Fprintf(&b, "%s>%s,%v;", e.Path, e.Target, e.Memfd)
	}
	for _, fd := range fds {
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil {
			return "", fmt.Errorf("exec tree file: %w", err)
		}
		fmt.Fprintf(&b, "%d:%d;", st.Dev, st.Ino)
	}
	return b.String(), nil
}

// ownIDSize is how many ids this init's user namespace maps (its uid_map's one line).
func ownIDSize() (int, error) {
	b, err := os.ReadFile("/proc/self/uid_map")
	if err != nil {
		return 0, err
	}
	f := strings.Fields(string(b))
	if len(f) != 3 {
		return 0, fmt.Errorf("/proc/self/uid_map: want one line of 3 fields, got %q", b)
	}
	return strconv.Atoi(f[2])
}
