package durable

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/checkpoint-restore/go-criu/v7/rpc"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"deltabox/internal/criu"
	"deltabox/internal/netns"
	"deltabox/internal/procfs"
)

// pidKey is the key under which the sandbox's PID namespace is external in an image:
// Restore hands CRIU the sandbox's PID namespace under it and joins the others.
const pidKey = "pidns"

// Deadlines: a dump of a 50 MB python takes 0.16-0.3 s here, its restore 0.3 s.
const (
	DumpTimeout    = 30 * time.Second
	RestoreTimeout = 30 * time.Second
)

// ManifestFile is written into the image directory by Dump, last.
const ManifestFile = "durable.json"

// Manifest is what Restore needs to know of an image besides CRIU's own files.
type Manifest struct {
	// Pid is the root task's PID in the sandbox (what it gets back); HostPid its PID
	// on the host at the dump.
	Pid, HostPid int
	// TTYs are the terminals the tree held, as CRIU's external keys
	// ("tty[rdev:dev]", hex): Restore needs a terminal for each.
	TTYs []string
	// ExtFiles are the files the tree maps or holds on mounts its mount namespace does
	// not have (extfiles.go), by CRIU's key, with their paths: Restore opens each in
	// the state it restores onto.
	ExtFiles map[string]string `json:",omitempty"`
	// Removed are the files and directories with no name the tree holds (removed.go),
	// external to the image too: Restore makes each again, nameless, on the state.
	Removed []Removed `json:",omitempty"`
	// TCP are the tree's TCP connections, dumped with DumpOptions.TCPEstablished
	// (tcp.go): Restore repairs them back, first destroying the closed ends of the
	// same connections, and a restore locks them (netns.Lock) until the trees run.
	TCP []Conn `json:",omitempty"`
	// ShellJob: the tree's root does not lead its session (a job an exec left behind,
	// in init's session). CRIU dumps it only as a shell job; Restore has its root lead
	// a session of its own (shellJobSetsidEnv).
	ShellJob bool `json:",omitempty"`
	// Namespaces' inode numbers at the dump, for diagnostics.
	PidNS, NetNS uint64
	Dumped       time.Time
	DumpS        float64 // CRIU's time, seconds
}

// DumpOptions are Dump's choices; the zero value is a dump that leaves the tree as it
// was (running, or stopped if it was stopped).
type DumpOptions struct {
	// Kill ends the tree after the dump (CRIU kills it) instead of leaving it running.
	Kill bool
	// LogLevel is CRIU's (0-4); 0 means 2: errors and warnings.
	LogLevel int32
	// Timeout bounds CRIU; 0 means DumpTimeout.
	Timeout time.Duration
	// Background runs CRIU at the lowest CPU and I/O priority (nice 19, idle I/O
	// class), for dumps off the agent's critical path. The dumped tree is stopped
	// for the whole dump, so this lengthens its pause when the machine is busy: for
	// templates, which are stopped anyway.
	Background bool
	// Sync makes the image durable before Dump returns: CRIU syncs nothing, so every
	// file and the directory are synced before the manifest is written (and it after).
	// Without it, PageStore.Ingest is what makes the image durable.
	Sync bool
	// LeaveStopped leaves the tree stopped after the dump (CRIU sends each task
	// SIGSTOP as it lets it go), for a caller that decides afterwards whether it runs
	// on (SIGCONT) or is ended: a checkpoint, whose node must hold the tree as dumped.
	LeaveStopped bool
	// Layers are the host directories of the state the tree stands on, its upper
	// first: where the dump names the directories of the tree's inotify watches
	// (inotify.go). Without them the watches are looked for by a walk alone.
	Layers []string
	// TCPEstablished dumps the tree's TCP connections (CRIU's --tcp-established: in
	// repair mode, tcp.go), for a dump that leaves the tree stopped, with CRIU's lock
	// on them: the caller calls RepairOff before it lets the tree run without a
	// restore, and netns.Unlock before it lets the tree run. Without it, a tree
	// holding one is refused.
	TCPEstablished bool
	// FileLocks dumps the tree's file locks (flock, POSIX, OFD: CRIU's --file-locks),
	// which CRIU takes again at the restore; without it a tree holding one is refused.
	FileLocks bool
}

// Dump writes the images of the process tree rooted at host PID pid, a process of a
// sandbox (its own user, PID, mount, network, IPC, UTS namespaces), into dir, which
// must exist and be empty. The sandbox's PID and network namespaces and every mount
// are external to the image (it holds none of them: they belong to the sandbox and its
// state), and so is each terminal the tree holds: Restore puts the process back into
// the same sandbox, given a terminal for each (Manifest.TTYs).
//
// CRIU must be the tree's tracer: a process held in a ptrace-stop (a template) is let go
// first by its tracer; a process in a group stop stays stopped after the dump, with its
// SIGSTOP queued, and its image records it stopped (measured on a non-dumpable python
// stopped by SIGSTOP: docs/research/criu-sandbox/).
func Dump(ctx context.Context, r *criu.Runner, pid int, dir string, o DumpOptions) (_ *Manifest, err error) {
	if !r.Usable() {
		return nil, fmt.Errorf("CRIU cannot dump on this machine: %s", r)
	}
	pidNS, err := nsIno(pid, "pid")
	if err != nil {
		return nil, err
	}
	netNS, err := nsIno(pid, "net")
	if err != nil {
		return nil, err
	}
	ttys, err := ExternalTTYs(pid)
	if err != nil {
		return nil, err
	}
	nspid, err := procfs.InnerPid(pid)
	if err != nil {
		return nil, err
	}
	d, err := os.Open(dir)
	if err != nil {
		return nil, err
	}
	defer func() { _ = d.Close() }() // read-only, after the read
	// CRIU runs in the tree's network namespace, which leaves that namespace out of the
	// image: CRIU dumps every namespace of the tree that is not its own, and for a
	// network namespace, even an external one, it dumps the conntrack table through
	// ctnetlink, which walks the host's whole conntrack hash (262,144 buckets here,
	// shared by all namespaces) in one netlink sendmsg: 9-14 ms in the kernel per dump
	// (the expectations' table, dumped next, is small), which a kernel built without
	// preemption (PREEMPT(none), as here) does not interrupt. A background dump at nice 19 thus
	// took a CPU from the sandboxes' operations for 10 ms at a time (measured: restores
	// beside dumps, docs/research/ab-6318f36/). Nothing is lost: Restore joins the
	// sandbox's network namespace (--join-ns), and CRIU restores conntrack entries only
	// into a namespace it restores.
	netFile, err := os.Open(fmt.Sprintf("/proc/%d/ns/net", pid))
	if err != nil {
		return nil, fmt.Errorf("the network namespace of pid %d: %w", pid, err)
	}
	defer func() { _ = netFile.Close() }() // read-only (setns)
	ext := []string{
		fmt.Sprintf("pid[%d]:%s", pidNS, pidKey),
		// Every mount: the image names files by path, resolved in the state the
		// restored process joins (its mount namespace).
		"mnt[]",
	}
	ext = append(ext, ttys...)
	job, err := shellJob(pid)
	if err != nil {
		return nil, err
	}
	tree := Tree(pid)
	removed, removedSrc, err := removedFiles(tree)
	if err != nil {
		return nil, err
	}
	// A tree that runs on after the dump (a checkpoint's CRIU trees) is checked before
	// and after it for what CRIU's restore cannot put back (restorable.go): the
	// checkpoint ends the tree before it restores it. A dump that ends its tree (a
	// template's copy, for a durable image) loses nothing at the dump and is not.
	check := !o.Kill
	if o.TCPEstablished && !o.LeaveStopped {
		return nil, errors.New("a dump of TCP connections must leave its tree stopped (TCPEstablished needs LeaveStopped)")
	}
	if o.Kill && len(removed) > 0 {
		// Copied now, from the stopped tree that CRIU ends.
		if removed, err = copyRemovedFiles(tree, dir, removed, removedSrc); err != nil {
			return nil, err
		}
	}
	for _, r := range removed {
		ext = append(ext, r.Key)
	}
	extFiles, err := externalFiles(tree, removed)
	if err != nil {
		return nil, err
	}
	for k := range extFiles {
		ext = append(ext, k)
	}
	skip, err := tmpfsMounts(pid)
	if err != nil {
		return nil, err
	}
	opts := &rpc.CriuOpts{
		// CRIU's own fd by path: it would resolve images_dir_fd as /proc/<our
		// pid>/fd/N (SO_PEERCRED), which a restore's CRIU, with a /proc of the
		// sandbox, cannot see; and it readlinks images_dir, so a plain path fails.
		ImagesDirFd:    proto.Int32(-1),
		ImagesDir:      proto.String(fmt.Sprintf("/proc/self/fd/%d", fdOf(0))),
		Pid:            proto.Int32(int32(pid)),
		LeaveRunning:   proto.Bool(!o.Kill && !o.LeaveStopped),
		LeaveStopped:   proto.Bool(o.LeaveStopped),
		ShellJob:       proto.Bool(job),
		FileLocks:      proto.Bool(o.FileLocks),
		TcpEstablished: proto.Bool(o.TCPEstablished),
		LogLevel:       proto.Int32(logLevel(o.LogLevel)),
		LogFile:        proto.String(DumpLog),
		External:       ext,
		// CRIU archives the files of every tmpfs it dumps (tar, gzip: 64 ms of a
		// 0.5 s dump here, for the sandbox's /dev and a /proc mask), which Restore
		// never reads: it joins the state's mount namespace instead of making one.
		SkipMnt: skip,
		// No connection to lock but with TCPEstablished (below).
		NetworkLock: rpc.CriuNetworkLockMethod_SKIP.Enum(),
		// Where CRIU looks for the files of inotify watches (inotify.go).
		IrmapScanPaths: irmapScanPaths(tree, o.Layers),
	}
	var owner uint32 // 0: CRIU as the daemon is
	var env []string
	if !hasCapSysResource() {
		if owner, err = nsOwnerOf(pid); err != nil {
			return nil, err
		}
	}
	if owner != 0 {
		if err := ensureUnprivKdatDir(); err != nil {
			return nil, err
		}
		opts.Unprivileged = proto.Bool(true)
		env = []string{"XDG_RUNTIME_DIR=" + unprivKdatDir}
	}
	c := &call{r: r, typ: rpc.CriuReqType_DUMP, opts: opts, files: []*os.File{d}, owner: owner, env: env, netNS: netFile,
		what: fmt.Sprintf("criu dump of pid %d (sandbox pid %d)", pid, nspid), dir: dir, log: DumpLog,
		timeout: cmp(o.Timeout, DumpTimeout), background: o.Background}
	if o.TCPEstablished {
		// CRIU locks each connection (a table of its own in the sandbox's namespace,
		// netns/lock_linux.go) and switches it to repair mode, and leaves both when it
		// leaves the tree stopped. A dump that fails after CRIU took them (DeltaBox's
		// checks below, or CRIU killed at its deadline) leaves the tree as CRIU's own
		// failed dump does: stopped by CRIU or running, its sockets out of repair mode
		// and unlocked.
		opts.NetworkLock = rpc.CriuNetworkLockMethod_NFTABLES.Enum()
		before, lerr := netns.CRIUTables(int(netFile.Fd()))
		if lerr != nil {
			return nil, lerr
		}
		defer func() {
			if err != nil {
				err = errors.Join(err, RepairOff(Tree(pid)), netns.UnlockCRIU(int(netFile.Fd()), before))
			}
		}()
	}
	start := time.Now()
	if _, err := c.run(ctx); err != nil {
		if h := dumpHint(err.Error()); h != "" {
			return nil, fmt.Errorf("%s; %w", h, err)
		}
		return nil, err
	}
	if err := criuRemaps(dir); err != nil {
		return nil, fmt.Errorf("%s: %w", c.what, err)
	}
	var conns []Conn
	if o.TCPEstablished {
		if conns, err = imageConns(dir); err != nil {
			return nil, fmt.Errorf("%s: %w", c.what, err)
		}
	}
	if check {
		if err := unrestorable(dir, o.TCPEstablished); err != nil {
			return nil, fmt.Errorf("%s: %w", c.what, err)
		}
		if err := bigQueues(dir, conns); err != nil {
			return nil, fmt.Errorf("%s: %w; CRIU's restore, which the checkpoint runs after ending the process, would fail, so it is not ended", c.what, err)
		}
	}
	if err := unixSocketMounts(dir); err != nil {
		return nil, fmt.Errorf("%s: %w", c.what, err)
	}
	if !o.Kill && len(removed) > 0 {
		if removed, err = copyRemovedFiles(Tree(pid), dir, removed, removedSrc); err != nil {
			return nil, fmt.Errorf("%s: %w", c.what, err)
		}
	}
	m := &Manifest{Pid: nspid, HostPid: pid, TTYs: ttys, ExtFiles: extFiles, Removed: removed, TCP: conns, ShellJob: job, PidNS: pidNS, NetNS: netNS, Dumped: start.UTC(),
		DumpS: time.Since(start).Seconds()}
	if o.Sync {
		if err := syncDir(dir); err != nil {
			return nil, err
		}
	}
	if err := writeJSON(filepath.Join(dir, ManifestFile), m); err != nil {
		return nil, err
	}
	if o.Sync {
		if err := syncDir(dir); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// Log files CRIU writes into the images directory.
const (
	DumpLog    = "dump.log"
	RestoreLog = "restore.log"
)

func logLevel(l int32) int32 {
	if l == 0 {
		return 2
	}
	return l
}

func cmp(d, def time.Duration) time.Duration {
	if d == 0 {
		return def
	}
	return d
}

// nsIno is the inode number of /proc/PID/ns/NAME.
func nsIno(pid int, name string) (uint64, error) {
	var st unix.Stat_t
	if err := unix.Stat(fmt.Sprintf("/proc/%d/ns/%s", pid, name), &st); err != nil {
		return 0, fmt.Errorf("the %s namespace of pid %d: %w", name, pid, err)
	}
	return st.Ino, nil
}

// TreeTTYs lists, as CRIU's external keys, the pseudo-terminal slaves that the tree
// rooted at pid holds open. Each terminal belongs to a session of the daemon (its
// master is the daemon's), so it cannot be in the image.
func TreeTTYs(pid int) ([]string, error) {
	var keys []string
	for _, p := range Tree(pid) {
		ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", p))
		if err != nil {
			if p == pid {
				return nil, fmt.Errorf("the files of pid %d: %w", pid, err)
			}
			continue // gone since
		}
		for _, e := range ents {
			var st unix.Stat_t
			if unix.Stat(fmt.Sprintf("/proc/%d/fd/%s", p, e.Name()), &st) != nil || st.Mode&unix.S_IFMT != unix.S_IFCHR {
				continue
			}
			// UNIX98 pty slaves: majors 136-143.
			if m := unix.Major(st.Rdev); m < 136 || m > 143 {
				continue
			}
			k := ttyKey(&st)
			if !slices.Contains(keys, k) {
				keys = append(keys, k)
			}
		}
	}
	return keys, nil
}

// ExternalTTYs is TreeTTYs without the pseudo-terminals the tree opened itself (it
// holds the master too: openpty): CRIU dumps those with their master, and its restore
// opens /dev/ptmx in the sandbox's devpts until it gets the same number
// (criu/tty.c:__pty_open_ptmx_index, 32 tries): free again once the tree was ended.
// The others (a session's terminal, a pty another process holds the master of) are
// external to the image, and a restore needs a terminal for each.
func ExternalTTYs(pid int) ([]string, error) {
	keys, err := TreeTTYs(pid)
	if err != nil || len(keys) == 0 {
		return keys, err
	}
	for _, t := range TreePTYs(pid, keys) {
		if t.Own {
			keys = slices.DeleteFunc(keys, func(k string) bool { return k == t.Key })
		}
	}
	return keys, nil
}

// PTY is a pseudo-terminal slave a tree holds, for a refusal's message.
type PTY struct {
	Key  string // as TreeTTYs names it
	Path string // as the process that holds it sees it (/dev/pts/N)
	Own  bool   // the tree holds its master too (it opened it: openpty, /dev/ptmx)
	// Closed: its master was closed (nothing holds it; its /dev/pts name is gone:
	// "/dev/pts/N (deleted)").
	Closed bool
}

// TreePTYs describes the pseudo-terminal slaves the tree holds whose keys are in keys
// (TreeTTYs'). A master is matched by its "tty-index" in /proc/PID/fdinfo: the slave's
// number.
func TreePTYs(pid int, keys []string) []PTY {
	var out []PTY
	masters := map[uint64]bool{}
	for _, p := range Tree(pid) {
		ents, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", p))
		for _, e := range ents {
			link := fmt.Sprintf("/proc/%d/fd/%s", p, e.Name())
			var st unix.Stat_t
			if unix.Stat(link, &st) != nil || st.Mode&unix.S_IFMT != unix.S_IFCHR {
				continue
			}
			if unix.Major(st.Rdev) == 5 && unix.Minor(st.Rdev) == 2 { // /dev/ptmx: a master
				info, _ := os.ReadFile(fmt.Sprintf("/proc/%d/fdinfo/%s", p, e.Name()))
				for l := range strings.Lines(string(info)) {
					if v, ok := strings.CutPrefix(l, "tty-index:"); ok {
						if n, err := strconv.ParseUint(strings.TrimSpace(v), 10, 32); err == nil {
							masters[n] = true
						}
					}
				}
				continue
			}
			if k := ttyKey(&st); slices.Contains(keys, k) && !slices.ContainsFunc(out, func(t PTY) bool { return t.Key == k }) {
				path, _ := os.Readlink(link)
				path, closed := strings.CutSuffix(path, " (deleted)")
				out = append(out, PTY{Key: k, Path: path, Closed: closed})
			}
		}
	}
	for i := range out {
		var rdev, dev uint64
		if _, err := fmt.Sscanf(out[i].Key, "tty[%x:%x]", &rdev, &dev); err == nil {
			out[i].Own = masters[uint64(unix.Major(rdev)-136)<<8|uint64(unix.Minor(rdev))]
		}
	}
	return out
}

// TTYKey is CRIU's external key of the pseudo-terminal slave open at fd, as TreeTTYs
// lists the slaves a tree holds: a restore hands CRIU a session's slave under it.
func TTYKey(fd int) (string, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return "", err
	}
	return ttyKey(&st), nil
}

// ttyKey is CRIU's key of an external terminal, "tty[rdev:dev]": the slave's device
// number and that of the devpts instance it is on, in hex.
func ttyKey(st *unix.Stat_t) string { return fmt.Sprintf("tty[%x:%x]", st.Rdev, st.Dev) }

// tmpfsMounts lists the mount points of the tmpfs mounts pid sees, as it sees them,
// and of every mount below one (CRIU refuses to skip a mount and keep its children:
// "No parent found for mountpoint").
func tmpfsMounts(pid int) ([]string, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", pid))
	if err != nil {
		return nil, fmt.Errorf("the mounts of pid %d: %w", pid, err)
	}
	var tmpfs, all []string
	for _, l := range strings.Split(string(b), "\n") {
		// ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTS [OPTIONAL...] - FSTYPE SOURCE SUPEROPTS
		f := strings.Fields(l)
		i := slices.Index(f, "-")
		if i < 5 || i+1 >= len(f) {
			continue
		}
		mp := unescapeMount(f[4])
		all = append(all, mp)
		if f[i+1] == "tmpfs" && mp != "/" {
			tmpfs = append(tmpfs, mp)
		}
	}
	var out []string
	for _, mp := range all {
		for _, t := range tmpfs {
			if mp == t || strings.HasPrefix(mp, t+"/") {
				if !slices.Contains(out, mp) {
					out = append(out, mp)
				}
				break
			}
		}
	}
	return out, nil
}

// unescapeMount undoes mountinfo's octal escapes (\040 for a space).
func unescapeMount(s string) string {
	if !strings.Contains(s, "\\") {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// shellJobSetsidEnv switches on DeltaBox's CRIU patch 0004 for a restore: the root of
// a shell job leads a session and a process group of its own (setsid), where CRIU would
// have it join CRIU's own, which is outside the sandbox's PID namespace (and a process
// whose session is led from outside its PID namespace cannot be dumped again: CRIU
// refuses it, "A session leader of PID(N) is outside of its pid namespace").
const shellJobSetsidEnv = "CRIU_SHELL_JOB_SETSID=1"

// shellJob reports whether the tree rooted at pid is a job of a session it does not
// lead (a background job an exec left behind, in init's session): CRIU dumps such a
// tree only as a shell job. A session or process group led from outside the sandbox's
// PID namespace (NSsid or NSpgid 0 there) cannot be dumped at all.
func shellJob(pid int) (bool, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return false, err
	}
	inner := map[string]string{}
	for _, l := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(l, ":")
		if f := strings.Fields(v); ok && len(f) > 0 && (k == "NSpid" || k == "NSsid" || k == "NSpgid") {
			inner[k] = f[len(f)-1]
		}
	}
	if inner["NSsid"] == "0" || inner["NSpgid"] == "0" {
		return false, fmt.Errorf("process %d: its session or process group is led from outside the sandbox's PID namespace (a sandbox made before its init led its own session: recreate it)", pid)
	}
	return inner["NSsid"] != inner["NSpid"], nil
}

// Tree is pid and its descendants (through /proc/PID/task/TID/children), host PIDs,
// parents first. Stable only while the tree is stopped.
func Tree(pid int) []int {
	out := []int{pid}
	for i := 0; i < len(out); i++ {
		tasks, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", out[i]))
		for _, t := range tasks {
			b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/children", out[i], t.Name()))
			for _, f := range strings.Fields(string(b)) {
				if c, err := strconv.Atoi(f); err == nil {
					out = append(out, c)
				}
			}
		}
	}
	return out
}

// syncDir fsyncs every regular file in dir, then dir.
func syncDir(dir string) error {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range append(ents, nil) {
		name := dir
		if e != nil {
			if !e.Type().IsRegular() {
				continue
			}
			name = filepath.Join(dir, e.Name())
		}
		f, err := os.Open(name)
		if err != nil {
			return err
		}
		err = f.Sync()
		_ = f.Close() // read-only: Sync's error is the one that counts
		if err != nil {
			return fmt.Errorf("sync %s: %w", name, err)
		}
	}
	return nil
}

func writeJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o600)
}

// ReadManifest reads the manifest Dump wrote into dir.
func ReadManifest(dir string) (*Manifest, error) {
	b, err := os.ReadFile(filepath.Join(dir, ManifestFile))
	if err != nil {
		return nil, fmt.Errorf("not a complete durable image (%s is written last): %w", ManifestFile, err)
	}
	var m Manifest
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("%s in %s: %w", ManifestFile, dir, err)
	}
	return &m, nil
}

// dumpHints are refusals of CRIU's dump that a sandbox's process meets, in words that say
// what it holds and what to do, by what CRIU's error says (CRIU 4.1.1; zdtm
// socket-tcp-skip-in-flight, socket-ext, inotify00). CRIU's own words follow.
var dumpHints = []struct{ match, hint string }{
	{"In-flight connection", "a listening TCP socket holds connections not yet accepted, which CRIU cannot take (accept them, or close the listener, before the checkpoint)"},
	{"External socket is used", "a unix socket connected to a process outside its tree (another background job, or a session's process), which CRIU cannot take apart from its peer (close it, or have one job hold both ends)"},
	{"Can't dump that handle", "an inotify watch on a file that neither the daemon could name (a removed file, a directory renamed since a checkpoint or in the image) nor CRIU found under the directories it searched (the tree's working directories, " + strings.Join(irmapFixed, ", ") + ", /etc), which CRIU cannot name again (watch files under the process's working directory or /workspace, or remove the watch before the checkpoint)"},
}

// dumpHint is the hint of dumpHints for CRIU's error msg, or "".
func dumpHint(msg string) string {
	for _, h := range dumpHints {
		if strings.Contains(msg, h.match) {
			return h.hint
		}
	}
	return ""
}
