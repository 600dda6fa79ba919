package durable

import (
	"bufio"
	"bytes"
	"encoding/hex"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Inotify watches on the sandbox's files. CRIU dumps a watch by its file's path, which
// it gets from the file handle the kernel shows in the inotify fd's fdinfo: it opens the
// handle (open_by_handle_at) and reads the path. An overlay mounted without nfs_export
// (the sandbox's states are) shows a handle (type OVL_FILEID_V1) that it cannot decode,
// so CRIU 4.1.1 falls back to its inode map: it walks directories, stat'ing each entry
// under the tree's root without following symlinks, until one has the watch's device and
// inode, and dumps that entry's path; the restore adds the watch again on the path, in the
// state restored onto. Its own list of directories (/etc, /var/log, /var/spool and a few
// more) never reaches a sandbox's project, so a watch there made the dump fail ("Can't
// dump that handle"): any file watcher (tsc --watch, a dev server, watchdog) was refused.
// On an overlay whose layers are all on one filesystem, as the store's are, stat gives
// the overlay's device and the inode number the watch shows, so the walk finds it.
//
// irmapScanPaths is where the walk looks first (--irmap-scan-path), before CRIU's own
// list: the directory each watch is on, where the daemon can name it (inotifyHints: one
// stat each), then the tree's working directories (where a watcher usually watches), then
// the directories a sandbox's work lives in. A watch on a file outside all of them, or on
// a removed one, still fails the dump, and the checkpoint refuses the tree (dumpHints).
//
// What it costs: one fstatat per entry, and a directory read per directory, until the
// watched inodes are found (the map is cached for the dump's other watches): a watch
// neither named nor under a working directory walks the listed directories until it is
// found, or all of them (the dump's deadline bounds it). A dump without watches never
// walks. Measured (load 6-9, a /workspace of 50,000 entries, a watch on one of its 500
// directories, 5 checkpoints each): 0.10-0.27 s a checkpoint with the watch named,
// 0.29-0.57 s by the walk from /workspace, 0.8-1.8 s when a watch is found nowhere. CRIU reads only directory
// listings and stats, relative to the tree's root, and records a path whose device and
// inode it checked, which the restore opens in the sandbox's own state. Another tree of
// the sandbox may run during the walk (the trees are dumped one after the other) and
// change the directories walked: at worst the walk goes elsewhere, until its deadline.

// irmapFixed are the directories of a sandbox where work is done, in the order walked.
// /proc, /sys and /dev are never walked: they hold no watched file of the overlay, and
// /proc's entries are many.
var irmapFixed = []string{"/workspace", "/tmp", "/home", "/root", "/opt", "/srv", "/run", "/var", "/mnt"}

// irmapMaxCwds bounds the working directories listed (a tree of thousands of processes
// in as many directories would otherwise make as many walks).
const irmapMaxCwds = 16

// irmapScanPaths returns the directories CRIU's inode map walks for the tree's inotify
// watches: inotifyHints' (layers are the host directories of the tree's state, its
// upper first), each process's working directory that no listed directory holds, then
// irmapFixed; none when the tree holds no inotify fd (CRIU walks only for a watch, and
// a dump without one reads nothing more here than the fd links). Each is a path in the
// sandbox (/proc/PID/cwd as the daemon reads it for a process whose root is not the
// daemon's: relative to the process's root).
func irmapScanPaths(tree []int, layers []string) []string {
	infos := inotifyInfos(tree)
	if len(infos) == 0 {
		return nil
	}
	paths := inotifyHints(infos, layers)
	seen := map[string]bool{}
	for _, p := range tree {
		if len(seen) == irmapMaxCwds {
			break
		}
		c, err := os.Readlink("/proc/" + strconv.Itoa(p) + "/cwd")
		if err != nil || !filepath.IsAbs(c) || strings.HasSuffix(c, " (deleted)") {
			continue // ended since, or a removed directory (removed.go carries it)
		}
		c = filepath.Clean(c)
		if seen[c] || underAny(c, irmapFixed) || underAny(c, []string{"/proc", "/sys", "/dev"}) || c == "/" {
			continue
		}
		seen[c] = true
		paths = append(paths, c)
	}
	return append(paths, irmapFixed...)
}

// inotifyInfos returns the fdinfo of each inotify fd the tree (host PIDs) holds.
func inotifyInfos(tree []int) [][]byte {
	var out [][]byte
	for _, p := range tree {
		base := "/proc/" + strconv.Itoa(p)
		ents, err := os.ReadDir(base + "/fd")
		if err != nil {
			continue // ended since
		}
		for _, e := range ents {
			if l, err := os.Readlink(base + "/fd/" + e.Name()); err != nil || l != "anon_inode:inotify" {
				continue
			}
			if info, err := os.ReadFile(base + "/fdinfo/" + e.Name()); err == nil {
				out = append(out, info)
			}
		}
	}
	return out
}

// underAny says whether path p is one of dirs or inside one.
func underAny(p string, dirs []string) bool {
	for _, d := range dirs {
		if p == d || strings.HasPrefix(p, d+"/") {
			return true
		}
	}
	return false
}

// irmapMaxHints bounds the watches inotifyHints names (a watcher of a large tree holds
// thousands: the others are found by the walk, whose map those already found fill).
const irmapMaxHints = 64

// inotifyHints names the directories the watches of inotify fds (their fdinfo, infos)
// are on, as paths in the sandbox, where it can: an overlay's file handle, which the watch's fdinfo shows and
// CRIU cannot decode, carries the handle of the file it stands for in one of the
// overlay's layers (the kernel's struct ovl_fb: fs/overlayfs/overlayfs.h); the daemon
// opens that handle on the layers' filesystem (open_by_handle_at, O_PATH) and reads the
// path the kernel gives the opened directory, and the part under a layer's directory is
// its path in the sandbox. A watch on a file (whose opened name the kernel may not know),
// on a directory a rename redirected (its lower has the old name), or not on the overlay
// gets no hint: CRIU checks each hint's device and inode, and the walk finds the rest.
func inotifyHints(infos [][]byte, layers []string) []string {
	if len(layers) == 0 {
		return nil
	}
	mfd, err := unix.Open(layers[0], unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0) // not O_PATH: open_by_handle_at refuses it (EBADF)
	if err != nil {
		return nil
	}
	defer unix.Close(mfd)
	var out []string
	seen := map[string]bool{}
	for _, info := range infos {
		for _, h := range overlayHandles(info) {
			if len(out) == irmapMaxHints {
				return out
			}
			if dir := layerPath(mfd, h, layers); dir != "" && !seen[dir] {
				seen[dir] = true
				out = append(out, dir)
			}
		}
	}
	return out
}

// overlayHandles returns, for each watch listed in an inotify fd's fdinfo whose handle is
// an overlay's (fhandle-type f8 or fb), the handle it carries of the file in its layer.
func overlayHandles(fdinfo []byte) []*unix.FileHandle {
	var out []*unix.FileHandle
	sc := bufio.NewScanner(bytes.NewReader(fdinfo))
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "inotify wd:") {
			continue
		}
		f := map[string]string{}
		for _, kv := range strings.Fields(line)[1:] {
			if k, v, ok := strings.Cut(kv, ":"); ok {
				f[k] = v
			}
		}
		if t := f["fhandle-type"]; t != "f8" && t != "fb" {
			continue
		}
		b, err := hex.DecodeString(f["f_handle"])
		if err != nil {
			continue
		}
		if h := ovlInner(b); h != nil {
			out = append(out, h)
		}
	}
	return out
}

// ovlInner decodes an overlay file handle: struct ovl_fb (version, magic 0xfb, len,
// flags, type, the layer filesystem's uuid, then that filesystem's own handle of the
// file), after three bytes of padding (OVL_FILEID_V1) or none (V0). nil if it is not one.
func ovlInner(b []byte) *unix.FileHandle {
	const magic, head = 0xfb, 21 // head: version, magic, len, flags, type, uuid[16]
	for _, off := range []int{3, 0} {
		fb := b[min(off, len(b)):]
		if len(fb) < head || fb[1] != magic || int(fb[2]) > len(fb) || int(fb[2]) <= head {
			continue
		}
		h := unix.NewFileHandle(int32(fb[4]), fb[head:fb[2]])
		return &h
	}
	return nil
}

// layerPath opens handle h on the layers' filesystem (mfd) and returns the opened file's
// path in the sandbox: the part of its host path under one of layers, "" if none.
func layerPath(mfd int, h *unix.FileHandle, layers []string) string {
	fd, err := unix.OpenByHandleAt(mfd, *h, unix.O_PATH|unix.O_CLOEXEC)
	if err != nil {
		return ""
	}
	defer unix.Close(fd)
	host, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(fd))
	if err != nil {
		return ""
	}
	for _, l := range layers {
		if rest, ok := strings.CutPrefix(host, filepath.Clean(l)+"/"); ok && !strings.HasSuffix(rest, " (deleted)") {
			return "/" + rest
		}
	}
	return ""
}
