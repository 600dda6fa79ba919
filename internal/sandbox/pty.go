package sandbox

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"deltabox/internal/sbinit"
)

// Winsize is the terminal size sessions start with: wide enough that tools do not wrap
// their output for an 80-column terminal.
var Winsize = unix.Winsize{Row: 50, Col: 200}

// OpenPTY opens a pseudo-terminal in the sandbox's own devpts instance (so the
// sandbox's processes see it as /dev/pts/N) and returns the master and the slave. It
// opens it as the sandbox's root (devpts gives the new /dev/pts/N the opener's fsuid):
// a terminal owned by the daemon's root is one that no process of the sandbox may open
// by path, as a restored session leader does to take its terminal back.
func (s *Sandbox) OpenPTY() (master, slave *os.File, err error) {
	err = s.AsRoot(func() error {
		var err error
		master, slave, err = s.openPTY()
		return err
	})
	return master, slave, err
}

func (s *Sandbox) openPTY() (master, slave *os.File, err error) {
	// Beneath the sandbox's devpts as it was at the start (s.devpts), no symlink, no
	// other mount: /proc/INIT/root/dev/pts/ptmx, resolved by the daemon as root, followed
	// whatever a process of the sandbox had mounted or planted there (an absolute
	// symlink resolves against the daemon's root: a host path of its choosing).
	mfd, err := unix.Openat2(s.devpts, "ptmx", &unix.OpenHow{
		Flags:   unix.O_RDWR | unix.O_NOCTTY | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV,
	})
	if err != nil {
		return nil, nil, fmt.Errorf("open the sandbox's ptmx: %w", err)
	}
	if err := unix.IoctlSetPointerInt(mfd, unix.TIOCSPTLCK, 0); err != nil {
		unix.Close(mfd)
		return nil, nil, fmt.Errorf("unlock pty: %w", err)
	}
	// TIOCGPTPEER opens the slave from the master, with no path lookup.
	sfd2, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(mfd), unix.TIOCGPTPEER, uintptr(unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC))
	if errno != 0 {
		unix.Close(mfd)
		return nil, nil, fmt.Errorf("open pty slave: %w", errno)
	}
	if err := unix.IoctlSetWinsize(mfd, unix.TIOCSWINSZ, &Winsize); err != nil {
		unix.Close(mfd)
		unix.Close(int(sfd2))
		return nil, nil, fmt.Errorf("set window size: %w", err)
	}
	return os.NewFile(uintptr(mfd), "ptmx"), os.NewFile(sfd2, "pts"), nil
}

// SpawnSession starts a session leader whose stdio and controlling terminal is the
// pty slave, in the current state, as the sandbox's user (User).
func (s *Sandbox) SpawnSession(argv, env []string, dir string, slave *os.File) (*sbinit.Process, error) {
	ns, err := s.StateNS()
	if err != nil {
		return nil, err
	}
	defer unix.Close(ns)
	env = s.env(env, s.User)
	fd := int(slave.Fd())
	return s.init.Spawn(sbinit.SpawnOptions{Argv: argv, Env: env, Dir: dir, Setsid: true, Ctty: true, User: s.User}, [3]int{fd, fd, fd}, ns)
}

// Signal sends sig to a process (or its group) of the sandbox, by its PID there.
func (s *Sandbox) Signal(pid int, sig unix.Signal, group bool) error {
	return s.init.Signal(pid, sig, group)
}
