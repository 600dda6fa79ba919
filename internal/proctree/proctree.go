// Package proctree holds the trees of a sandbox's processes that a checkpoint hands to
// CRIU (internal/state/criutrees.go decides which, and when): by pidfds, never by a PID
// number that may have been reused since it was read, and in a record (tree.json) that a
// daemon started after a crash reads to let run what a dead one left stopped.
//
// It also reads, from /proc, what keeps trees from being dumped and restored apart: a
// pipe shared by two trees, or with the daemon, and a session led from outside a tree.
package proctree

import (
	"golang.org/x/sys/unix"

	"deltabox/internal/durable"
	"deltabox/internal/fastpath"
)

// Kill kills, by pidfds (never by a PID number that may have been reused), the tree
// CRIU just restored at host PID root, descendants first.
func Kill(root int) {
	if !fastpath.Exists(root) {
		return
	}
	var fds []int
	for _, h := range durable.Tree(root) {
		if fd, err := unix.PidfdOpen(h, 0); err == nil {
			fds = append(fds, fd)
		}
	}
	for i := len(fds) - 1; i >= 0; i-- {
		_ = unix.PidfdSendSignal(fds[i], unix.SIGKILL, nil, 0) // ESRCH: ended already
		_ = unix.Close(fds[i])
	}
}
