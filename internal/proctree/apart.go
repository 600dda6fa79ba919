package proctree

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"deltabox/internal/durable"
	"deltabox/internal/fastpath"
	"deltabox/internal/procfs"
)

// What keeps trees from being taken apart: each is dumped and restored on its own, so
// what it shares with another tree, or with the daemon, CRIU would restore to nobody.

// SharedAcross refuses trees that share a pipe (`a | b &` whose shell has ended leaves two
// trees, one at each end) or a socket (`exec 3<>/dev/tcp/HOST/PORT; a & b &`): each
// tree is dumped and restored apart, and CRIU would restore each end as a pipe of its
// own, to nobody, and a socket twice: a TCP connection's second restore fails on the
// address its first took, at the checkpoint's move and at its undo alike, and the
// processes were lost.
func SharedAcross(roots []int, initHost int) error {
	owner := map[string]int{}
	for _, root := range roots {
		for _, p := range durable.Tree(root) {
			dir := fmt.Sprintf("/proc/%d/fd/", p)
			ents, _ := os.ReadDir(dir)
			for _, e := range ents {
				l, err := os.Readlink(dir + e.Name())
				if err != nil || !(strings.HasPrefix(l, "pipe:") || strings.HasPrefix(l, "socket:")) {
					continue
				}
				if o, ok := owner[l]; ok && o != root {
					return fmt.Errorf("processes %d and %d share %s, in two trees that CRIU would restore apart (start them under one parent that stays, or end one)",
						fastpath.SandboxPid(o, initHost), fastpath.SandboxPid(root, initHost), l)
				}
				owner[l] = root
			}
		}
	}
	return nil
}

// SessionsAcross refuses trees of which a process is in a session led by a live process
// outside its tree (a child that a session leader left to init, zdtm's session00): each
// tree is restored apart, and CRIU would restore the tree's root leading a session of
// its own (scripts/criu/0004), not in the leader's: a wrong session id. Init's session
// (sid 1, where an exec's jobs are) is the sandbox's, not a tree's; a session whose
// leader has ended has no one to be wrong about. alive answers for a sandbox PID.
func SessionsAcross(roots []int, initHost int, alive func(int) bool) error {
	treeOf := map[int]int{} // sandbox PID -> its tree's root (host PID)
	for _, root := range roots {
		for _, h := range durable.Tree(root) {
			treeOf[fastpath.SandboxPid(h, initHost)] = root
		}
	}
	for _, root := range roots {
		for _, h := range durable.Tree(root) {
			b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", h))
			if err != nil {
				continue // ended since
			}
			sid := 0
			for _, l := range strings.Split(string(b), "\n") {
				if v, ok := strings.CutPrefix(l, "NSsid:"); ok {
					if f := strings.Fields(v); len(f) > 0 {
						sid, _ = strconv.Atoi(f[len(f)-1])
					}
				}
			}
			if sid > 1 && treeOf[sid] != root && alive(sid) {
				return fmt.Errorf("process %d is in the session of process %d, which CRIU would not restore with it: its tree is restored apart and would lead a session of its own (a child its session leader left to init; start it with setsid, or end one of them)",
					fastpath.SandboxPid(h, initHost), sid)
			}
		}
	}
	return nil
}

// PipesToDaemon refuses a tree that holds a pipe whose other end is the daemon's (an
// exec's output, left to a background job): CRIU would restore it as a pipe to nobody,
// and the job would die of SIGPIPE at its next write.
func PipesToDaemon(root int) error {
	mine := map[string]bool{}
	ents, _ := os.ReadDir("/proc/self/fd")
	for _, e := range ents {
		if l, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil && strings.HasPrefix(l, "pipe:") {
			mine[l] = true
		}
	}
	for _, p := range durable.Tree(root) {
		dir := fmt.Sprintf("/proc/%d/fd/", p)
		ents, _ := os.ReadDir(dir)
		for _, e := range ents {
			if l, err := os.Readlink(dir + e.Name()); err == nil && mine[l] {
				return fmt.Errorf("its fd %s is %s, an exec's output, which the daemon reads (redirect the job's output to a file: job >log 2>&1 &)", e.Name(), l)
			}
		}
	}
	return nil
}

// IDsTaken refuses to move trees (each tree's processes, host PIDs) that are ended and
// restored with their PIDs (CRIU's clone3 set_tid), one tree after another, beside
// processes that outlive the move (staying, host PIDs: those the fast path moves
// instead), when a process of one is in a session or process group whose id is the PID
// of a process of another (a child its session leader left to init). The kernel keeps a
// PID taken while it names a live process's session or group, and CRIU makes a helper
// with that PID for a session or group led from outside the image: the restore would
// fail with EEXIST (pid N is taken), and so would its undo's.
func IDsTaken(trees [][]int, staying []int, initHost int) error {
	level := 0
	if in, err := procfs.NSpid(initHost); err == nil {
		level = len(in) - 1
	}
	const stays = -1
	owner := map[int]int{} // sandbox PID -> its tree's index, or stays
	for _, h := range staying {
		if p := fastpath.SandboxPid(h, initHost); p != 0 {
			owner[p] = stays
		}
	}
	for i, tree := range trees {
		for _, h := range tree {
			if p := fastpath.SandboxPid(h, initHost); p != 0 {
				owner[p] = i
			}
		}
	}
	check := func(h, mine int) error {
		sid, pgid := ids(h, level)
		for _, id := range []int{sid, pgid} {
			o, ok := owner[id]
			if !ok || o == mine {
				continue
			}
			what, whose := "session", "which CRIU took"
			if id != sid {
				what = "process group"
			}
			if o == stays {
				whose = "which the fast path carries"
			}
			return fmt.Errorf("process %d is in the %s of process %d, %s: moving the processes CRIU took onto the new state restores them with their PIDs, and the kernel keeps PID %d taken while a member of its %s lives (start the process with setsid, or end one of them)",
				fastpath.SandboxPid(h, initHost), what, id, whose, id, what)
		}
		return nil
	}
	for _, h := range staying {
		if err := check(h, stays); err != nil {
			return err
		}
	}
	for i, tree := range trees {
		for _, h := range tree {
			if err := check(h, i); err != nil {
				return err
			}
		}
	}
	return nil
}

// ids returns host PID h's session and process group ids at PID namespace level (0 the
// host's), or 0 for those it cannot read.
func ids(h, level int) (sid, pgid int) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", h))
	if err != nil {
		return 0, 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(l, ":")
		if f := strings.Fields(v); ok && len(f) > level {
			switch k {
			case "NSsid":
				sid, _ = strconv.Atoi(f[level])
			case "NSpgid":
				pgid, _ = strconv.Atoi(f[level])
			}
		}
	}
	return sid, pgid
}

// NoHolder is Holders's answer when no task, session or group has the PID.
const NoHolder = "no process holds it now"

// Holders says what holds sandbox PID pid in the PID namespace of the sandbox's init
// (host PID initHost): a task (process or thread) with that PID, with its command and
// state, or a process whose session or process group it names. It is read when a
// restore that must give a process its PID back fails with EEXIST, so that the error
// names the holder; NoHolder when it was freed meanwhile. Each /proc
// entry read is racy: the answer describes a moment, for a message.
func Holders(initHost, pid int) string {
	ns, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", initHost))
	if err != nil {
		return "unknown (the sandbox's init is gone)"
	}
	level := 0
	if in, err := procfs.NSpid(initHost); err == nil {
		level = len(in) - 1
	}
	var out []string
	procs, _ := os.ReadDir("/proc")
	for _, e := range procs {
		h, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if l, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", h)); err != nil || l != ns {
			continue // another namespace (a nested one is not looked into)
		}
		tasks, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", h))
		for _, te := range tasks {
			t, err := strconv.Atoi(te.Name())
			if err != nil {
				continue
			}
			b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/status", h, t))
			if err != nil {
				continue
			}
			if nsPid, _ := procfs.ParseNSpid(b); len(nsPid) > level && nsPid[level] == pid {
				out = append(out, fmt.Sprintf("task %d (host %d) of process %s, state %c", pid, t, describe(h, level), procfs.State(t)))
			}
		}
		sid, pgid := ids(h, level)
		if sid == pid {
			out = append(out, "the session of process "+describe(h, level))
		} else if pgid == pid {
			out = append(out, "the process group of process "+describe(h, level))
		}
	}
	if len(out) == 0 {
		return NoHolder
	}
	return strings.Join(out, "; ")
}

// describe names host process h as the sandbox sees it: "PID (comm)".
func describe(h, level int) string {
	p := h
	if in, err := procfs.NSpid(h); err == nil && len(in) > level {
		p = in[level]
	}
	comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", h))
	return fmt.Sprintf("%d (%s, host %d)", p, strings.TrimSpace(string(comm)), h)
}
