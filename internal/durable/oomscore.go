package durable

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"

	criu_core "github.com/checkpoint-restore/go-criu/v7/crit/images/criu-core"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

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
		tc, err := imageTaskCore(p)
		if err != nil {
			return nil, fmt.Errorf("read %s: %w", p, err)
		}
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

// imageTaskCore is the task part of the core image at path (nil for a thread's). The
// image is framed as images.go says, with one entry. (Not go-criu's crit package: it
// cannot be linked beside go-criu's stats package, unixsk.go says why.)
func imageTaskCore(path string) (*criu_core.TaskCoreEntry, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	if len(b) < 12 || binary.LittleEndian.Uint32(b) != imgCommonMagic || binary.LittleEndian.Uint32(b[4:]) != coreMagic {
		return nil, errors.New("not a CRIU core image")
	}
	n := int(binary.LittleEndian.Uint32(b[8:]))
	if 12+n != len(b) {
		return nil, fmt.Errorf("an entry of %d bytes in %d, want one", n, len(b)-12)
	}
	var ce criu_core.CoreEntry
	if err := proto.Unmarshal(b[12:], &ce); err != nil {
		return nil, err
	}
	return ce.GetTc(), nil
}

// setOOMScores gives each process of want (by its PID in pidNS) its oom_score_adj, as
// the package comment above says.
func setOOMScores(pidNS *os.File, want map[int]int32) error {
	if len(want) == 0 {
		return nil
	}
	host, err := hostPids(pidNS, want)
	if err != nil {
		return err
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
				p := host[inner]
				if p == 0 {
					return fmt.Errorf("process %d of the image is not in the sandbox", inner)
				}
				if err := os.WriteFile(fmt.Sprintf("/proc/%d/oom_score_adj", p), []byte(strconv.Itoa(int(v))), 0); err != nil {
					return fmt.Errorf("give process %d its oom_score_adj %d again: %w", inner, v, err)
				}
			}
			return nil
		}()
	}()
	return <-errc
}

// hostPids finds the host PIDs of the processes of pidNS whose PIDs there are want's
// keys (one scan of /proc).
func hostPids[V any](pidNS *os.File, want map[int]V) (map[int]int, error) {
	var ns unix.Stat_t
	if err := unix.Fstat(int(pidNS.Fd()), &ns); err != nil {
		return nil, err
	}
	out := map[int]int{}
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil, err
	}
	for _, e := range ents {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		var st unix.Stat_t
		if unix.Stat(fmt.Sprintf("/proc/%d/ns/pid", p), &st) != nil || st.Ino != ns.Ino || st.Dev != ns.Dev {
			continue
		}
		if in, err := procfs.InnerPid(p); err == nil {
			if _, ok := want[in]; ok {
				out[in] = p
			}
		}
	}
	return out, nil
}
