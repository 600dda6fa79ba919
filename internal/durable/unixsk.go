package durable

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
)

// A unix socket bound to a path is restored by CRIU by unlinking the path's socket file
// and binding a new socket there, in the state restored onto (the sandbox's, joined:
// --join-ns mnt). CRIU 4.1.1 records the mount of the socket's file at the dump (the
// dumped tree is in another mount namespace than CRIU), and its restore looks that mount
// up to enter its namespace; with the namespace joined rather than restored it has no
// mounts, and fails ("unix: Unable to find the 109 mount") after it unlinked the file: the
// socket's path was gone from the user's files. The mount is the state's, which the
// restore joins anyway: unixSocketMounts drops it from the image (mnt_id -1, CRIU's "not
// recorded"), and the socket is bound by its path in the joined state.

// files.img is framed as images.go says: two magics, then entries, each a little-endian
// u32 length and a protobuf message. (go-criu's crit package reads it too, but linking
// it beside go-criu's stats package panics at start: both register stats.proto.)
// (filesMagic: readonly.go.)

// unixSocketMounts rewrites dir's files.img without the mounts of unix sockets' files.
func unixSocketMounts(dir string) error {
	path := filepath.Join(dir, "files.img")
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if len(b) < 8 || binary.LittleEndian.Uint32(b) != imgCommonMagic || binary.LittleEndian.Uint32(b[4:]) != filesMagic {
		return fmt.Errorf("%s: not a CRIU files image", path)
	}
	out := append([]byte(nil), b[:8]...)
	changed := false
	for off := 8; off < len(b); {
		if off+4 > len(b) {
			return fmt.Errorf("%s: an entry cut at %d", path, off)
		}
		n := int(binary.LittleEndian.Uint32(b[off:]))
		if off+4+n > len(b) {
			return fmt.Errorf("%s: an entry cut at %d", path, off)
		}
		entry := b[off+4 : off+4+n]
		off += 4 + n
		var fe fdinfo.FileEntry
		if err := proto.Unmarshal(entry, &fe); err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
		if fe.Usk != nil && fe.Usk.MntId != nil && fe.Usk.GetMntId() >= 0 {
			fe.Usk.MntId = nil
			if entry, err = proto.Marshal(&fe); err != nil {
				return fmt.Errorf("%s: %w", path, err)
			}
			changed = true
		}
		out = binary.LittleEndian.AppendUint32(out, uint32(len(entry)))
		out = append(out, entry...)
	}
	if !changed {
		return nil
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, out, 0o644); err != nil {
		_ = os.Remove(tmp) // may not exist: the write's error is the one to report
		return err
	}
	return os.Rename(tmp, path)
}

// Binding a socket again changes its directory's times (CRIU unlinks the old socket file
// and binds a new one), and the new file has new times: at every checkpoint (its move is
// a restore) and restore, a listening socket's directory looked written to. Restore puts
// both back, at CRIU's post-restore: the directory and the socket file are opened in the
// state restored onto (openat2 confined to it, no symlink followed) before CRIU runs, and
// their times are read then; after CRIU bound the socket, the directory's times are set
// through its fd, and the socket file's (a socket, found again by its name in that
// directory, no symlink followed) to what the file it replaced had. The inode number and
// the change time stay new.

// boundSocket is a unix socket's file of the image, in the state restored onto, before
// CRIU binds it again.
type boundSocket struct {
	dir          int    // its directory, open (O_RDONLY)
	name         string // its name in dir
	dirTimes     [2]unix.Timespec
	sockTimes    [2]unix.Timespec
	hasSockTimes bool
}

// maxBoundSockets bounds the sockets whose times a restore puts back: each holds its
// directory open in the daemon until CRIU's post-restore, and a tree may bind as many
// sockets as its processes may have fds (the daemon's own fds would run out: every
// sandbox's operations fail while they do). The times of the others are new, as CRIU
// leaves them.
const maxBoundSockets = 256

// boundSockets opens, in the state whose root is root, the directory of each unix socket
// dir's image binds to a path, where a socket file is there now (maxBoundSockets at the
// most).
func boundSockets(root *os.File, dir string) ([]*boundSocket, error) {
	b, err := os.ReadFile(filepath.Join(dir, "files.img"))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	if len(b) < 8 || binary.LittleEndian.Uint32(b) != imgCommonMagic || binary.LittleEndian.Uint32(b[4:]) != filesMagic {
		return nil, fmt.Errorf("%s: not a CRIU files image", dir)
	}
	var out []*boundSocket
	seen := map[string]bool{}
	for off := 8; off+4 <= len(b) && len(out) < maxBoundSockets; {
		n := int(binary.LittleEndian.Uint32(b[off:]))
		if off+4+n > len(b) {
			break
		}
		var fe fdinfo.FileEntry
		err := proto.Unmarshal(b[off+4:off+4+n], &fe)
		off += 4 + n
		if err != nil || fe.Usk == nil || fe.Usk.GetDeleted() || len(fe.Usk.Name) == 0 || fe.Usk.Name[0] == 0 {
			continue // not a socket bound to a path that still names it
		}
		path := strings.TrimRight(string(fe.Usk.Name), "\x00") // the sun_path's terminating NUL, when bound with it
		if !filepath.IsAbs(path) {
			if !filepath.IsAbs(fe.Usk.GetNameDir()) {
				continue
			}
			path = filepath.Join(fe.Usk.GetNameDir(), path)
		}
		path = filepath.Clean(path)
		if seen[path] || path == "/" {
			continue
		}
		seen[path] = true
		if s := openBoundSocket(root, path); s != nil {
			out = append(out, s)
		}
	}
	return out, nil
}

// openBoundSocket opens path's directory in root's state and reads its times and those
// of the socket file at path; nil when either is not there.
func openBoundSocket(root *os.File, path string) *boundSocket {
	fd, err := unix.Openat2(int(root.Fd()), filepath.Dir(path), &unix.OpenHow{Flags: unix.O_RDONLY | unix.O_DIRECTORY | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS})
	if err != nil {
		return nil
	}
	s := &boundSocket{dir: fd, name: filepath.Base(path)}
	var st unix.Stat_t
	if unix.Fstat(fd, &st) != nil {
		unix.Close(fd)
		return nil
	}
	s.dirTimes = [2]unix.Timespec{st.Atim, st.Mtim}
	if unix.Fstatat(fd, s.name, &st, unix.AT_SYMLINK_NOFOLLOW) != nil || st.Mode&unix.S_IFMT != unix.S_IFSOCK {
		unix.Close(fd)
		return nil
	}
	s.sockTimes, s.hasSockTimes = [2]unix.Timespec{st.Atim, st.Mtim}, true
	return s
}

// putBack sets the directory's times, and the new socket file's, to what they were
// before CRIU bound it. Best effort: times are a courtesy, not the socket's state.
func (s *boundSocket) putBack() {
	if s.hasSockTimes {
		if fd, err := unix.Openat2(s.dir, s.name, &unix.OpenHow{Flags: unix.O_PATH | unix.O_NOFOLLOW | unix.O_CLOEXEC,
			Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS}); err == nil {
			var st unix.Stat_t
			if unix.Fstat(fd, &st) == nil && st.Mode&unix.S_IFMT == unix.S_IFSOCK {
				_ = unix.UtimesNanoAt(fd, "", s.sockTimes[:], unix.AT_EMPTY_PATH) // best effort, as said
			}
			unix.Close(fd)
		}
	}
	_ = unix.UtimesNanoAt(s.dir, "", s.dirTimes[:], unix.AT_EMPTY_PATH) // best effort, as said
}

func (s *boundSocket) close() { unix.Close(s.dir) }
