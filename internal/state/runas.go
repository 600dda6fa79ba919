package state

import "strings"

// A sandbox created with a user (CreateOptions.User) runs its sessions and execs as that
// user, and the fast path cannot carry such processes: the move onto a new state is an
// injected setns(CLONE_NEWNS), which the kernel allows only a caller with
// CAP_SYS_ADMIN and CAP_SYS_CHROOT (mntns_install), and a restore's clone3 set_tid needs
// CAP_CHECKPOINT_RESTORE; injected calls run with the tracee's credentials, and an
// ordinary user has none of these. Tried as root's processes are, a uid 1000 session
// failed at the move (EACCES opening init's namespace fd, EPERM from setns), its move
// back failed the same way, and the session was killed. So the sandbox's checkpoints and
// restores take its files only, as with the fast path off: sessions end and start afresh
// on their next call (session_restarted), the counts say run_as.

// runsAsUser reports whether spec names someone else than root. A name other than
// "root" that the sandbox maps to uid 0 counts as a user (the fast path is then off
// without need, never on without the privileges).
func runsAsUser(spec string) bool {
	name, _, _ := strings.Cut(spec, ":")
	return spec != "" && name != "0" && name != "root"
}

// fastPath reports whether s's processes are carried by checkpoints and restores.
func (m *Manager) fastPath(s *sb) bool {
	return m.cfg.FastPath && !runsAsUser(s.rec.User)
}

// filesOnlyPath is the path a checkpoint or restore without processes counts, and why
// it ended the sessions. Precondition: !m.fastPath(s).
func (m *Manager) filesOnlyPath(s *sb) (opPath, string) {
	if !m.cfg.FastPath {
		return pathFastPathOff, "the daemon runs without the fast path: process state is not kept"
	}
	return pathRunAs, "the sandbox runs as user " + s.rec.User + ": the fast path needs root to move a process (setns), so process state is not kept"
}
