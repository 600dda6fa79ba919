package durable

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"deltabox/internal/procfs"
)

// Removed files: a process may hold a file or a directory that has no name any more (an
// unlinked open file, a removed working directory). CRIU carries such a file itself by
// writing into the tree it restores onto: it dumps a file's content as a "ghost" and, at
// the restore, creates NAME.cr.ID.ghost beside the old name, links it to the old name,
// opens it and unlinks both; a removed directory is made again at its old path and
// removed after. Restoring into a sandbox's state (--join-ns mnt), CRIU 4.1.1 makes the
// ghost in the state but links and cleans it up from its own root, so the restore fails
// ("Can't link workspace/g.cr.1.ghost -> workspace/g: No such file or directory") and
// leaves the ghost in the user's tree. Even when it works, every restore (and a
// checkpoint's move is one) would change the directory's times and leave its ghost
// behind when CRIU dies or times out.
//
// So the daemon carries them, and CRIU never writes into the sandbox's files: each
// removed file is external to the image (CRIU's file[MNT:INO]); Dump copies a regular
// file's content into the image directory (removed-N), and Restore makes a nameless file
// of the same content, owner, mode and times on the state restored onto (O_TMPFILE, in
// its old directory when that exists: nothing is ever linked into the tree) and hands it
// to CRIU, which reopens it with the image's flags and offset. A removed directory is
// made under a name of its own in its nearest existing ancestor, opened and removed at
// once, and the ancestor's times are put back: the process gets a removed directory on
// the new state whose ".." is that ancestor (a parent that was removed too is not made
// again). The process sees the same content; only the inode number changes, as it does
// with CRIU's ghosts. A file removed between the scan and CRIU's seize would be dumped as
// CRIU's own ghost: Dump refuses such an image (try again).

// RemovedLimit is the largest removed regular file a dump copies, and RemovedTotal the
// most it copies for one tree (CRIU's default ghost limit is 1 MiB; the copy is on the
// checkpoint's path, at disk speed, and into the daemon's store).
const (
	RemovedLimit = 64 << 20
	RemovedTotal = 256 << 20
)

// Removed is a file or directory with no name that the tree holds (a fd, a mapping, a
// working directory), carried by the daemon rather than by CRIU.
type Removed struct {
	Key      string // CRIU's external key, file[MNT:INO]
	Path     string // its last name, as the process saw it (without " (deleted)")
	Dir      bool
	Mode     uint32 // permission bits (and setuid, setgid, sticky)
	UID, GID uint32 // on the host (the sandbox's mapped ids)
	Size     int64
	Atime    unix.Timespec
	Mtime    unix.Timespec
	Copy     string `json:",omitempty"` // its content in the image directory (regular files)
}

// shmemName says whether a /proc link names memory rather than a file: shared anonymous
// memory, a memfd, SysV shared memory (on the kernel's internal shm mount), an AIO ring
// (io_setup's "/[aio]", on the kernel's aio mount). CRIU dumps their content itself.
func shmemName(link string) bool {
	return strings.HasPrefix(link, "/dev/zero (deleted)") || strings.HasPrefix(link, "/memfd:") || strings.HasPrefix(link, "/SYSV") ||
		strings.HasPrefix(link, "/[aio] (deleted)")
}

// removedFiles finds what the tree (host PIDs) holds that has no name, each with a
// /proc link to it (first found). copyRemovedFiles copies the contents, once the tree is
// stopped.
func removedFiles(tree []int) ([]Removed, map[string]string, error) {
	var out []Removed
	src := map[string]string{}
	var total int64
	err := treeLinks(tree, func(p int, link string) error {
		r, err := removedAt(p, link)
		if err != nil || r == nil {
			return err
		}
		if _, ok := src[r.Key]; ok {
			return nil
		}
		if !r.Dir && r.Size > RemovedLimit {
			return fmt.Errorf("process %d holds the removed file %s (%d MiB), over the %d MiB a checkpoint copies (close it, or keep a name to it)", sandboxPid(p), r.Path, r.Size>>20, RemovedLimit>>20)
		}
		if !r.Dir {
			if total += r.Size; total > RemovedTotal {
				return fmt.Errorf("the removed files its tree holds come to over %d MiB, the most a checkpoint copies (close some: process %d holds %s)", RemovedTotal>>20, sandboxPid(p), r.Path)
			}
		}
		src[r.Key] = link
		out = append(out, *r)
		return nil
	})
	return out, src, err
}

// treeLinks calls fn with each fd, mapped file and working directory of each process of
// the tree, as /proc links.
func treeLinks(tree []int, fn func(p int, link string) error) error {
	for _, p := range tree {
		base := "/proc/" + strconv.Itoa(p)
		var links []string
		for _, sub := range []string{"fd", "map_files"} {
			ents, err := os.ReadDir(filepath.Join(base, sub))
			if err != nil {
				if p == tree[0] {
					return err
				}
				continue // ended since
			}
			for _, e := range ents {
				links = append(links, filepath.Join(base, sub, e.Name()))
			}
		}
		links = append(links, base+"/cwd")
		for _, link := range links {
			if err := fn(p, link); err != nil {
				return err
			}
		}
	}
	return nil
}

// copyRemovedFiles copies into dir the content of each removed regular file, read
// through src's link to it, or another of the tree's when that one no longer is it (the
// tree ran between the scan and CRIU's seize). It returns those the tree still holds:
// the contents and sizes are the image's when the tree is stopped (Dump: after CRIU left
// it stopped, or before CRIU kills it).
//
// The limits the scan checked (RemovedLimit, RemovedTotal) hold for what is copied, by
// the sizes at the copy: the tree (or, for a template, the live process that shares its
// files) may have made its files larger since the scan.
func copyRemovedFiles(tree []int, dir string, removed []Removed, src map[string]string) ([]Removed, error) {
	var out []Removed
	var total int64
	for _, r := range removed {
		if r.Dir {
			out = append(out, r)
			continue
		}
		link := src[r.Key]
		if k, _ := keyOf(link); k != r.Key {
			link = ""
			_ = treeLinks(tree, func(p int, l string) error { // its callback never fails
				if k, _ := keyOf(l); link == "" && k == r.Key {
					link = l
				}
				return nil
			})
		}
		if link == "" {
			continue // closed meanwhile: the image does not name it
		}
		r.Copy = fmt.Sprintf("removed-%d", len(out))
		n, err := copyRemoved(link, filepath.Join(dir, r.Copy), RemovedTotal-total)
		if err != nil {
			return nil, fmt.Errorf("copy the removed file %s: %w", r.Path, err)
		}
		total += n
		out = append(out, r)
	}
	return out, nil
}

// keyOf is CRIU's external key of the file link names.
func keyOf(link string) (string, error) {
	fd, err := unix.Open(link, unix.O_PATH|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", err
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return "", err
	}
	mnt, err := fdMountID(fd)
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("file[%x:%x]", mnt, st.Ino), nil
}

// removedAt says what link (a /proc/PID/{fd,map_files}/N or cwd of process p) is, if it
// is a regular file or directory with no name; nil otherwise.
func removedAt(p int, link string) (*Removed, error) {
	fd, err := unix.Open(link, unix.O_PATH|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, nil // closed or unmapped since
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, err
	}
	var fs unix.Statfs_t
	if err := unix.Fstatfs(fd, &fs); err != nil {
		return nil, err
	}
	if fs.Type == unix.PROC_SUPER_MAGIC {
		// Not a file of the sandbox: a /proc directory or file of a process that has
		// ended (a cwd in /proc/PID of a reaped child). CRIU dumps it itself, as a
		// dead PID's procfs path, and restores it with a helper of that PID.
		return nil, nil
	}
	dir := st.Mode&unix.S_IFMT == unix.S_IFDIR
	special := !dir && st.Mode&unix.S_IFMT != unix.S_IFREG
	name, err := os.Readlink(link)
	if err != nil || shmemName(name) {
		return nil, nil
	}
	path, suffixed := strings.CutSuffix(name, " (deleted)")
	if !suffixed || !strings.HasPrefix(name, "/") {
		return nil, nil
	}
	if special {
		// A FIFO or a device node whose name was removed: CRIU would make it again in
		// the sandbox's files to reopen it.
		if same, err := sameAt(p, name, &st); err != nil || same {
			return nil, err
		}
		return nil, fmt.Errorf("process %d holds %s, %s whose name was removed, which neither path carries (close it, or keep its name)", sandboxPid(p), path, kindOf(st.Mode))
	}
	if st.Nlink > 0 {
		// Unlinked under this name, or a name that ends so: the name, looked up in the
		// process's root, must not be this file. A file that shows links left (one of
		// a frozen layer, held read-only, whose name the upper whited out; one whose
		// other names are in the upper) is carried as a copy too: the copy parts from
		// the other names as any two names of a file part after a checkpoint, whose
		// copy-up splits hard links (docs/design/posix.md).
		if same, err := sameAt(p, name, &st); err != nil || same {
			return nil, err // a live file whose name ends in " (deleted)"
		}
	}
	mnt, err := fdMountID(fd)
	if err != nil {
		return nil, err
	}
	return &Removed{Key: fmt.Sprintf("file[%x:%x]", mnt, st.Ino), Path: path, Dir: dir, Mode: st.Mode & 0o7777,
		UID: st.Uid, GID: st.Gid, Size: st.Size, Atime: st.Atim, Mtime: st.Mtim}, nil
}

// kindOf names a file that is neither a regular file nor a directory, by its mode.
func kindOf(mode uint32) string {
	switch mode & unix.S_IFMT {
	case unix.S_IFIFO:
		return "a FIFO"
	case unix.S_IFCHR, unix.S_IFBLK:
		return "a device node"
	case unix.S_IFLNK:
		return "a symbolic link (held by an O_PATH fd)"
	case unix.S_IFSOCK:
		return "a socket file"
	}
	return fmt.Sprintf("a special file (mode %o)", mode)
}

// sandboxPid is host PID p's PID in its own namespace, for messages (p if unknown).
func sandboxPid(p int) int {
	if in, err := procfs.InnerPid(p); err == nil {
		return in
	}
	return p
}

// sameAt says whether name, looked up in process p's root (confined to it), is the file
// st describes.
func sameAt(p int, name string, st *unix.Stat_t) (bool, error) {
	root, err := os.Open(fmt.Sprintf("/proc/%d/root", p))
	if err != nil {
		return false, err
	}
	defer func() { _ = root.Close() }() // O_PATH use only
	fd, err := unix.Openat2(int(root.Fd()), name, &unix.OpenHow{Flags: unix.O_PATH | unix.O_CLOEXEC | unix.O_NOFOLLOW,
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS})
	if err != nil {
		return false, nil
	}
	defer unix.Close(fd)
	var ost unix.Stat_t
	return unix.Fstat(fd, &ost) == nil && ost.Ino == st.Ino && ost.Dev == st.Dev, nil
}

// copyRemoved copies the file link names into dst (new) and syncs nothing (Dump does);
// it returns the size copied. A file over RemovedLimit, or over budget (what is left of
// RemovedTotal), is refused, not copied.
func copyRemoved(link, dst string, budget int64) (int64, error) {
	src, err := os.Open(link)
	if err != nil {
		return 0, err
	}
	defer func() { _ = src.Close() }() // read-only, after the copy
	var st unix.Stat_t
	if err := unix.Fstat(int(src.Fd()), &st); err != nil {
		return 0, err
	}
	if st.Size > RemovedLimit {
		return 0, fmt.Errorf("it grew to %d MiB since the scan, over the %d MiB a checkpoint copies (close it, or keep a name to it)", st.Size>>20, RemovedLimit>>20)
	}
	if st.Size > budget {
		return 0, fmt.Errorf("the removed files its tree holds grew to over %d MiB since the scan, the most a checkpoint copies (close some)", RemovedTotal>>20)
	}
	f, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return 0, err
	}
	// At most the size checked: what it grows by meanwhile is not copied.
	err = copySparse(f, src, st.Size)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return st.Size, err
}

// copySparse copies src's first limit bytes (at most) into dst (empty) and gives dst the
// same size, keeping src's holes: only the ranges SEEK_DATA finds are written, so a
// sparse file (CRIU's ghost_holes tests) keeps its holes and about its blocks both ways
// (a file system without SEEK_DATA shows the whole file as data: a dense copy).
func copySparse(dst, src *os.File, limit int64) error {
	var st unix.Stat_t
	if err := unix.Fstat(int(src.Fd()), &st); err != nil {
		return err
	}
	size := min(st.Size, limit)
	for off := int64(0); off < size; {
		data, err := unix.Seek(int(src.Fd()), off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) || (err == nil && data >= size) {
			break // a hole to the end
		}
		if err != nil {
			return err
		}
		hole, err := unix.Seek(int(src.Fd()), data, unix.SEEK_HOLE)
		if err != nil {
			return err
		}
		hole = min(hole, size)
		if _, err := io.Copy(io.NewOffsetWriter(dst, data), io.NewSectionReader(src, data, hole-data)); err != nil {
			return err
		}
		off = hole
	}
	return dst.Truncate(size)
}

// criuRemaps refuses an image in which CRIU carries a file itself (ghost files, link
// remaps): it would write them into the state restored onto.
func criuRemaps(dir string) error {
	ghosts, _ := filepath.Glob(filepath.Join(dir, "ghost-file-*.img"))
	if len(ghosts) > 0 {
		return errors.New("a file it holds was removed while CRIU took it (CRIU would write it into the sandbox's files to restore it): try again")
	}
	return nil
}

// makeRemoved makes, on the state whose root is root, a nameless copy of r for CRIU to
// reopen: a regular file's content from the image directory dir, or a removed directory.
func makeRemoved(root *os.File, dir string, r Removed) (*os.File, error) {
	if r.Dir {
		return makeRemovedDir(root, r)
	}
	pfd, _, err := nearestDir(root, filepath.Dir(r.Path))
	if err != nil {
		return nil, err
	}
	defer unix.Close(pfd)
	fd, err := unix.Openat(pfd, ".", unix.O_TMPFILE|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("make the removed file %s again: %w", r.Path, err)
	}
	f := os.NewFile(uintptr(fd), r.Path+" (deleted)")
	err = func() error {
		src, err := os.Open(filepath.Join(dir, r.Copy))
		if err != nil {
			return err
		}
		defer func() { _ = src.Close() }() // read-only, after the copy
		if err := copySparse(f, src, RemovedLimit+1); err != nil {
			return err
		}
		return setAttrs(fd, r)
	}()
	if err != nil {
		_ = f.Close() // the copy's error is the one to report
		return nil, fmt.Errorf("make the removed file %s again: %w", r.Path, err)
	}
	return f, nil
}

// makeRemovedDir makes a removed directory in r.Path's nearest existing ancestor: made,
// opened, removed at once, the ancestor's times put back. It has its old name when its
// parent is there and the name is free (a process reads it: /proc/self/cwd), else one
// of its own.
func makeRemovedDir(root *os.File, r Removed) (*os.File, error) {
	parent := filepath.Dir(r.Path)
	pfd, at, err := nearestDir(root, parent)
	if err != nil {
		return nil, err
	}
	defer unix.Close(pfd)
	var pst unix.Stat_t
	if err := unix.Fstat(pfd, &pst); err != nil {
		return nil, err
	}
	name := filepath.Base(r.Path)
	if at != parent || name == "/" || name == "." || unix.Mkdirat(pfd, name, 0o700) != nil {
		var rnd [6]byte
		rand.Read(rnd[:])
		name = ".deltabox-removed-" + hex.EncodeToString(rnd[:])
		if err := unix.Mkdirat(pfd, name, 0o700); err != nil {
			return nil, fmt.Errorf("make the removed directory %s again: %w", r.Path, err)
		}
	}
	fd, err := unix.Openat(pfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err == nil {
		if err = setAttrs(fd, r); err != nil {
			unix.Close(fd)
		}
	}
	rerr := unix.Unlinkat(pfd, name, unix.AT_REMOVEDIR)
	_ = unix.UtimesNanoAt(pfd, "", []unix.Timespec{pst.Atim, pst.Mtim}, unix.AT_EMPTY_PATH) // the parent's times only, put back as a courtesy
	if err == nil && rerr != nil {
		unix.Close(fd)
		err = rerr
	}
	if err != nil {
		return nil, fmt.Errorf("make the removed directory %s again: %w", r.Path, err)
	}
	return os.NewFile(uintptr(fd), r.Path+" (deleted)"), nil
}

// nearestDir opens (read-only, a directory) path in the state whose root is root, or its
// nearest ancestor that exists there, confined to the state (no symlink followed), and
// says which it opened.
func nearestDir(root *os.File, path string) (int, string, error) {
	for p := path; ; p = filepath.Dir(p) {
		fd, err := unix.Openat2(int(root.Fd()), p, &unix.OpenHow{Flags: unix.O_RDONLY | unix.O_DIRECTORY | unix.O_CLOEXEC,
			Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS})
		if err == nil {
			return fd, p, nil
		}
		if p == "/" || p == "." {
			return -1, "", fmt.Errorf("open the state's root: %w", err)
		}
	}
}

// setAttrs gives fd r's owner, mode and times.
func setAttrs(fd int, r Removed) error {
	if err := unix.Fchown(fd, int(r.UID), int(r.GID)); err != nil {
		return err
	}
	if err := unix.Fchmod(fd, r.Mode); err != nil {
		return err
	}
	return unix.UtimesNanoAt(fd, "", []unix.Timespec{r.Atime, r.Mtime}, unix.AT_EMPTY_PATH)
}
