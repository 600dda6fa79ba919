package session

import (
	"strconv"

	"golang.org/x/sys/unix"

	"deltabox/internal/procfs"
	"deltabox/internal/sandbox"
)

// ptsNumber is the number N of the pseudo-terminal whose master is open at master: its
// slave is /dev/pts/N (TIOCGPTN).
func ptsNumber(master int) (uint32, error) {
	return unix.IoctlGetUint32(master, unix.TIOCGPTN)
}

// OnTerminal reports whether the sandbox's process pid (a PID in the sandbox) has as its
// controlling terminal the pseudo-terminal whose master is open at master (a descriptor
// the caller holds: a session's master that init kept across a daemon restart, before
// Adopt makes it a Session): /proc/PID/stat's tty_nr against the master's pts number
// (TIOCGPTN; devpts numbers pts N as major 136 + N/256, minor N%256). False when either
// cannot be read.
func OnTerminal(rt *sandbox.Sandbox, pid, master int) bool {
	n, err := ptsNumber(master)
	if err != nil {
		return false
	}
	b, err := rt.ReadProcFile(pid, "stat")
	if err != nil {
		return false
	}
	f := procfs.StatFields(b) // state, ppid, pgrp, session, tty_nr...
	if len(f) < 5 {
		return false
	}
	tty, err := strconv.ParseUint(string(f[4]), 10, 64)
	return err == nil && unix.Major(tty) == 136+n/256 && unix.Minor(tty) == n%256
}
