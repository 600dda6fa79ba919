package sbinit

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// A background spare's branch init runs at Config.Nice until its spare is swapped in
// (state: spares.go): its setup (mounts, its part of the placement) then takes a CPU
// that an agent's call wants at a tenth of its weight (nice 10: 110 against 1024), not
// half of it as at nice 0, where one branch init's start beside a step's 64 actions (all
// in the sandboxes' one cgroup, weight 1024 together) took half the CPU (bench rl).
//
// PRIO_PGRP sets every thread of every process of a process group at once, under the
// kernel's task list lock, which thread creation also takes: no thread is missed, and
// later threads inherit their creator's nice. The init is its process group's leader
// (it calls setsid), alone in it until it spawns.

// niceSelf sets every thread of this init (its process group's) to nice.
func niceSelf(nice int) error {
	if err := unix.Setpriority(unix.PRIO_PGRP, 0, nice); err != nil {
		return fmt.Errorf("setpriority(PRIO_PGRP, 0, %d): %w", nice, err)
	}
	return nil
}

// ResetNice sets every thread of the init at host PID pid (and of the processes of its
// process group) back to nice 0: a spare's init, as it becomes a sandbox's.
func ResetNice(pid int) error {
	if pid <= 0 { // PRIO_PGRP's 0 is the caller's own group: the daemon's
		return fmt.Errorf("reset the nice of init %d: no such process", pid)
	}
	if err := unix.Setpriority(unix.PRIO_PGRP, pid, 0); err != nil {
		return fmt.Errorf("setpriority(PRIO_PGRP, %d, 0): %w", pid, err)
	}
	return nil
}
