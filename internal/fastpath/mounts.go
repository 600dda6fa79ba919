package fastpath

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"deltabox/internal/procfs"
)

// Which mount an fd, the working directory or a shared mapping is on.
//
// The move reopens files by path on the new state, whose namespace holds the state's
// mounts only: its overlay on "/", and what the namespace builder puts on it (clones of
// the base namespace's /dev, /dev/pts and /proc, and /dev/shm, a bind of the overlay's
// own directory: internal/mountns). A file on a mount made inside the sandbox (a tmpfs,
// a bind, another proc) has no counterpart there: reopened by path it would become the
// overlay's file under the mount point, or nothing. So an fd is moved by what it is on,
// not by its path alone: one whose mount is not the state's refuses the checkpoint,
// naming it.
//
// Cost. The common case costs nothing per fd: the fd's mount id comes with the statx
// that inspect makes of every fd anyway (STATX_MNT_ID), and equals the id of the mount
// the process's root is on (one statx per process). Only a file on another mount (the
// state's /dev/shm or /proc, or one the sandbox made) has the mount tables read: the
// process's /proc/PID/mountinfo and, as the reference of what every state shows, its
// sandbox init's (the base namespace, which the states clone).
//
// A mount is the state's when the new state shows the same filesystem at the same path:
//   - the mount the process's root is on (the overlay);
//   - a mount of the base namespace (init's), cloned: the same superblock (st_dev), the
//     same root within it and the same mount point (/dev, /dev/pts, /proc);
//   - a bind of the overlay that shows each of its directories at its own path (its
//     root within the overlay is its mount point: /dev/shm), where no base mount covers
//     that path (/dev/shm itself excepted, which the builder mounts over the base's /dev).
//
// Anything else refuses: a tmpfs or another proc mounted inside (a new superblock), a
// bind that shows a directory elsewhere, a mount stacked over /dev. Mounts made inside
// the sandbox vanish at the next checkpoint anyway (each state is a new namespace).

// mountLine is one line of /proc/PID/mountinfo.
type mountLine struct {
	id, parent int
	dev        string // "major:minor" of the superblock
	root       string // the mount's root within its filesystem
	point      string // the mount point, as the process sees it
	fstype     string
	source     string
}

// parseMountinfo parses /proc/PID/mountinfo (Documentation/filesystems/proc.rst): "id
// parent major:minor root point options [optional fields] - fstype source superoptions",
// paths with space, tab, newline and backslash escaped in octal.
func parseMountinfo(b []byte) []mountLine {
	var out []mountLine
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) < 7 {
			continue
		}
		sep := -1
		for i := 6; i < len(f); i++ {
			if f[i] == "-" {
				sep = i
				break
			}
		}
		if sep < 0 || sep+2 >= len(f) {
			continue
		}
		id, err1 := strconv.Atoi(f[0])
		parent, err2 := strconv.Atoi(f[1])
		if err1 != nil || err2 != nil {
			continue
		}
		out = append(out, mountLine{id: id, parent: parent, dev: f[2], root: unescapeOctal(f[3]),
			point: unescapeOctal(f[4]), fstype: f[sep+1], source: unescapeOctal(f[sep+2])})
	}
	return out
}

// unescapeOctal undoes the kernel's \ooo escapes of mountinfo (seq_path_root, mangle).
func unescapeOctal(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// mounts judges the mounts a process's files are on (inspect). rootMnt is the id of the
// mount its root is on; the tables are read on the first file found elsewhere.
type mounts struct {
	hostPid int
	rootMnt uint64

	read    bool
	err     error
	own     map[int]mountLine // the process's namespace, by id
	base    []mountLine       // the sandbox's base namespace (its init's)
	baseErr error             // why base could not be read
}

// where returns "" if mount mnt is the state's (see above), else what it is, for a
// refusal ("a tmpfs mounted inside the sandbox on /mnt/t").
func (m *mounts) where(mnt uint64) (string, error) {
	if mnt == m.rootMnt {
		return "", nil
	}
	if !m.read {
		m.read = true
		m.err = m.load()
	}
	if m.err != nil {
		return "", m.err
	}
	l, ok := m.own[int(mnt)]
	if !ok {
		return "a mount that is not in its mount namespace (detached, or another namespace's)", nil
	}
	root := m.own[int(m.rootMnt)]
	if m.baseErr != nil && l.dev != root.dev {
		return fmt.Sprintf("a %s on %s, which cannot be checked against the sandbox's own mounts (%v)", l.fstype, l.point, m.baseErr), nil
	}
	return judgeMount(l, root, m.base), nil
}

// judgeMount is where's rule for mount l of a namespace whose root mount is root, given
// the base namespace's mounts.
func judgeMount(l, root mountLine, base []mountLine) string {
	what := fmt.Sprintf("a %s mounted inside the sandbox on %s", l.fstype, l.point)
	if l.dev == root.dev {
		if l.root != l.point {
			return fmt.Sprintf("a bind mount of %s on %s made inside the sandbox", l.root, l.point)
		}
		if l.point == "/dev/shm" {
			return ""
		}
		for _, b := range base {
			if b.point != "/" && (l.point == b.point || strings.HasPrefix(l.point, strings.TrimSuffix(b.point, "/")+"/")) {
				return fmt.Sprintf("a bind mount of %s made inside the sandbox under %s", l.point, b.point)
			}
		}
		return ""
	}
	for _, b := range base {
		if b.point != "/" && b.dev == l.dev && b.root == l.root && b.point == l.point {
			return ""
		}
	}
	return what
}

// load reads the process's mount table and its sandbox init's.
func (m *mounts) load() error {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", m.hostPid))
	if err != nil {
		return fmt.Errorf("read the mount table of process %d: %w", m.hostPid, err)
	}
	m.own = map[int]mountLine{}
	for _, l := range parseMountinfo(b) {
		m.own[l.id] = l
	}
	if _, ok := m.own[int(m.rootMnt)]; !ok {
		return fmt.Errorf("process %d: its root's mount %d is not in its mount table", m.hostPid, m.rootMnt)
	}
	init, err := sandboxInit(m.hostPid)
	if err == nil {
		if b, err = os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", init)); err != nil {
			err = fmt.Errorf("read the mount table of the sandbox's init (%d): %w", init, err)
		}
	}
	if err != nil {
		m.baseErr = err // the overlay's mounts can still be judged
		return nil
	}
	m.base = parseMountinfo(b)
	return nil
}

// sandboxInit finds the host PID of the init of hostPid's PID namespace (its PID 1
// there) among its ancestors: every process of a sandbox descends from its init.
func sandboxInit(hostPid int) (int, error) {
	ns, err := procfs.NSpid(hostPid)
	if err != nil {
		return 0, err
	}
	depth := len(ns)
	for p := hostPid; p > 0; {
		f, err := procfs.NSpid(p)
		if err != nil {
			return 0, err
		}
		if len(f) != depth {
			break // left the namespace
		}
		if f[depth-1] == 1 {
			return p, nil
		}
		if p, err = ppid(p); err != nil {
			return 0, err
		}
	}
	return 0, fmt.Errorf("process %d: no init of its PID namespace among its ancestors", hostPid)
}

// ppid returns hostPid's parent (host PIDs), from /proc/PID/stat.
func ppid(hostPid int) (int, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(hostPid) + "/stat")
	if err != nil {
		return 0, err
	}
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return 0, fmt.Errorf("process %d: unreadable stat", hostPid)
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 2 {
		return 0, fmt.Errorf("process %d: unreadable stat", hostPid)
	}
	return strconv.Atoi(f[1])
}

// statxAt is statx of path (a /proc magic link: the file itself), with its mount id.
func statxAt(path string) (unix.Statx_t, error) {
	var sx unix.Statx_t
	err := unix.Statx(unix.AT_FDCWD, path, 0, unix.STATX_BASIC_STATS|unix.STATX_MNT_ID, &sx)
	return sx, err
}
