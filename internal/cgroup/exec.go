package cgroup

// A group per exec, so that an exec's timeout or cancellation ends everything the
// command started, whatever session or process group its descendants moved to
// (`setsid sleep 1000 &`, a fork bomb): the kernel keeps a process in its parent's
// cgroups across setsid, setpgid and reparenting to init, and nothing in the sandbox can
// move it out (its seccomp filter refuses mount, so it has no cgroup filesystem).
//
// Why the v1 pids hierarchy and not a cgroup2 child with cgroup.kill: a process lands
// in a cgroup2 child only by clone3's CLONE_INTO_CGROUP or by a migration, and both are
// refused to init's spawn thread. The sandbox's seccomp filter, installed by that thread
// before it forks, answers clone3 with ENOSYS (its flags are in memory, out of BPF's
// reach), and a migration needs write access to the common ancestor's cgroup.procs,
// which belongs to the host's root (chowning it to the sandbox would let its processes
// move themselves out of their exec's group). v1, on the other hand, places single
// threads: the spawn thread writes "0" into the exec group's tasks, through an fd the
// daemon opened (v1 checks the opener's credentials), after joining the sandbox's limit
// groups, and the fork inherits it. The pids hierarchy is always there (its limit is
// required), is hierarchical (the sandbox's pids.max still bounds the exec's
// processes), and its pids.max of 0 stops every fork in the group at once, which is
// what makes the kill hold against a fork bomb with no freezer.
//
// The cgroup2 directory (Group) stays flat: the fast path's reading of the sandbox's
// PIDs (Group.Pids) needs no recursion.

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// ExecGroup is one exec's pids group, a child of the sandbox's.
type ExecGroup struct {
	Dir string
	rel string // Dir under the pids mount, as /proc/PID/cgroup names it
}

// execSeq names exec groups uniquely in this daemon; a name left by a previous
// daemon is skipped (Mkdir's EEXIST).
var execSeq atomic.Uint64

// execPrefix starts every exec group's name.
const execPrefix = "exec-"

// NewExecGroup makes an exec group under the sandbox's pids directory.
func (v *V1) NewExecGroup() (*ExecGroup, error) {
	parent := v.dirs["pids"]
	if parent == "" {
		return nil, fmt.Errorf("sandbox %s has no pids cgroup to put an exec in", v.ID)
	}
	for range 100 {
		d := filepath.Join(parent, execPrefix+strconv.FormatUint(execSeq.Add(1), 10))
		err := unix.Mkdir(d, 0o755)
		if errors.Is(err, unix.EEXIST) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("create the exec's cgroup %s: %w", d, err)
		}
		rel, _ := filepath.Rel(filepath.Join(V1Mount, "pids"), d)
		return &ExecGroup{Dir: d, rel: "/" + rel}, nil
	}
	return nil, fmt.Errorf("no free exec cgroup name under %s", parent)
}

// OpenTasks opens the group's tasks file for writing: the spawn thread that writes "0"
// into it puts the command there (sbinit.SpawnOptions.Tasks). The caller closes it.
func (g *ExecGroup) OpenTasks() (*os.File, error) {
	return os.OpenFile(filepath.Join(g.Dir, "tasks"), os.O_WRONLY|unix.O_CLOEXEC, 0)
}

// Kill ends every process in the group: forks are stopped first (pids.max 0: a fork
// bomb cannot outrun the kill), then each process is sent SIGKILL until the group
// lists none, for timeout at most. A process is signalled through a pidfd and only once
// its /proc entry shows it still in the group, so a PID freed and reused by another
// process between the listing and the signal is never hit.
func (g *ExecGroup) Kill(timeout time.Duration) error {
	if err := writeFile(filepath.Join(g.Dir, "pids.max"), "0"); err != nil {
		return err
	}
	deadline := time.Now().Add(timeout)
	for {
		pids, err := g.procs()
		if err != nil {
			return err
		}
		if len(pids) == 0 {
			return nil
		}
		for _, pid := range pids {
			g.kill(pid)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the exec's cgroup %s still has %d processes %v after %v of SIGKILL (uninterruptible sleep?)", g.Dir, len(pids), pids, timeout)
		}
		time.Sleep(time.Millisecond)
	}
}

func (g *ExecGroup) kill(pid int) {
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return // gone
	}
	defer unix.Close(fd)
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cgroup")
	if err != nil {
		return
	}
	for _, l := range strings.Split(string(b), "\n") {
		// ID:CONTROLLERS:PATH
		f := strings.SplitN(l, ":", 3)
		if len(f) == 3 && hasController(f[1], "pids") && f[2] == g.rel {
			unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0)
			return
		}
	}
}

func hasController(list, c string) bool {
	for _, x := range strings.Split(list, ",") {
		if x == c {
			return true
		}
	}
	return false
}

// procs lists the group's processes (host PIDs). A zombie is no longer listed.
func (g *ExecGroup) procs() ([]int, error) {
	b, err := os.ReadFile(filepath.Join(g.Dir, "cgroup.procs"))
	if err != nil {
		return nil, err
	}
	var out []int
	for _, f := range strings.Fields(string(b)) {
		if pid, err := strconv.Atoi(f); err == nil {
			out = append(out, pid)
		}
	}
	return out, nil
}

// Remove removes the group if no process is left in it (a zombie not yet reaped
// counts): false when some are, as after a normal exit that left `nohup server &`
// running, which must go on. Such a group is removed later (RemoveIdleExecGroups), or
// with the sandbox.
func (g *ExecGroup) Remove() bool {
	err := unix.Rmdir(g.Dir)
	return err == nil || errors.Is(err, unix.ENOENT)
}

// RemoveIdleExecGroups removes the sandbox's exec groups that no process is in any
// more, and says how many are left.
func (v *V1) RemoveIdleExecGroups() int {
	parent := v.dirs["pids"]
	if parent == "" {
		return 0
	}
	ents, _ := os.ReadDir(parent)
	left := 0
	for _, e := range ents {
		if e.IsDir() && strings.HasPrefix(e.Name(), execPrefix) {
			if unix.Rmdir(filepath.Join(parent, e.Name())) != nil {
				left++
			}
		}
	}
	return left
}
