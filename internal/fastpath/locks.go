package fastpath

import (
	"encoding/binary"
	"fmt"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"deltabox/internal/remote"
)

// File locks and shared open file descriptions.
//
// Kernel facts (fs/locks.c, fs/proc/fd.c):
//   - flock(2) locks and OFD locks (F_OFD_SETLK) belong to an open file description.
//     fork shares it, so the template holds them too; a reopened fd is a new description
//     without them.
//   - POSIX locks (F_SETLK, lockf) belong to the process: fork does not copy them, and
//     closing any fd of the file drops all of the process's locks on it. The move's
//     dup3 over the old fd drops them from the old file.
//   - /proc/PID/fdinfo/N lists, on "lock:" lines, the locks set through that open file
//     description and owned by that process (a POSIX lock under the fd it was set
//     through), so the locks of a stopped process can be read without /proc/locks.
//
// So a process's locks are read at the checkpoint (inspect) and set again, on the
// reopened files, by the same batch that moves it (Move, and Revive for a restored
// child), after every fd and mapping has been put in place: a close of the batch's own
// temporary fd of the file would drop a POSIX lock set before it. The move first
// releases the flock and OFD locks through the descriptions it shares with the template
// (unlockCalls): left there, a checkpoint with no change, which keeps the mount and so
// reopens the same inodes, would find its own new exclusive lock refused by the
// template's. MoveBack takes the template's descriptions back and sets every lock
// again. The calls do not block (LOCK_NB, F_SETLK): at a checkpoint nothing else can
// hold the new state's files, at a restore the sandbox's other processes are gone, and
// a conflict fails the operation with the lock named rather than hanging it.
// Leases and delegations, and locks on terminals and devices (which are not reopened),
// make the process ineligible.
//
// fds that share one open file description (dup, dup2, F_DUPFD, a shell's `exec 4>&3`)
// are found with kcmp(KCMP_FILE) and stay shared: the lowest is reopened, the others are
// dup3s of it, so a write through one moves the offset of the others as before.

// Lock is a file lock a process holds through one of its fds.
type Lock struct {
	Kind  string // "flock", "posix" or "ofd"
	Write bool   // exclusive (flock LOCK_EX, F_WRLCK), or shared
	Start int64  // first byte (posix and ofd)
	End   int64  // last byte, or -1: to the end of the file, however long
}

func (l Lock) String() string {
	mode := "read"
	if l.Write {
		mode = "write"
	}
	if l.Kind == "flock" {
		return "flock " + mode
	}
	end := "EOF"
	if l.End >= 0 {
		end = strconv.FormatInt(l.End, 10)
	}
	return fmt.Sprintf("%s %s %d-%s", l.Kind, mode, l.Start, end)
}

// parseLock parses the fields of an fdinfo "lock:" line after "lock:", as
// lock_get_status prints them: "1:", kind, "ADVISORY", type, pid, dev:ino, start, end.
// What the fast path cannot set again (leases, delegations, anything unknown) is an error
// that says what it is.
func parseLock(f []string) (Lock, error) {
	if len(f) < 8 {
		return Lock{}, fmt.Errorf("unreadable lock %q", strings.Join(f, " "))
	}
	var l Lock
	switch f[1] {
	case "FLOCK":
		l.Kind = "flock"
	case "POSIX":
		l.Kind = "posix"
	case "OFDLCK":
		l.Kind = "ofd"
	case "LEASE", "BREAKING", "BREAKER", "DELEG":
		return Lock{}, fmt.Errorf("a lease (%s), which a fork would share with the template", strings.Join(f[1:4], " "))
	default:
		return Lock{}, fmt.Errorf("a lock of kind %s, which the fast path cannot set again", f[1])
	}
	if f[2] != "ADVISORY" {
		return Lock{}, fmt.Errorf("a %s lock (%s), which the fast path cannot set again", f[1], f[2])
	}
	switch f[3] {
	case "WRITE":
		l.Write = true
	case "READ":
	default:
		return Lock{}, fmt.Errorf("a %s lock of type %s", f[1], f[3])
	}
	var err error
	if l.Start, err = strconv.ParseInt(f[6], 10, 64); err != nil {
		return Lock{}, fmt.Errorf("unreadable lock start %q", f[6])
	}
	l.End = -1
	if f[7] != "EOF" {
		if l.End, err = strconv.ParseInt(f[7], 10, 64); err != nil {
			return Lock{}, fmt.Errorf("unreadable lock end %q", f[7])
		}
	}
	return l, nil
}

// sameFile reports whether fd a of process pa and fd b of process pb are one open file
// description (kcmp KCMP_FILE; the caller has ptrace read access: the daemon is root).
func sameFile(pa, a, pb, b int) (bool, error) {
	r, _, errno := unix.Syscall6(unix.SYS_KCMP, uintptr(pa), uintptr(pb), 0 /* KCMP_FILE */, uintptr(a), uintptr(b), 0)
	if errno != 0 {
		return false, fmt.Errorf("kcmp: %w", errno)
	}
	return r == 0, nil
}

// SharedLock finds an fd of b that is the very open file description of an fd of a
// holding a flock or OFD lock (a description inherited across a fork, or passed): each
// process would take the lock again on a copy of its own, and the second would be
// refused. It returns b's fd and a's, or ok false.
func SharedLock(a, b *Proc) (fdB, fdA int, ok bool) {
	for _, f := range a.FDs {
		locked := false
		for _, l := range f.Locks {
			locked = locked || l.Kind != "posix"
		}
		if !locked {
			continue
		}
		for _, g := range b.FDs {
			if g.Path != f.Path || (g.Kind != "file" && g.Kind != "dir") {
				continue
			}
			if same, err := sameFile(a.HostPid, f.Num, b.HostPid, g.Num); err != nil || same {
				return g.Num, f.Num, true // an error: cannot tell, so not taken
			}
		}
	}
	return 0, 0, false
}

// lockCalls appends to b the calls that set p's locks again on its fds. Precondition:
// last in its batch but for calls that close no fd of a locked file (a close drops the
// process's POSIX locks on the file).
func lockCalls(b *remote.Batch, p *Proc) {
	setLockCalls(b, p, false)
}

// unlockCalls appends to b the calls that release p's flock and OFD locks through its
// current fds (the descriptions it shares with its template). Precondition: before the
// reopens of the same batch.
func unlockCalls(b *remote.Batch, p *Proc) {
	setLockCalls(b, p, true)
}

func setLockCalls(b *remote.Batch, p *Proc, unlock bool) {
	for _, f := range p.FDs {
		for _, l := range f.Locks {
			name := fmt.Sprintf("set the %s lock of fd %d (%s) again", l, f.Num, f.Path)
			if unlock {
				name = fmt.Sprintf("release the %s lock of fd %d (%s) from the template's description", l, f.Num, f.Path)
			}
			if l.Kind == "flock" {
				op := unix.LOCK_SH
				if l.Write {
					op = unix.LOCK_EX
				}
				if unlock {
					op = unix.LOCK_UN
				}
				b.Add(name, unix.SYS_FLOCK, f.Num, op|unix.LOCK_NB)
				continue
			}
			cmd := unix.F_OFD_SETLK
			if l.Kind == "posix" {
				if unlock {
					continue // the process's own: the move's dup3 drops it
				}
				cmd = unix.F_SETLK
			}
			b.Add(name, unix.SYS_FCNTL, f.Num, cmd, flockBytes(l, unlock))
		}
	}
}

// flockBytes is struct flock (x86-64: l_type, l_whence as shorts, padding, l_start,
// l_len, l_pid, padding: 32 bytes) for l, or for its release (F_UNLCK).
func flockBytes(l Lock, unlock bool) []byte {
	b := make([]byte, 32)
	typ := unix.F_RDLCK
	if l.Write {
		typ = unix.F_WRLCK
	}
	if unlock {
		typ = unix.F_UNLCK
	}
	binary.LittleEndian.PutUint16(b[0:], uint16(typ))
	binary.LittleEndian.PutUint16(b[2:], 0) // SEEK_SET
	binary.LittleEndian.PutUint64(b[8:], uint64(l.Start))
	var n int64 // 0: to the end of the file
	if l.End >= 0 {
		n = l.End - l.Start + 1
	}
	binary.LittleEndian.PutUint64(b[16:], uint64(n))
	return b
}
