package cgroup

// A group per exec, so that an exec's timeout or cancellation ends everything the
// command started, whatever session or process group its descendants moved to
// (`setsid sleep 1000 &`, a fork bomb): the kernel keeps a process in its parent's
// cgroups across setsid, setpgid and reparenting to init, and nothing in the sandbox can
// move it out (its seccomp filter refuses mount, so it has no cgroup filesystem).
//
// Why a v1 freezer group and not a cgroup2 child with cgroup.kill: a process lands in a
// cgroup2 child only by clone3's CLONE_INTO_CGROUP or by a migration, and both are
// refused to init's spawn thread. The sandbox's seccomp filter, installed by that thread
// before it forks, answers clone3 with ENOSYS (its flags are in memory, out of BPF's
// reach), and a migration needs write access to the common ancestor's cgroup.procs,
// which belongs to the host's root (chowning it to the sandbox would let its processes
// move themselves out of their exec's group). v1, on the other hand, places single
// threads: the spawn thread writes "0" into the exec group's tasks, through an fd the
// daemon opened (v1 checks the opener's credentials), after joining the sandbox's limit
// groups, and the fork inherits it. The freezer is what makes the kill hold against a
// fork bomb: frozen, nothing in the group forks; SIGKILLed while frozen, each dies when
// thawed. Why not the pids hierarchy (pids.max 0 also stops forks): v1 counts a fork
// its limit refused in the forking task's group (pids.events), which would move the
// sandbox's pids_limit_hits into groups that go with their exec.
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

// ExecGroup is one exec's freezer group, a child of the sandbox's.
type ExecGroup struct {
	Dir string
	rel string // Dir under the pids mount, as /proc/PID/cgroup names it
}

// execSeq names exec groups uniquely in this daemon; a name left by a previous
// daemon is skipped (Mkdir's EEXIST).
var execSeq atomic.Uint64

// execPrefix starts every exec group's name; execController is their hierarchy.
const execPrefix, execController = "exec-", "freezer"

// NewExecGroup makes an exec group under the sandbox's freezer directory.
func (v *V1) NewExecGroup() (*ExecGroup, error) {
	parent := v.dirs[execController]
	if parent == "" {
		return nil, fmt.Errorf("sandbox %s has no %s cgroup to put an exec in: the cgroup v1 %s controller is not mounted at %s (run scripts/setup.sh)",
			v.ID, execController, execController, filepath.Join(V1Mount, execController))
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
		rel, _ := filepath.Rel(filepath.Join(V1Mount, execController), d)
		return &ExecGroup{Dir: d, rel: "/" + rel}, nil
	}
	return nil, fmt.Errorf("no free exec cgroup name under %s", parent)
}

// OpenTasks opens the group's tasks file for writing: the spawn thread that writes "0"
// into it puts the command there (sbinit.SpawnOptions.Tasks). The caller closes it.
func (g *ExecGroup) OpenTasks() (*os.File, error) {
	return os.OpenFile(filepath.Join(g.Dir, "tasks"), os.O_WRONLY|unix.O_CLOEXEC, 0)
}

// Kill ends every process in the group: the group is frozen (nothing in it forks, a
// fork bomb cannot outrun the kill), each process is sent SIGKILL, and the group is
// thawed, which lets them die; again until the group lists none, for timeout at most.
// A process is signalled through a pidfd and only once its /proc entry shows it still
// in the group, so a PID freed and reused by another process between the listing and
// the signal is never hit.
func (g *ExecGroup) Kill(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	state := filepath.Join(g.Dir, "freezer.state")
	for {
		if err := writeFile(state, "FROZEN"); err != nil {
			return err
		}
		// A task in uninterruptible sleep keeps the group FREEZING: it is killed anyway,
		// and the next round finds what it forked meanwhile.
		for i := 0; i < 100 && !frozen(state); i++ {
			time.Sleep(time.Millisecond)
		}
		pids, err := g.procs()
		if err != nil {
			return err
		}
		for _, pid := range pids {
			g.kill(pid)
		}
		if err := writeFile(state, "THAWED"); err != nil {
			return err
		}
		if len(pids) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the exec's cgroup %s still has %d processes %v after %v of SIGKILL (uninterruptible sleep?)", g.Dir, len(pids), pids, timeout)
		}
		time.Sleep(time.Millisecond)
	}
}

func frozen(state string) bool {
	b, err := os.ReadFile(state)
	return err == nil && strings.TrimSpace(string(b)) == "FROZEN"
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
		if len(f) == 3 && hasController(f[1], execController) && f[2] == g.rel {
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
	parent := v.dirs[execController]
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
