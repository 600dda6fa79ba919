package durable

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"deltabox/internal/procfs"
)

// oom_score_adj: CRIU restores a process's oom_score_adj from its core image in the
// process itself (cr-restore.c:prepare_oom_score_adj writes /proc/self/oom_score_adj),
// after the process joined the sandbox's user namespace and became its root. That
// setuid made it non-dumpable, and its mm was made in the host's user namespace, so its
// /proc files are the host root's, which the sandbox's root may not write: the open
// fails (EACCES), CRIU only logs it ("Can't open 0/oom_score_adj on procfs"), and the
// process keeps CRIU's value, the daemon's (zdtm's oom_score_adj: 400 came back 0).
//
// So the daemon writes each process's value from its image, at CRIU's post-restore
// notification (the tree restored, not yet resumed; an error aborts the restore, and
// CRIU kills the tree), from a thread without CAP_SYS_RESOURCE: the kernel then allows
// only what the process could set itself (not below the oom_score_adj_min that it
// inherits from CRIU, as every process of the sandbox does from the daemon) and leaves
// that minimum as it was.

// imageOOMScores reads, from the core images in dir, each process's oom_score_adj by its
// PID in the sandbox (processes alive or stopped at the dump; threads have none).
func imageOOMScores(dir string) (map[int]int32, error) {
	cores, err := filepath.Glob(filepath.Join(dir, "core-*.img"))
	if err != nil {
		return nil, err
	}
	out := map[int]int32{}
	for _, p := range cores {
		pid, err := strconv.Atoi(strings.TrimSuffix(strings.TrimPrefix(filepath.Base(p), "core-"), ".img"))
		if err != nil {
			continue
		}
		c, err := readCore(p)
		if err != nil {
			return nil, err
		}
		tc := c.GetTc()
		// CRIU's TASK_ALIVE and TASK_STOPPED; a zombie's (TASK_DEAD) is not restored.
		if tc != nil && tc.OomScoreAdj != nil && (tc.GetTaskState() == 1 || tc.GetTaskState() == 3) {
			out[pid] = tc.GetOomScoreAdj()
		}
	}
	return out, nil
}

// notInherited keeps, of want, the values the restored processes would not have anyway:
// a process CRIU restores inherits CRIU's oom_score_adj, the daemon's (CRIU's own write
// of the image's value fails, above). Most processes keep the value they were started
// with, and then nothing is written at all and the restore needs no post-restore
// notification: each of CRIU's notifications is a round trip with the daemon before the
// restore goes on.
func notInherited(want map[int]int32) map[int]int32 {
	b, err := os.ReadFile("/proc/self/oom_score_adj")
	if err != nil {
		return want // unknown: write every value
	}
	self, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return want
	}
	out := map[int]int32{}
	for p, v := range want {
		if int(v) != self {
			out[p] = v
		}
	}
	return out
}

// setOOMScores gives each process of want (by its PID in pidNS) its oom_score_adj, as
// the package comment above says. Each value is written through the process's own
// /proc directory, opened when it was found in pidNS (sandboxProcs): a process that
// ended since fails the write (ESRCH), and its host PID, even taken again by another
// process (of the host, or of another sandbox), is never written to.
func setOOMScores(pidNS *os.File, want map[int]int32) error {
	if len(want) == 0 {
		return nil
	}
	dirs, err := sandboxProcs(pidNS, want)
	if err != nil {
		return err
	}
	defer func() {
		for _, d := range dirs {
			unix.Close(d)
		}
	}()
	if beforeOOMWrite != nil {
		beforeOOMWrite()
	}
	errc := make(chan error, 1)
	go func() {
		// The thread is dropped, never unlocked: its capabilities are not the
		// daemon's any more.
		runtime.LockOSThread()
		errc <- func() error {
			hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
			var c [2]unix.CapUserData
			if err := unix.Capget(&hdr, &c[0]); err != nil {
				return fmt.Errorf("capget: %w", err)
			}
			c[unix.CAP_SYS_RESOURCE/32].Effective &^= 1 << (unix.CAP_SYS_RESOURCE % 32)
			if err := unix.Capset(&hdr, &c[0]); err != nil {
				return fmt.Errorf("capset: %w", err)
			}
			for inner, v := range want {
				d, ok := dirs[inner]
				if !ok {
					return fmt.Errorf("process %d of the image is not in the sandbox", inner)
				}
				if err := writeAt(d, "oom_score_adj", strconv.Itoa(int(v))); err != nil {
					return fmt.Errorf("give process %d its oom_score_adj %d again: %w", inner, v, err)
				}
			}
			return nil
		}()
	}()
	return <-errc
}

// beforeOOMWrite, when set (tests), runs between setOOMScores' scan and its writes.
var beforeOOMWrite func()

// writeAt writes s to the file name of directory dir.
func writeAt(dir int, name, s string) error {
	fd, err := unix.Openat(dir, name, unix.O_WRONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	_, err = unix.Write(fd, []byte(s))
	if cerr := unix.Close(fd); err == nil {
		err = cerr
	}
	return err
}

// sandboxProcs opens the /proc directory (O_PATH) of each process of pidNS whose PID
// there is one of want's keys, by that PID (one scan of /proc); the caller closes them.
// Its namespace and its PID there are read through that directory, which stays the
// process's: a host PID that ended and was taken again between the checks is not
// mistaken for the sandbox's process.
func sandboxProcs[V any](pidNS *os.File, want map[int]V) (map[int]int, error) {
	var ns unix.Stat_t
	if err := unix.Fstat(int(pidNS.Fd()), &ns); err != nil {
		return nil, err
	}
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil, err
	}
	out := map[int]int{}
	for _, e := range ents {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		d, err := unix.Open("/proc/"+e.Name(), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			continue // ended since
		}
		if in := innerPidIn(d, &ns); in != 0 {
			if _, ok := want[in]; ok {
				if old, ok := out[in]; ok {
					unix.Close(old)
				}
				out[in] = d
				continue
			}
		}
		unix.Close(d)
	}
	return out, nil
}

// innerPidIn is the PID, in the namespace ns describes, of the process whose /proc
// directory is dir; 0 if it is not in that namespace (or ended).
func innerPidIn(dir int, ns *unix.Stat_t) int {
	var st unix.Stat_t
	if unix.Fstatat(dir, "ns/pid", &st, 0) != nil || st.Ino != ns.Ino || st.Dev != ns.Dev {
		return 0
	}
	fd, err := unix.Openat(dir, "status", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0
	}
	f := os.NewFile(uintptr(fd), "status")
	b, err := io.ReadAll(f)
	_ = f.Close() // read-only, after the read
	if err != nil {
		return 0
	}
	pids, err := procfs.ParseNSpid(b)
	if err != nil {
		return 0
	}
	return pids[len(pids)-1]
}
