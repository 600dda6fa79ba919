package durable

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/checkpoint-restore/go-criu/v7/crit"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
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

// unixSocketMounts rewrites dir's files.img without the mounts of unix sockets' files.
func unixSocketMounts(dir string) error {
	path := filepath.Join(dir, "files.img")
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	img, err := crit.New(f, nil, "", false, false).Decode(&fdinfo.FileEntry{})
	f.Close()
	if err != nil {
		return fmt.Errorf("read %s: %w", path, err)
	}
	changed := false
	for _, e := range img.Entries {
		if fe, ok := e.Message.(*fdinfo.FileEntry); ok && fe.Usk != nil && fe.Usk.MntId != nil && fe.Usk.GetMntId() >= 0 {
			fe.Usk.MntId = nil
			changed = true
		}
	}
	if !changed {
		return nil
	}
	tmp := path + ".tmp"
	out, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return err
	}
	err = crit.New(nil, out, "", false, false).Encode(img)
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		os.Remove(tmp)
		return fmt.Errorf("rewrite %s: %w", path, err)
	}
	return nil
}
