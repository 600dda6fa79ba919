package durable

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
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
