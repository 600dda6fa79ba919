package durable

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"deltabox/internal/procfs"
)

// A process of a sandbox maps files from mounts its mount namespace no longer has: its
// executable and libraries stay mapped from the state it started on, while the fast path
// moves it onto a new state's namespace at every checkpoint and restore (only its fds,
// cwd and writable shared mappings follow). CRIU looks up each mapped file's mount in the
// dumped process's namespace and fails ("Can't lookup mount=N ... path=/usr/bin/python3").
// Such files are made external (CRIU's file[MNT_ID:INODE]): the image names them by that
// key and by their path (Manifest.ExtFiles), and Restore hands CRIU the file at that path
// in the state it restores onto (Sandbox.Root), where the node's files are the same.

// externalFiles returns, for the processes of tree (host PIDs, its root first), CRIU's
// keys of the files they map, hold open or run (exe) whose mount is not in their mount
// namespace, with each one's path there. Files with no name (removed, carried apart) and
// memory that /proc shows as a file (shared anonymous memory, memfds: CRIU's own) are
// not among them.
func externalFiles(tree []int, removed []Removed) (map[string]string, error) {
	out := map[string]string{}
	for i, pid := range tree {
		if err := externalFilesOf(pid, removed, out); err != nil {
			if st := procfs.State(pid); i > 0 && (st == 0 || st == 'Z' || st == 'X') {
				continue // ended since, or a zombie (its /proc files fail with EINVAL)
			}
			return nil, err
		}
	}
	return out, nil
}

func externalFilesOf(pid int, removed []Removed, out map[string]string) error {
	base := "/proc/" + strconv.Itoa(pid)
	mounts, err := mountIDs(base + "/mountinfo")
	if err != nil {
		return err
	}
	add := func(link string) error {
		fd, err := unix.Open(link, unix.O_PATH|unix.O_CLOEXEC, 0)
		if err != nil {
			return nil // gone, or not a file (anon_inode, socket)
		}
		defer unix.Close(fd)
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG {
			return nil
		}
		mnt, err := fdMountID(fd)
		if err != nil {
			return err
		}
		if mounts[mnt] {
			return nil
		}
		path, err := os.Readlink(link)
		if err != nil || shmemName(path) || !strings.HasPrefix(path, "/") {
			// Not a file with a path: a namespace (nsfs, "net:[4026532273]"), which
			// CRIU dumps and restores itself (an ns file, opened from the restored
			// process's namespaces), and which no state has at a path.
			return nil
		}
		key := fmt.Sprintf("file[%x:%x]", mnt, st.Ino)
		for _, r := range removed {
			if r.Key == key {
				return nil
			}
		}
		out[key] = path
		return nil
	}
	for _, dir := range []string{base + "/map_files", base + "/fd"} {
		ents, err := os.ReadDir(dir)
		if err != nil {
			return err
		}
		for _, e := range ents {
			if err := add(filepath.Join(dir, e.Name())); err != nil {
				return err
			}
		}
	}
	return add(base + "/exe")
}

// mountIDs reads the mount ids of a mountinfo file.
func mountIDs(path string) (map[int]bool, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer func() { _ = f.Close() }() // read-only, after the read
	ids := map[int]bool{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		if id, err := strconv.Atoi(strings.SplitN(sc.Text(), " ", 2)[0]); err == nil {
			ids[id] = true
		}
	}
	return ids, sc.Err()
}

// fdMountID is the mnt_id of our fd, from /proc/self/fdinfo.
func fdMountID(fd int) (int, error) {
	b, err := os.ReadFile("/proc/self/fdinfo/" + strconv.Itoa(fd))
	if err != nil {
		return 0, err
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "mnt_id:"); ok {
			return strconv.Atoi(strings.TrimSpace(v))
		}
	}
	return 0, fmt.Errorf("fdinfo of fd %d has no mnt_id", fd)
}

// openExternal opens path in the state whose root is root, confined to it (the state's
// files are the sandbox's: a symlink there must not lead out of it), for reading.
func openExternal(root *os.File, path string) (*os.File, error) {
	fd, err := unix.Openat2(int(root.Fd()), path, &unix.OpenHow{
		Flags:   unix.O_RDONLY | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS,
	})
	if err != nil {
		return nil, fmt.Errorf("open %s in the state restored onto: %w", path, err)
	}
	return os.NewFile(uintptr(fd), path), nil
}
