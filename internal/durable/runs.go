package durable

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/procfs"
)

// CRIU runs that outlive their daemon.
//
// A `criu swrk` does not end with the daemon that started it: nothing signals it at its
// parent's death, and it reads its socket only for the request and at notifications, so
// a daemon killed during a dump leaves CRIU dumping. The next daemon must not touch the
// tree before CRIU lets go of it: SIGCONT does not end the ptrace-stop CRIU holds each
// task in, so CRIU, finishing later, leaves the tree stopped (leave_stopped) with no one
// to continue it; and RepairOff would take repair mode off sockets CRIU is reading.
//
// So each run is recorded in Runner.Runs (criu-PID.json: host PID, start time, boot,
// deadline) after CRIU starts and before the request is sent, and the record goes once
// CRIU is reaped. A crash at any line leaves what LeftRuns and End repair:
//
//   - before the record: CRIU waits for a request; the daemon's death closes the other
//     end of its socket and CRIU exits (EOF), having touched nothing;
//   - criu-PID.json.tmp written, not renamed: removed;
//   - recorded: CRIU may be working; End gives it until its deadline, as its daemon
//     would have, then kills it with its process group;
//   - CRIU reaped, its record left: its PID is gone or another process's (start time,
//     boot), and the record goes.
//
// Records are not synced: one matters only while its CRIU runs, and a machine crash
// ends both.
//
// Not a parent-death signal (PR_SET_PDEATHSIG): it fires when the thread that forked the
// child exits, and the runtime ends threads (a goroutine that exits locked ends its
// own: call.start's when its way back fails, the tracers'), so CRIU would need a thread
// locked for its whole run; and it would kill CRIU at once. Killed in mid-dump, CRIU
// leaves its parasite mapped in each task it infected (6 MB of "/memfd:CRIUMFD
// (deleted)" per killed dump, measured on a 1.5 GB python); let finish, it leaves the
// tree as a dump does, which the next start repairs (proctree.ContinueCut, adoption).

// runRecord is one CRIU run's record.
type runRecord struct {
	Pid      int       `json:"pid"`
	Start    uint64    `json:"start"` // clock ticks after boot (procfs.StartTime)
	Boot     string    `json:"boot"`  // /proc/sys/kernel/random/boot_id
	Deadline time.Time `json:"deadline"`
	What     string    `json:"what"`
}

const runPrefix, runSuffix = "criu-", ".json"

// bootID is this boot's id: a PID and start time name one process within a boot only.
var bootID = sync.OnceValues(func() (string, error) {
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	return strings.TrimSpace(string(b)), err
})

// recordRun records CRIU's run as pid (host PID), which ends by deadline, in dir (""
// records nothing), and returns what removes the record once CRIU is reaped.
func recordRun(dir string, pid int, what string, deadline time.Time) (remove func(), err error) {
	if dir == "" {
		return func() {}, nil
	}
	boot, err := bootID()
	if err != nil {
		return nil, err
	}
	start, err := procfs.StartTime(pid)
	if err != nil {
		return nil, err
	}
	b, err := json.Marshal(runRecord{Pid: pid, Start: start, Boot: boot, Deadline: deadline, What: what})
	if err != nil {
		return nil, err
	}
	path := filepath.Join(dir, runPrefix+strconv.Itoa(pid)+runSuffix)
	if err := os.WriteFile(path+".tmp", b, 0o600); err != nil {
		return nil, fmt.Errorf("record CRIU's run: %w", err)
	}
	if err := os.Rename(path+".tmp", path); err != nil {
		_ = os.Remove(path + ".tmp") // LeftRuns removes what stays
		return nil, fmt.Errorf("record CRIU's run: %w", err)
	}
	// A record that stays names a PID gone, or another process: LeftRuns removes it.
	return func() { _ = os.Remove(path) }, nil
}

// LeftRun is a CRIU run a dead daemon left: its process still runs.
type LeftRun struct {
	What     string
	Pid      int
	Deadline time.Time
	pidfd    int
	path     string
}

// LeftRuns returns the CRIU runs recorded in dir (Runner.Runs) whose process still runs
// under the PID, start time and boot recorded (a zombie has let its tracees go), and
// removes the other records. The
// caller ends each (End) before it touches a sandbox's processes.
func LeftRuns(dir string) ([]*LeftRun, error) {
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	boot, err := bootID()
	if err != nil {
		return nil, err
	}
	var runs []*LeftRun
	var errs []error
	for _, e := range ents {
		path := filepath.Join(dir, e.Name())
		switch {
		case !strings.HasPrefix(e.Name(), runPrefix):
			continue // not a record
		case strings.HasSuffix(e.Name(), runSuffix+".tmp"):
			errs = append(errs, removeRecord(path)) // cut before its rename
			continue
		case !strings.HasSuffix(e.Name(), runSuffix):
			continue
		}
		var r runRecord
		if b, err := os.ReadFile(path); err != nil || json.Unmarshal(b, &r) != nil || r.Boot != boot || r.Pid <= 0 {
			errs = append(errs, removeRecord(path))
			continue
		}
		// The pidfd before the start time: if the process it holds still runs after the
		// read, the PID was its own during the read.
		fd, err := unix.PidfdOpen(r.Pid, 0)
		if err != nil {
			errs = append(errs, removeRecord(path)) // ESRCH: gone
			continue
		}
		st, err := procfs.StartTime(r.Pid)
		if err != nil || st != r.Start || procfs.State(r.Pid) == 'Z' || unix.PidfdSendSignal(fd, 0, nil, 0) != nil {
			_ = unix.Close(fd) // a pidfd: nothing to flush
			errs = append(errs, removeRecord(path))
			continue
		}
		runs = append(runs, &LeftRun{What: r.What, Pid: r.Pid, Deadline: r.Deadline, pidfd: fd, path: path})
	}
	return runs, errors.Join(errs...)
}

func removeRecord(path string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// leftRunWait caps End's wait for a run to finish (a deadline recorded under another
// clock); killWait bounds its wait for a killed one to exit.
const (
	leftRunWait = max(DumpTimeout, RestoreTimeout)
	killWait    = 5 * time.Second
)

// End waits for the run to exit until its recorded deadline, as its daemon would have,
// then kills it with its process group (CRIU leads one: deadline.Command), and returns
// once it has exited: its tracees are let go by then (the kernel detaches them before
// it reports the exit). killed says whether it had to be killed. The record goes with
// the process; on error it stays, for the next start.
func (r *LeftRun) End() (killed bool, err error) {
	defer func() { _ = unix.Close(r.pidfd) }() // a pidfd: nothing to flush
	if !exited(r.pidfd, min(time.Until(r.Deadline), leftRunWait)) {
		killed = true
		// Its group while it lives: its PID, which names the group, is not reused.
		_ = unix.Kill(-r.Pid, unix.SIGKILL)                     // ESRCH: gone meanwhile
		_ = unix.PidfdSendSignal(r.pidfd, unix.SIGKILL, nil, 0) // ESRCH: gone meanwhile
		if !exited(r.pidfd, killWait) {
			return killed, fmt.Errorf("%s (pid %d), which a previous daemon left running, did not exit within %v of SIGKILL", r.What, r.Pid, killWait)
		}
	}
	return killed, removeRecord(r.path)
}

// exited waits up to d (none if d <= 0) for pidfd's process to exit.
func exited(pidfd int, d time.Duration) bool {
	until := time.Now().Add(max(d, 0))
	for {
		fds := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
		n, err := unix.Poll(fds, int(max(time.Until(until), 0).Milliseconds()))
		if err == unix.EINTR {
			continue
		}
		if err != nil || n > 0 {
			return err == nil // a pidfd is readable once its process exited
		}
		if !time.Now().Before(until) {
			return false
		}
	}
}
