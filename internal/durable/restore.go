package durable

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"time"

	"github.com/checkpoint-restore/go-criu/v7/rpc"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"deltabox/internal/criu"
)

// Sandbox is where Restore puts a tree back: the sandbox's namespaces, as open nsfs
// files (/proc/PID/ns/NAME of any process in them, or the daemon's own handles), and a
// terminal for each the image names.
type Sandbox struct {
	// PID is the sandbox's PID namespace: the tree gets its PIDs back there (clone3
	// set_tid), as children of the sandbox's init.
	PID *os.File
	// User, Net, IPC, UTS: the sandbox's. Mnt: the mount namespace of the state the
	// tree is restored onto (its files are opened there by path).
	User, Net, IPC, UTS, Mnt *os.File
	// Time is the sandbox's time namespace (the host's). Without it CRIU gives the
	// root task a time namespace of its own, its clocks shifted back to the dump's,
	// owned by the host's user namespace: the sandbox's other processes then disagree
	// with it on CLOCK_MONOTONIC, and the next dump of it fails ("One or more
	// namespaces doesn't belong to the target user namespace").
	Time *os.File
	// TTYs gives, for each of the manifest's TTYs, the slave of the terminal the
	// restored tree gets in its place. It must be owned by the sandbox's root (CRIU
	// sets its owner as the image has it, from inside the sandbox's user namespace).
	TTYs map[string]*os.File
	// Cgroups are the cgroup directories (CgroupsOf a process of the sandbox) that
	// CRIU is moved into before it forks the tree, which then starts there. CRIU's own
	// cgroup handling cannot do it: a child task moves itself after its parent joined
	// the sandbox's user namespace, and the host's cgroup.procs refuses it ("Can't
	// move 20 into unified//deltabox-.../cgroup.procs: Permission denied"). CRIU's
	// memory is charged to the sandbox meanwhile.
	Cgroups []string
	// Root is the root of the state the tree is restored onto (Mnt's), where the files
	// the image holds as external (Manifest.ExtFiles) are opened; needed only when it
	// has some.
	Root *os.File
	// AsRoot runs fn with the daemon's file credentials set to the sandbox's root, for
	// what Restore creates on the state (removed.go): through idmapped layers the
	// daemon's own ids are not mapped (EOVERFLOW). Nil: fn runs as it is.
	AsRoot func(fn func() error) error
	// Cgroup is the sandbox's cgroup namespace, in which CRIU starts and the tree with
	// it; without it the tree would see the host's cgroup paths.
	Cgroup *os.File
}

// RestoreOptions are Restore's choices.
type RestoreOptions struct {
	LogLevel int32         // CRIU's (0-4); 0 means 2
	Timeout  time.Duration // 0 means RestoreTimeout
	// LeaveStopped leaves the restored tree stopped (each task gets SIGSTOP before
	// CRIU lets it go), whatever it was at the dump: the caller resumes it (SIGCONT)
	// once the operation it is part of completes.
	LeaveStopped bool
	// Lazy restores the tree's anonymous memory on demand (lazy.go): the restore
	// returns before the pages are in, and RestoreStats.Lazy is the server that copies
	// them. Read lazy.go's doc before using it.
	Lazy bool
}

// RestoreStats says what a restore did and took.
type RestoreStats struct {
	HostPid int     // the restored root task's PID on the host
	CRIUS   float64 // CRIU's whole run, seconds
	// Lazy, for a lazy restore, is the server still copying the tree's pages: the
	// tree is not to be trusted until its Done reports success.
	Lazy *Lazy
}

// Restore puts the tree imaged in dir back into sb, with its PIDs: the root task's PID
// in the sandbox must be free. The tree runs when Restore returns (stopped if it was
// stopped at the dump), as a child of the sandbox's init.
//
// CRIU 4.1.1 needs the patch scripts/criu/0001-join-ns-root-task-clone-flags.patch for
// this (scripts/setup.sh applies it): without it the root task is cloned into a new user
// namespace before it joins the sandbox's ("Can't setns 19/net: Operation not
// permitted").
func Restore(ctx context.Context, r *criu.Runner, dir string, sb Sandbox, o RestoreOptions) (*RestoreStats, error) {
	if !r.Usable() {
		return nil, fmt.Errorf("CRIU cannot restore on this machine: %s", r)
	}
	m, err := ReadManifest(dir)
	if err != nil {
		return nil, err
	}
	if len(sb.Cgroups) == 0 {
		return nil, errors.New("restore needs the sandbox's cgroups (CgroupsOf one of its processes)")
	}
	if sb.PID == nil || sb.User == nil || sb.Net == nil || sb.IPC == nil || sb.UTS == nil || sb.Mnt == nil || sb.Time == nil || sb.Cgroup == nil {
		return nil, errors.New("restore needs all of the sandbox's namespaces (pid, user, net, ipc, uts, mnt, time, cgroup)")
	}
	// CRIU runs in a mount namespace of its own (a /proc of the sandbox): a directory
	// reached through /proc/self/fd/N of ours is a mount of our namespace there, and
	// CRIU's mounts under it (its cgroup yard, in the images directory) fail with
	// EINVAL. It wants a path it can readlink: a symlink to dir, resolved in its
	// namespace.
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, err
	}
	// The root task reads some images (tty-info.img) after it joined the sandbox's
	// user namespace, as the sandbox's root: the directory must let others search it
	// (CRIU's images are 0644; the store's parents stay closed to the host's users),
	// for the restore's time.
	fi, err := os.Stat(abs)
	if err != nil {
		return nil, err
	}
	if err := os.Chmod(abs, 0o711); err != nil {
		return nil, err
	}
	defer func() { _ = os.Chmod(abs, fi.Mode().Perm()) }() // 0711 only lets the restore traverse it; the next restore sets it again
	tmp, err := os.MkdirTemp("", "deltabox-restore-")
	if err != nil {
		return nil, err
	}
	defer func() { _ = os.RemoveAll(tmp) }() // a temporary symlink in /tmp
	link := filepath.Join(tmp, "images")
	if err := os.Symlink(abs, link); err != nil {
		return nil, err
	}
	files := []*os.File{sb.PID}
	opts := &rpc.CriuOpts{
		ImagesDirFd: proto.Int32(-1),
		ImagesDir:   proto.String(link),
		LogLevel:    proto.Int32(logLevel(o.LogLevel)),
		LogFile:     proto.String(RestoreLog),
		InheritFd:   []*rpc.InheritFd{{Key: proto.String(pidKey), Fd: proto.Int32(fdOf(0))}},
		// Mounts the image names are found again by their mount points in the state
		// joined below.
		AutoExtMnt:  proto.Bool(true),
		NetworkLock: rpc.CriuNetworkLockMethod_SKIP.Enum(),
		// The tree inherits CRIU's cgroups: Sandbox.Cgroups says why.
		ManageCgroupsMode: rpc.CriuCgMode_IGNORE.Enum(),
		LeaveStopped:      proto.Bool(o.LeaveStopped),
		// A shell job's root comes back leading a session of its own (patch 0004):
		// CRIU's session is outside the sandbox's PID namespace.
		ShellJob: proto.Bool(m.ShellJob),
	}
	// Connections dumped (DumpOptions.TCPEstablished) are repaired back (tcp.go),
	// once the closed ends of the same connections (a rollback ended their processes)
	// are out of their way.
	if len(m.TCP) > 0 {
		if err := destroyOrphans(int(sb.Net.Fd()), m.TCP); err != nil {
			return nil, fmt.Errorf("the image in %s: %w", dir, err)
		}
		opts.TcpEstablished = proto.Bool(true)
	}
	// Locks dumped (DumpOptions.FileLocks) are taken again only when the restore asks.
	if _, err := os.Stat(filepath.Join(dir, "filelocks.img")); err == nil {
		opts.FileLocks = proto.Bool(true)
	}
	// CRIU opens the join_ns files itself, in its own mount namespace with a /proc of
	// the sandbox's PID namespace: /proc/self/fd/N is its own fd N there.
	for _, j := range []struct {
		ns string
		f  *os.File
	}{{"user", sb.User}, {"net", sb.Net}, {"ipc", sb.IPC}, {"uts", sb.UTS}, {"mnt", sb.Mnt}, {"time", sb.Time}} {
		opts.JoinNs = append(opts.JoinNs, &rpc.JoinNamespace{Ns: proto.String(j.ns),
			NsFile: proto.String(fmt.Sprintf("/proc/self/fd/%d", fdOf(len(files))))})
		files = append(files, j.f)
	}
	for _, k := range m.TTYs {
		f := sb.TTYs[k]
		if f == nil {
			return nil, fmt.Errorf("the image in %s holds terminal %s: restore needs a terminal for it", dir, k)
		}
		opts.InheritFd = append(opts.InheritFd, &rpc.InheritFd{Key: proto.String(k), Fd: proto.Int32(fdOf(len(files)))})
		files = append(files, f)
	}
	for k, path := range m.ExtFiles {
		if sb.Root == nil {
			return nil, fmt.Errorf("the image in %s holds %s as external: restore needs the state's root", dir, path)
		}
		f, err := openExternal(sb.Root, path)
		if err != nil {
			return nil, err
		}
		defer func() { _ = f.Close() }() // CRIU has its own copy
		opts.InheritFd = append(opts.InheritFd, &rpc.InheritFd{Key: proto.String(k), Fd: proto.Int32(fdOf(len(files)))})
		files = append(files, f)
	}
	for _, rm := range m.Removed {
		if sb.Root == nil {
			return nil, fmt.Errorf("the image in %s holds the removed file %s: restore needs the state's root", dir, rm.Path)
		}
		var f *os.File
		mk := func() (err error) {
			f, err = makeRemoved(sb.Root, dir, rm)
			return err
		}
		if sb.AsRoot != nil {
			err = sb.AsRoot(mk)
		} else {
			err = mk()
		}
		if err != nil {
			return nil, err
		}
		defer func() { _ = f.Close() }() // CRIU has its own copy
		opts.InheritFd = append(opts.InheritFd, &rpc.InheritFd{Key: proto.String(rm.Key), Fd: proto.Int32(fdOf(len(files)))})
		files = append(files, f)
	}
	c := &call{r: r, typ: rpc.CriuReqType_RESTORE, opts: opts, files: files, pidNS: sb.PID, cgroupNS: sb.Cgroup, cgroups: sb.Cgroups,
		what: fmt.Sprintf("criu restore of sandbox pid %d from %s", m.Pid, dir), dir: dir, log: RestoreLog,
		timeout: cmp(o.Timeout, RestoreTimeout), domain: true}
	// Each process's oom_score_adj, which CRIU cannot give back in the sandbox's user
	// namespace (oomscore.go), is given at CRIU's post-restore.
	oom, err := imageOOMScores(dir)
	if err != nil {
		return nil, err
	}
	oom = notInherited(oom)
	// The times of the bound unix sockets' files and directories are put back then
	// too (unixsk.go).
	var socks []*boundSocket
	if sb.Root != nil {
		if socks, err = boundSockets(sb.Root, dir); err != nil {
			return nil, err
		}
		defer func() {
			for _, s := range socks {
				s.close()
			}
		}()
	}
	if len(oom) > 0 || len(socks) > 0 {
		opts.NotifyScripts = proto.Bool(true)
		c.notify = func(script string) error {
			if script != "post-restore" {
				return nil
			}
			for _, s := range socks {
				s.putBack()
			}
			return setOOMScores(sb.PID, oom)
		}
	}
	if m.ShellJob {
		c.env = []string{shellJobSetsidEnv}
	}
	start := time.Now()
	var lazy *Lazy
	if o.Lazy {
		// The server reads the pages by the real path; the restore reaches its socket
		// through the link (both chdir into the images directory).
		if lazy, err = startLazy(r, abs, logLevel(o.LogLevel)); err != nil {
			return nil, err
		}
		opts.LazyPages = proto.Bool(true)
	}
	resp, err := c.run(ctx)
	if err != nil {
		if lazy != nil {
			lazy.Kill()
		}
		if resp != nil && resp.GetCrErrno() == int32(unix.EEXIST) {
			err = &PidTakenError{Pid: takenPid(err.Error(), m.Pid), Err: err}
		}
		return nil, err
	}
	st := &RestoreStats{CRIUS: time.Since(start).Seconds(), Lazy: lazy}
	// CRIU answers with the root task's PID as it sees it: in the sandbox's namespace.
	st.HostPid = hostPidOf(sb.PID, int(resp.GetRestore().GetPid()))
	return st, nil
}

// hostPidOf finds the host PID of the process whose PID is inner in the namespace of
// pidNS (0 if none): the restored root task is a child of the sandbox's init, and
// /proc shows NSpid of every process.
func hostPidOf(pidNS *os.File, inner int) int {
	var want unix.Stat_t
	if unix.Fstat(int(pidNS.Fd()), &want) != nil {
		return 0
	}
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		var p int
		if _, err := fmt.Sscanf(e.Name(), "%d", &p); err != nil {
			continue
		}
		// Through one open /proc/PID directory, which names that process only: a PID
		// reused between two looks by path would be another's (oomscore.go).
		d, err := unix.Open("/proc/"+e.Name(), unix.O_DIRECTORY|unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			continue
		}
		in := innerPidIn(d, &want)
		unix.Close(d)
		if in == inner && in != 0 {
			return p
		}
	}
	return 0
}

// cantFork is CRIU's log line for a task it could not create with its PID (clone3
// set_tid failed: EEXIST when the PID is taken).
var cantFork = regexp.MustCompile(`Can't fork for (\d+): File exists`)

// takenPid is the PID that CRIU's failed restore found taken, as its log names it in msg
// (any task of the tree: a child's, not only the root's), or root if it does not.
// PidTakenError is a restore that failed because a PID of the image is taken in the
// sandbox (CRIU's clone3 set_tid: EEXIST). The caller, which knows the sandbox's
// processes, can say what holds it (proctree.Holders).
type PidTakenError struct {
	Pid int // the sandbox PID CRIU could not give back
	Err error
}

func (e *PidTakenError) Error() string {
	return fmt.Sprintf("%v (pid %d is taken in the sandbox)", e.Err, e.Pid)
}

func (e *PidTakenError) Unwrap() error { return e.Err }

func takenPid(msg string, root int) int {
	if m := cantFork.FindStringSubmatch(msg); m != nil {
		if n, err := strconv.Atoi(m[1]); err == nil {
			return n
		}
	}
	return root
}
