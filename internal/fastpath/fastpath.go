// Package fastpath checkpoints and restores a sandbox's live processes by template fork
// (DeltaCR's fast path), with the injected syscalls of package remote.
//
// At a checkpoint each process forks by injection (clone3 with CLONE_PARENT, so the
// child is, like the process, a child of the sandbox's init). The *child* becomes the
// template: it leaves the process's session (injected setsid, so that the session id
// dies with the live process at a restore) and stays seized by the daemon's tracer in a
// ptrace-stop for its whole life, with a SIGSTOP queued so that a detach (the daemon's
// death included) leaves it stopped (Template.tr says why): it never runs an instruction
// of its own. The original goes on live, moved onto the new state: an
// injected setns into the new mount namespace, chdir back to its cwd, every file or
// directory fd reopened there at the same offset and flags, so that it shares no open
// file description with its template and nothing it writes reaches a frozen layer, and
// every shared file mapping that can write mapped again from the new state (mappings.go).
// It keeps its PID.
//
// At a restore the live process has been killed and reaped; the template forks again
// with clone3 set_tid = the live PID, and the child is moved onto the restored state the
// same way, takes a session of its own with the sandbox's terminal as controlling
// terminal and foreground group, and has its pending terminal input flushed.
//
// What fork does not copy is recorded at the checkpoint and given back to each restored
// child: interval and POSIX timers with the time they had left (timers.go) and pending
// signals with their siginfo (signals.go).
//
// Eligibility (inspect, in Hold) is checked before anything changes: one thread, no
// children, its root the state's (no chroot), only file descriptors this package knows
// how to treat (regular files and directories: reopened; /dev/null and the other
// stateless character devices: reopened at their /dev path; the session's terminal:
// shared by design), each on a mount the new state has (mounts.go), only shared mappings
// it can map again from a file of the new state (writable shared anonymous memory, SysV
// shm, memfds, deleted files and devices are refused), and only POSIX timers it can
// re-create (not on another process's CPU clock or an fd's clock, not signalling another
// thread; kernels before 6.16 cannot restore timer ids). Anything else (pipes, sockets,
// eventfd, inotify, deleted files, a path longer than the kernel reports...) makes the
// process ineligible with a reason that names it: a file is judged by what it is (its
// mount, its link count, its device number), never skipped because its /proc link could
// not be read. File locks (flock, POSIX, OFD) are set again on the reopened files;
// leases make the process ineligible (locks.go). What fork does not copy at all
// (MADV_DONTFORK memory) or gives back wiped (MADV_WIPEONFORK) is found right after the
// template's fork, and refuses too (forkcopy.go).
package fastpath

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"

	"deltabox/internal/errdefs"
	"deltabox/internal/procfs"
	"deltabox/internal/remote"
)

// FD is one file descriptor of a process and its treatment.
type FD struct {
	Num  int
	Kind string // "file", "dir", "pty", "dev", "sock" (a closed TCP socket: deadsock.go)
	Path string // as the process sees it
	// Domain is a "sock"'s address family (AF_INET, AF_INET6).
	Domain int
	Flags  int // open flags (fdinfo)
	Pos    int64
	Locks  []Lock // file locks held through it (locks.go); none on a Dup
	// Dup: the fd shares its open file description with the lower fd DupOf (locks.go),
	// and is made again as a dup of it.
	Dup   bool
	DupOf int
}

// Proc is what a checkpoint records of a process.
type Proc struct {
	HostPid int // in the daemon's PID namespace
	Pid     int // in the sandbox's
	Cwd     string
	FDs     []FD
	Maps    []Mapping    // shared file mappings that can write: mapped again on each state
	Timers  []PosixTimer // POSIX timers (their setting is recorded at the fork: Template)
	pending [2]uint64    // SigPnd, ShdPnd: signals pending for the thread, the process
}

// Ineligible is returned by Hold (and Fork) when the fast path cannot take a process.
// It is a conflict (errors.Is(err, errdefs.ErrConflict): HTTP 409) however it is
// wrapped: the sandbox is in a state a checkpoint cannot keep, and nothing was changed.
type Ineligible struct {
	Pid    int
	Reason string
	// CRIU: what the fast path cannot take is what CRIU can (several threads, children,
	// a pipe, a socket or another kernel object a fork would share): a checkpoint may
	// carry the process in a CRIU tree instead (internal/state/criutrees.go).
	CRIU bool
}

func (e *Ineligible) Error() string {
	return fmt.Sprintf("process %d cannot be checkpointed with its state: %s", e.Pid, e.Reason)
}

// Is makes an Ineligible an errdefs.ErrConflict.
func (e *Ineligible) Is(target error) bool { return target == errdefs.ErrConflict }

// statelessDevs are character devices a process may hold across a checkpoint: reading or
// writing them carries no state that fork would share. By device number (major, minor:
// Documentation/admin-guide/devices.txt), not path: an fd opened on a state whose
// namespace has since been torn down reads as "/null" (its /dev clone is detached). Such
// an fd is reopened like a file, at the path named here, so that it reads as that path
// on the new state: "/dev/null", not "/null".
// (/dev/tty, 5:0, is not one: it is the controlling terminal, a "pty" fd.)
var statelessDevs = map[[2]uint32]string{{1, 3}: "/dev/null", {1, 5}: "/dev/zero", {1, 7}: "/dev/full",
	{1, 8}: "/dev/random", {1, 9}: "/dev/urandom"}

// statelessDev returns the path of the stateless device sx (of an fd) is, or "".
func statelessDev(sx *unix.Statx_t) string {
	if sx.Mode&unix.S_IFMT != unix.S_IFCHR {
		return ""
	}
	return statelessDevs[[2]uint32{sx.Rdev_major, sx.Rdev_minor}]
}

// lookupFunc answers which file path names for the process itself (its root, cwd and
// credentials, not the daemon's): device and inode, or found false. Hold asks the
// stopped process (lookupIn); inspect asks only to tell a file whose name ends in
// " (deleted)" from a deleted one.
type lookupFunc func(path string) (dev, ino uint64, found bool, err error)

// lookupIn answers lookupFunc with an injected fstatat(AT_SYMLINK_NOFOLLOW) in the
// stopped tracee t: the daemon never resolves a sandbox path itself. Precondition: inside
// Do.
func lookupIn(t *remote.Tracee) lookupFunc {
	return func(path string) (uint64, uint64, bool, error) {
		var b remote.Batch
		out := b.Out(int(unsafe.Sizeof(unix.Stat_t{})))
		b.Add("stat "+path, unix.SYS_NEWFSTATAT, unix.AT_FDCWD, path, out, unix.AT_SYMLINK_NOFOLLOW)
		_, err := t.RunBatch(&b)
		var be *remote.BatchError
		if errors.As(err, &be) {
			return 0, 0, false, nil
		}
		if err != nil {
			return 0, 0, false, err
		}
		st := out.Bytes() // struct stat (x86-64): st_dev, st_ino first
		return binary.LittleEndian.Uint64(st[0:]), binary.LittleEndian.Uint64(st[8:]), true, nil
	}
}

// isDeleted says whether the file sx (of an fd, the cwd or a mapping) whose path reads
// link was deleted: by the file itself (no link left), not by the " (deleted)" that the
// kernel appends to the path of an unlinked name, which a live file may have in its own
// name. A file that keeps other links, unlinked under this name, shows the suffix and
// st_nlink > 0: then the name is looked up (by the process) and must be this very file.
func isDeleted(sx *unix.Statx_t, link string, lookup lookupFunc) (bool, error) {
	if sx.Nlink == 0 {
		return true, nil
	}
	if !strings.HasSuffix(link, " (deleted)") {
		return false, nil
	}
	dev, ino, found, err := lookup(link)
	if err != nil {
		return false, err
	}
	same := found && ino == sx.Ino && unix.Major(dev) == sx.Dev_major && unix.Minor(dev) == sx.Dev_minor
	return !same, nil
}

// pathTooLong is the refusal of a file whose path the kernel cannot report: /proc's
// readlink fails with ENAMETOOLONG beyond PATH_MAX (4096 bytes), and the move, which
// reopens by path, would not find it.
func pathTooLong(what string, err error) string {
	return fmt.Sprintf("%s: its path cannot be read (%v; longer than PATH_MAX, 4096 bytes?), so it cannot be reopened on the new state", what, err)
}

// inspect reads what the fast path needs about hostPid and checks eligibility; mayWrite
// answers whether a read-only shared mapping may become writable, lookup which file a
// path names for the process (Hold, which has the process stopped, asks the kernel in
// it: probeMayWrite, lookupIn).
//
// The process's files are judged by what they are, not by the text of their /proc
// links: a file is deleted when it has no link left (isDeleted), an fd whose link cannot
// be read (a path over PATH_MAX) refuses rather than being skipped, and a file, cwd or
// mapping on a mount the new state does not have (one made inside the sandbox) refuses
// (mounts.go).
// moveCaps are the capabilities setns(CLONE_NEWNS) checks in the caller's credentials
// (mntns_install: CAP_SYS_ADMIN and CAP_SYS_CHROOT): the move runs it injected, as the
// process. A process without them (a user's, uid 1000: CapEff 0) once failed its move and
// its move back and was killed; it is refused up front, for CRIU (which restores it as
// the host's root) to carry.
const moveCaps = 1<<unix.CAP_SYS_ADMIN | 1<<unix.CAP_SYS_CHROOT

func inspect(hostPid int, mayWrite mayWriteFunc, lookup lookupFunc) (*Proc, error) {
	base := "/proc/" + strconv.Itoa(hostPid)
	p := &Proc{HostPid: hostPid}
	buf := make([]byte, 4096) // for the /proc files read here, one after the other
	status, err := readProc(base+"/status", buf)
	if err != nil {
		return nil, fmt.Errorf("inspect process %d: %w", hostPid, err)
	}
	ns, err := procfs.ParseNSpid(status)
	if err != nil {
		return nil, fmt.Errorf("inspect process %d: %w", hostPid, err)
	}
	p.Pid = ns[len(ns)-1]
	for _, l := range strings.Split(string(status), "\n") {
		f := strings.Fields(l)
		if len(f) == 2 && f[0] == "Threads:" && f[1] != "1" {
			return nil, &Ineligible{Pid: p.Pid, Reason: fmt.Sprintf("it has %s threads (fork copies only one; set OMP_NUM_THREADS/OPENBLAS_NUM_THREADS=1)", f[1]), CRIU: true}
		}
		if len(f) == 2 && f[0] == "CapEff:" {
			if capEff, err := strconv.ParseUint(f[1], 16, 64); err == nil && capEff&moveCaps != moveCaps {
				return nil, &Ineligible{Pid: p.Pid, Reason: "it runs without CAP_SYS_ADMIN and CAP_SYS_CHROOT (as a user other than root), which the move's injected setns needs in its own credentials", CRIU: true}
			}
		}
		parsePending(f, &p.pending)
	}
	if ch, _ := readProc(fmt.Sprintf("%s/task/%d/children", base, hostPid), buf); len(bytes.TrimSpace(ch)) > 0 {
		return nil, &Ineligible{Pid: p.Pid, Reason: "it has child processes (" + innerPids(strings.Fields(string(ch)), len(ns)) + "), which a fork cannot take along", CRIU: true}
	}
	// Its root: the state's root, which the move's setns gives it again (a chroot would
	// be lost), and the mount every path is reopened on.
	if r, err := os.Readlink(base + "/root"); err != nil || r != "/" {
		if err != nil {
			return nil, fmt.Errorf("inspect process %d: %w", hostPid, err)
		}
		return nil, &Ineligible{Pid: p.Pid, Reason: fmt.Sprintf("its root directory is %s (chroot?), which the move onto the new state would not keep", r)}
	}
	rsx, err := statxAt(base + "/root")
	if err != nil {
		return nil, fmt.Errorf("inspect process %d: %w", hostPid, err)
	}
	mnts := &mounts{hostPid: hostPid, rootMnt: rsx.Mnt_id}
	onMount := func(what string, mnt uint64) error {
		w, err := mnts.where(mnt)
		if err != nil {
			return err
		}
		if w != "" {
			return &Ineligible{Pid: p.Pid, Reason: fmt.Sprintf("%s is on %s, which the new state does not have: reopened by path it would be another file", what, w)}
		}
		return nil
	}
	if p.Cwd, err = os.Readlink(base + "/cwd"); err != nil {
		return nil, &Ineligible{Pid: p.Pid, Reason: pathTooLong("its working directory", err)}
	}
	csx, err := statxAt(base + "/cwd")
	if err != nil {
		return nil, fmt.Errorf("inspect process %d: %w", hostPid, err)
	}
	if csx.Nlink == 0 {
		return nil, &Ineligible{Pid: p.Pid, Reason: "its working directory was deleted, so it cannot be entered again on the new state", CRIU: true}
	}
	if err := onMount("its working directory "+p.Cwd, csx.Mnt_id); err != nil {
		return nil, err
	}
	if p.Maps, err = sharedMappings(base, p.Pid, mayWrite, lookup, onMount); err != nil {
		return nil, err
	}
	if p.Timers, err = posixTimers(base, hostPid, p.Pid, buf); err != nil {
		return nil, err
	}
	ents, err := os.ReadDir(base + "/fd")
	if err != nil {
		return nil, err
	}
	var nums []int // in numeric order, not ReadDir's by name: a dup is found after its original
	for _, e := range ents {
		if n, err := strconv.Atoi(e.Name()); err == nil {
			nums = append(nums, n)
		}
	}
	sort.Ints(nums)
	for _, n := range nums {
		if fd, ok := dupTerminal(p, n); ok {
			p.FDs = append(p.FDs, fd)
			continue
		}
		fd, err := inspectFD(p, base, n, buf, lookup, onMount)
		if err != nil {
			return nil, err
		}
		if fd != nil {
			p.FDs = append(p.FDs, *fd)
		}
	}
	return p, nil
}

// dupTerminal is inspectFD's answer for fd n of p when it is the very open file
// description of a lower terminal fd (kcmp KCMP_FILE): the same file, flags and locks
// (fdinfo lists a description's own), so the same answer, for one syscall instead of
// statx, readlink and the fdinfo read (six calls). A session's fds 0, 1 and 2 are one
// description of its terminal. ok false: not one, or kcmp cannot tell; inspectFD looks.
func dupTerminal(p *Proc, n int) (FD, bool) {
	for _, o := range p.FDs {
		if o.Kind != "pty" {
			continue
		}
		if same, err := sameFile(p.HostPid, o.Num, p.HostPid, n); err == nil && same {
			return FD{Num: n, Path: o.Path, Kind: "pty"}, true
		}
	}
	return FD{}, false
}

// inspectFD is inspect's work for fd n of p (whose lower fds are in p.FDs already): nil
// if it was closed meanwhile.
func inspectFD(p *Proc, base string, n int, buf []byte, lookup lookupFunc, onMount func(string, uint64) error) (*FD, error) {
	name := base + "/fd/" + strconv.Itoa(n)
	// One statx serves every test below (and gives the mount: STATX_MNT_ID).
	sx, err := statxAt(name)
	if errors.Is(err, unix.ENOENT) {
		return nil, nil // closed meanwhile
	}
	target, lerr := os.Readlink(name)
	if errors.Is(lerr, unix.ENOENT) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("process %d: stat fd %d (%s): %w", p.Pid, n, target, err)
	}
	fd := FD{Num: n, Path: target}
	var locks [][]string // fdinfo "lock:" lines
	sockDomain := 0
	if strings.HasPrefix(target, "socket:") {
		sockDomain = closedTCP(p.HostPid, n)
	}
	switch mode := sx.Mode & unix.S_IFMT; {
	case isTerminal(uint32(mode), sx.Rdev_major, sx.Rdev_minor):
		// By device: a terminal opened through a state namespace that has since been
		// torn down reads as "/N" (its devpts mount is detached).
		fd.Kind = "pty"
	case statelessDev(&sx) != "":
		fd.Kind, fd.Path = "dev", statelessDev(&sx)
	case lerr != nil:
		return nil, &Ineligible{Pid: p.Pid, Reason: pathTooLong(fmt.Sprintf("fd %d", n), lerr)}
	case strings.HasPrefix(target, "socket:") && sockDomain != 0:
		fd.Kind, fd.Domain = "sock", sockDomain
	case !strings.HasPrefix(target, "/"): // pipe:[..], socket:[..], anon_inode:[eventfd] ...
		return nil, &Ineligible{Pid: p.Pid, Reason: fmt.Sprintf("fd %d is %s, which a fork would share with the template", n, target), CRIU: true}
	case mode == unix.S_IFREG || mode == unix.S_IFDIR:
		fd.Kind = "file"
		if mode == unix.S_IFDIR {
			fd.Kind = "dir"
		}
		deleted, err := isDeleted(&sx, target, lookup)
		if err != nil {
			return nil, fmt.Errorf("process %d: fd %d (%s): %w", p.Pid, n, target, err)
		}
		if deleted {
			return nil, &Ineligible{Pid: p.Pid, Reason: fmt.Sprintf("fd %d is a deleted file (%s), which cannot be reopened by path on the new state", n, target), CRIU: true}
		}
		if err := onMount(fmt.Sprintf("fd %d (%s)", n, target), sx.Mnt_id); err != nil {
			return nil, err
		}
	default:
		return nil, &Ineligible{Pid: p.Pid, Reason: fmt.Sprintf("fd %d is %s, a special file", n, target)}
	}
	if fd.Kind == "pty" {
		// Kept, not reopened: a lock through it would stay with the template's
		// description (flock) or be lost by the restored child (POSIX).
		if _, _, locks, err = fdinfo(base, n, buf); err == nil && len(locks) > 0 {
			return nil, &Ineligible{Pid: p.Pid, Reason: fmt.Sprintf("fd %d (%s) holds a file lock, which the fast path sets again only on files and directories", n, target), CRIU: true}
		}
		return &fd, nil
	}
	if fd.Flags, fd.Pos, locks, err = fdinfo(base, n, buf); err != nil {
		return nil, err
	}
	if fd.Kind == "dev" && len(locks) > 0 {
		return nil, &Ineligible{Pid: p.Pid, Reason: fmt.Sprintf("fd %d (%s) holds a file lock, which the fast path sets again only on files and directories", n, target), CRIU: true}
	}
	for _, o := range p.FDs { // the lower fds: in numeric order
		if o.Dup || o.Path != fd.Path || o.Kind != fd.Kind || !reopened(o.Kind) {
			continue
		}
		same, err := sameFile(p.HostPid, o.Num, p.HostPid, n)
		if err != nil {
			return nil, &Ineligible{Pid: p.Pid, Reason: fmt.Sprintf("fds %d and %d are both %s, and whether they share an open file description cannot be told (%v)", o.Num, n, fd.Path, err)}
		}
		if same {
			fd.Dup, fd.DupOf, locks = true, o.Num, nil
			break
		}
	}
	for _, l := range locks {
		lk, err := parseLock(l)
		if err != nil {
			return nil, &Ineligible{Pid: p.Pid, Reason: fmt.Sprintf("fd %d (%s) holds %v", n, target, err)}
		}
		fd.Locks = append(fd.Locks, lk)
	}
	return &fd, nil
}

// reopened reports whether fds of kind are reopened by a move (files, directories and
// stateless devices; closed TCP sockets are made anew; the terminal is shared by design).
func reopened(kind string) bool {
	return kind == "file" || kind == "dir" || kind == "dev" || kind == "sock"
}

// innerPids translates host PIDs (as /proc lists them) into the PID namespace at depth
// (the length of the NSpid line of a process there): what the sandbox calls them.
func innerPids(host []string, depth int) string {
	out := make([]string, len(host))
	for i, h := range host {
		out[i] = "?" // gone: never a host PID passed off as the sandbox's
		if n, err := strconv.Atoi(h); err == nil {
			if ns, err := procfs.NSpid(n); err == nil && len(ns) >= depth {
				out[i] = strconv.Itoa(ns[depth-1])
			}
		}
	}
	return strings.Join(out, " ")
}

// isTerminal is isPtySlave for a file of type mode (S_IFMT bits) and device major:minor.
func isTerminal(mode, major, minor uint32) bool {
	if mode != unix.S_IFCHR {
		return false
	}
	return major >= 136 && major <= 143 || major == 5 && minor == 0
}

// fdinfo reads fd n's open flags, offset and the fields of its "lock:" lines (buf: a
// scratch buffer for readProc, or nil).
func fdinfo(base string, n int, buf []byte) (flags int, pos int64, locks [][]string, err error) {
	b, err := readProc(base+"/fdinfo/"+strconv.Itoa(n), buf)
	if err != nil {
		return 0, 0, nil, err
	}
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) > 1 && f[0] == "lock:" {
			locks = append(locks, f[1:])
			continue
		}
		if len(f) != 2 {
			continue
		}
		switch f[0] {
		case "pos:":
			pos, _ = strconv.ParseInt(f[1], 10, 64)
		case "flags:":
			v, _ := strconv.ParseInt(f[1], 8, 64)
			flags = int(v)
		}
	}
	return flags, pos, locks, nil
}

// Template is a frozen fork of a process.
type Template struct {
	Proc            // the process as it was at the checkpoint
	HostPid int     // the template's own PID (host)
	SelfPid int     // the template's own PID in the sandbox
	sc      uintptr // a syscall instruction in it (it never leaves its stop in a syscall)

	// tr is the Tracer that forked the template, which keeps it seized for its whole
	// life, in a ptrace-stop: a SIGCONT from inside the sandbox (kill -CONT -1) resumes a
	// process in a SIGSTOP group stop, not one in a ptrace-stop, and a template must
	// never run. A SIGSTOP is kept queued (remote.Tracee.KeepStopped), so that a detach
	// (the daemon's death included) leaves it stopped.
	tr *remote.Tracer

	// What fork did not copy into the template, recorded from the live process at the
	// checkpoint and given back to each restored child.
	// (Proc.Timers, copied, hold the POSIX timers' settings.)
	Itimers [3]unix.Itimerval      // ITIMER_REAL, ITIMER_VIRTUAL, ITIMER_PROF: left, interval
	Signals []remote.PendingSignal // pending signals, but the POSIX timers' own
	// Dumpable is the process's PR_GET_DUMPABLE. The template itself is made not
	// dumpable from its fork on: a process of the sandbox has its uid and a subset of
	// its capabilities, and so could otherwise open /proc/TEMPLATE/mem and rewrite the
	// state that a restore brings back (and keep the fd: access is checked at open).
	// Without CAP_SYS_PTRACE, which the sandbox lacks, a non-dumpable process's /proc
	// entries, memory and ptrace are closed to it. Each restored child gets Dumpable
	// back.
	Dumpable uintptr

	exit exitWatch // its exit, collected as it happens (exit.go)
}

// Alive reports whether the template still exists and is stopped (it may have been
// killed from inside the sandbox; that node's process state is then gone).
func (t *Template) Alive() bool {
	if t.collected() {
		return false
	}
	s := procfs.State(t.HostPid)
	return s == 'T' || s == 't'
}

// Kill kills the template; the Tracer holding it, if any, collects it in the background
// (Tracer.ForgetLater: Close waits for that).
func (t *Template) Kill() {
	t.signal(unix.SIGKILL)
	if t.tr != nil && !t.collected() {
		t.tr.ForgetLater(t.HostPid)
	}
}

// recordLive records from the live process t, stopped since it was inspected, what its
// template will not get from fork: the time its interval and POSIX timers have left.
// Precondition: inside Do, right before the clone3 that forks the template; tmpl.Proc is
// what inspect found while t was stopped.
func recordLive(t *remote.Tracee, tmpl *Template) error {
	tmpl.Timers = append([]PosixTimer(nil), tmpl.Timers...) // filled in: not inspect's
	return recordTimers(t, tmpl)
}

// recordForked records the signals pending for the live process t when its template
// forked. Precondition: inside Do, right after that clone3, before t runs or another
// syscall is injected into it; tmpl.Proc is what inspect found while t was stopped.
func recordForked(t *remote.Tracee, tmpl *Template) error {
	var err error
	tmpl.Signals, err = pendingSignals(t, tmpl.pending, tmpl.Timers)
	if err != nil {
		return fmt.Errorf("read pending signals: %w", err)
	}
	return nil
}

// giveBack gives the child c, forked from tmpl for a restore and moved onto its state,
// what fork did not copy: its timers re-armed and its pending signals queued again.
// Precondition: inside Do, last before c resumes (a deliverable signal queued here must
// not be taken by a later injection).
func giveBack(c *remote.Tracee, tmpl *Template) error {
	if err := rearm(c, tmpl); err != nil {
		return err
	}
	if err := c.QueueSignals(tmpl.Signals); err != nil {
		return fmt.Errorf("pending signals: %w", err)
	}
	return nil
}

// move puts the tracee onto the state whose namespace is ns (the daemon's fd): setns,
// chdir, files and directories reopened at the same offset and flags, shared mappings
// that can write mapped again from the state's files. The namespace is handed over
// first (handFD), then the calls, its receipt first, run as one batch (one hand-off,
// not one per call). Precondition: on tr's thread (inside Do).
func move(t *remote.Tracee, p *Proc, ns int) error {
	h, err := handFD(t, ns)
	if err != nil {
		return err
	}
	var b remote.Batch
	h.recvCalls(&b)
	unlockCalls(&b, p)
	maps := moveCalls(&b, p, h.tx)
	lockCalls(&b, p)
	res, err := t.RunBatch(&b)
	if err != nil {
		h.cleanup(t)
		return err
	}
	return checkMaps(res, maps, p.Maps)
}

// moveCalls appends move's calls to b and returns the mmaps' results (checked by
// checkMaps once b has run). nsfd is the tracee's fd on the new namespace (handFD),
// which the batch closes.
func moveCalls(b *remote.Batch, p *Proc, nsfd int) []remote.Ref {
	b.Add("setns", unix.SYS_SETNS, nsfd, unix.CLONE_NEWNS)
	b.Add("close the namespace fd", unix.SYS_CLOSE, nsfd)
	b.Add("chdir "+p.Cwd, unix.SYS_CHDIR, p.Cwd)
	for _, f := range p.FDs {
		if !reopened(f.Kind) {
			continue
		}
		if f.Dup { // DupOf, lower, has been reopened: share its description again
			b.Add(fmt.Sprintf("dup3 fd %d to fd %d", f.DupOf, f.Num), unix.SYS_DUP3, f.DupOf, f.Num, f.Flags&unix.O_CLOEXEC)
			continue
		}
		if f.Kind == "sock" {
			sockCalls(b, f)
			continue
		}
		flags := f.Flags &^ (unix.O_CREAT | unix.O_TRUNC | unix.O_EXCL)
		nfd := b.Add(fmt.Sprintf("reopen fd %d (%s)", f.Num, f.Path), unix.SYS_OPENAT, unix.AT_FDCWD, f.Path, flags, 0)
		if f.Kind == "file" && f.Pos != 0 {
			b.Add(fmt.Sprintf("seek fd %d (%s)", f.Num, f.Path), unix.SYS_LSEEK, nfd, f.Pos, 0)
		}
		b.Add(fmt.Sprintf("dup3 fd %d", f.Num), unix.SYS_DUP3, nfd, f.Num, f.Flags&unix.O_CLOEXEC)
		b.Close("close", nfd)
	}
	var maps []remote.Ref
	for _, m := range p.Maps {
		maps = append(maps, mapCalls(b, m, m.Path))
	}
	return maps
}

// terminalCalls appends the calls that give the (new session leader) tracee ptyPath in
// place of every terminal fd it had, make it the controlling terminal and the tracee's
// group the foreground, and flush input typed before the restore. Precondition: after
// setsid (earlier in b, or already run).
func terminalCalls(b *remote.Batch, p *Proc, ptyPath string) {
	var ptys []FD
	for _, f := range p.FDs {
		if f.Kind == "pty" {
			ptys = append(ptys, f)
		}
	}
	if len(ptys) == 0 {
		return
	}
	pfd := b.Add("open "+ptyPath, unix.SYS_OPENAT, unix.AT_FDCWD, ptyPath, unix.O_RDWR|unix.O_NOCTTY, 0)
	for _, f := range ptys {
		b.Add(fmt.Sprintf("dup3 the terminal to fd %d", f.Num), unix.SYS_DUP3, pfd, f.Num, f.Flags&unix.O_CLOEXEC)
	}
	b.Add("TIOCSCTTY", unix.SYS_IOCTL, pfd, unix.TIOCSCTTY, 1)
	pgrp := make([]byte, 4)
	binary.LittleEndian.PutUint32(pgrp, uint32(p.Pid))
	b.Add("tcsetpgrp", unix.SYS_IOCTL, pfd, unix.TIOCSPGRP, pgrp)
	b.Add("flush terminal input", unix.SYS_IOCTL, pfd, unix.TCFLSH, unix.TCIFLUSH)
	b.Close("close the terminal fd", pfd)
}

// IsHostPid reports whether host (a host PID) is the process pid of the PID namespace
// of initHost (a host PID): its NSpid ends in pid and its PID namespace is initHost's.
// Two reads instead of HostPid's scan; a PID reused by another sandbox's process fails
// the namespace check.
func IsHostPid(host, pid, initHost int) bool {
	f, err := procfs.NSpid(host)
	if err != nil || len(f) < 2 || f[len(f)-1] != pid {
		return false
	}
	return SamePidNS(host, initHost)
}

// HostPid finds the host PID of the sandbox process nsPid among the host PIDs given
// (the sandbox's cgroup), from /proc/PID/status NSpid.
func HostPid(hostPids []int, nsPid int) (int, error) {
	for _, h := range hostPids {
		if n, err := procfs.InnerPid(h); err == nil && n == nsPid {
			return h, nil
		}
	}
	return 0, fmt.Errorf("no process %d in the sandbox", nsPid)
}

// What Other finds.
const (
	Takeable = iota // a process a checkpoint may take
	Zombie          // gone, or a zombie
	Traced          // traced by this process
)

// Other says whether hostPid is a process a checkpoint may take: it exists, is not a
// zombie, and is not traced by this process (the daemon's templates and memory holders
// are: /proc's TracerPid is the tracing thread's TID). tracer is the host PID of the
// process that traces it, if another one does (a debugger inside the sandbox), else 0.
func Other(hostPid int) (what, tracer int) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(hostPid) + "/status")
	if err != nil {
		return Zombie, 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) < 2 {
			continue
		}
		switch f[0] {
		case "State:":
			if f[1] == "Z" || f[1] == "X" {
				return Zombie, 0
			}
		case "TracerPid:":
			if f[1] != "0" {
				if _, err := os.Stat("/proc/self/task/" + f[1]); err == nil {
					return Traced, 0
				}
				tid, _ := strconv.Atoi(f[1])
				return Takeable, tgid(tid)
			}
		}
	}
	return Takeable, 0
}

// tgid returns the process (thread group) of thread tid, or tid.
func tgid(tid int) int {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(tid) + "/status")
	if err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(l, "Tgid:"); ok {
				if n, err := strconv.Atoi(strings.TrimSpace(v)); err == nil {
					return n
				}
			}
		}
	}
	return tid
}

// SamePidNS reports whether host runs in the PID namespace of initHost (both host PIDs).
func SamePidNS(host, initHost int) bool {
	a, err1 := os.Readlink("/proc/" + strconv.Itoa(host) + "/ns/pid")
	c, err2 := os.Readlink("/proc/" + strconv.Itoa(initHost) + "/ns/pid")
	return err1 == nil && err2 == nil && a == c
}

// SandboxPid returns hostPid's PID in the PID namespace of initHost (the sandbox's, at
// the depth of init's), or 0.
func SandboxPid(hostPid, initHost int) int {
	f, err1 := procfs.NSpid(hostPid)
	in, err2 := procfs.NSpid(initHost)
	if err1 != nil || err2 != nil || len(f) < len(in) {
		return 0
	}
	return f[len(in)-1]
}

// Exists reports whether hostPid is a live (not zombie) process.
func Exists(hostPid int) bool {
	s := procfs.State(hostPid)
	return s != 0 && s != 'Z' && s != 'X'
}

// Comm returns hostPid's command name, or "?".
func Comm(hostPid int) string {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(hostPid) + "/comm")
	if err != nil {
		return "?"
	}
	return strings.TrimSpace(string(b))
}
