package durable

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
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
// list: the tree's working directories (where a watcher usually watches), then the
// directories a sandbox's work lives in. A watch on a file outside all of them, or on a
// removed one, still fails the dump, and the checkpoint refuses the tree (dumpHints).
//
// What it costs: one fstatat per entry, and a directory read per directory, until the
// watched inodes are found (the map is cached for the dump's other watches): a watch not
// found walks everything listed, which the dump's deadline bounds. CRIU reads only
// directory listings and stats, relative to the tree's root, while every process of the
// sandbox is stopped (a checkpoint's dump), and records a path that the restore opens in
// the sandbox's own state. A dump without an inotify watch never walks.

// irmapFixed are the directories of a sandbox where work is done, in the order walked.
// /proc, /sys and /dev are never walked: they hold no watched file of the overlay, and
// /proc's entries are many.
var irmapFixed = []string{"/workspace", "/tmp", "/home", "/root", "/opt", "/srv", "/run", "/var", "/mnt"}

// irmapMaxCwds bounds the working directories listed (a tree of thousands of processes
// in as many directories would otherwise make as many walks).
const irmapMaxCwds = 16

// irmapScanPaths returns the directories CRIU's inode map walks for the tree's inotify
// watches: each process's working directory that no listed directory holds, then
// irmapFixed. Each is a path in the sandbox (/proc/PID/cwd as the daemon reads it for a
// process whose root is not the daemon's: relative to the process's root).
func irmapScanPaths(tree []int) []string {
	var cwds []string
	seen := map[string]bool{}
	for _, p := range tree {
		if len(cwds) == irmapMaxCwds {
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
		cwds = append(cwds, c)
	}
	return append(cwds, irmapFixed...)
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
