package durable

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
)

// criu/include/magic.h.
const (
	fdinfoMagic = 0x56213732
	filesMagic  = 0x56303138
)

// ReadOnlyFDs rewrites the image in dir (of a template's copy) so that its task's
// regular-file fds are opened read-only on restore, as a parked template's are
// (fastpath.Park): the image is restored onto the node's read-only view, where CRIU's
// open of a file the process had open for writing fails with EROFS, and a template's
// own fds only hold their numbers (Revive reopens each from its record, with its flags,
// on the restored state). Mappings are left as they are: their files are opened
// separately, and the fast path carries no shared writable file mapping.
//
// files.img is replaced by a rename, so a crash leaves the old or the new one whole.
func ReadOnlyFDs(dir string) error {
	fdinfos, err := filepath.Glob(filepath.Join(dir, "fdinfo-*.img"))
	if err != nil {
		return err
	}
	regs := map[uint32]bool{}
	for _, p := range fdinfos {
		ents, err := readImageFile(p, fdinfoMagic)
		if err != nil {
			return err
		}
		for _, b := range ents {
			var e fdinfo.FdinfoEntry
			if err := proto.Unmarshal(b, &e); err != nil {
				return fmt.Errorf("%s: %w", p, err)
			}
			if e.GetType() == fdinfo.FdTypes_REG {
				regs[e.GetId()] = true
			}
		}
	}
	if len(regs) == 0 {
		return nil
	}
	path := filepath.Join(dir, "files.img")
	ents, err := readImageFile(path, filesMagic)
	if err != nil {
		return err
	}
	changed := false
	for i, b := range ents {
		var e fdinfo.FileEntry
		if err := proto.Unmarshal(b, &e); err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
		r := e.GetReg()
		if e.GetType() != fdinfo.FdTypes_REG || r == nil || !regs[e.GetId()] {
			continue
		}
		fl := r.GetFlags()
		ro := fl &^ uint32(unix.O_ACCMODE|unix.O_APPEND) // | O_RDONLY, which is 0
		if ro == fl {
			continue
		}
		r.Flags = &ro
		if ents[i], err = proto.Marshal(&e); err != nil {
			return err
		}
		changed = true
	}
	if !changed {
		return nil
	}
	return writeImageFile(path, filesMagic, ents)
}

// writeImageFile replaces path with the image of ents (synced, then renamed into place).
func writeImageFile(path string, magic uint32, ents [][]byte) error {
	tmp := path + ".new"
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	w := bufio.NewWriter(f)
	_ = binary.Write(w, binary.LittleEndian, [2]uint32{imgCommonMagic, magic}) // bufio keeps the first error: Flush returns it
	for _, b := range ents {
		_ = binary.Write(w, binary.LittleEndian, uint32(len(b)))
		_, _ = w.Write(b)
	}
	err = w.Flush()
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		_ = os.Remove(tmp) // may not exist: the error above is the one to report
		return fmt.Errorf("rewrite %s: %w", path, err)
	}
	return nil
}
