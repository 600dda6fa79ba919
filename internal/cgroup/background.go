package cgroup

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
)

// The background CPU group: work the daemon does beside the agents' operations and
// that no answer waits for (the page store's hashing of durable images) runs in a
// cgroup v1 cpu group of its own, V1Mount/cpu/deltabox[-hash]-background, with
// cpu.shares 64, beside the sandboxes' parent (1024): a sixteenth of the sandboxes'
// weight when both want the CPU, all of what is idle otherwise.
//
// Why a group and not nice 19 alone: CFS shares time between groups first and between
// a group's threads only then, and a thread's nice weighs only against its own group's
// other threads. A daemon's thread at nice 19 sits in the daemon's group (its autogroup,
// or its service's cgroup), which competes with the sandboxes' group at full weight: a
// CPU-bound sha256 process beside a restore loop added 3.0 ms to its p50 reap phase at
// nice 19 and 3.3 ms at nice 0, and nothing beyond the run's spread from a cpu group of
// shares 64 or 2 (docs/research/ab-6318f36). v1 places single threads, so the thread that
// joins (tasks, not cgroup.procs) is the only one moved; what it forks afterwards
// starts in the group too.

// backgroundDir is this daemon's background group.
func backgroundDir() string {
	return filepath.Join(V1Mount, "cpu", filepath.Base(Root)+"-background")
}

// backgroundShares is the group's cpu.shares. 2, the kernel's least, measured the same
// beside restores; 64 lets the work on when the machine is saturated.
const backgroundShares = 64

// JoinBackground moves the thread tid (a thread id, or a single-threaded process's
// pid) into the background CPU group, making the group first if need be.
func JoinBackground(tid int) error {
	if !v1Mounted("cpu") {
		return fmt.Errorf("the cgroup v1 cpu controller is not mounted at %s (run scripts/setup.sh)", filepath.Join(V1Mount, "cpu"))
	}
	d := backgroundDir()
	if err := os.MkdirAll(d, 0o755); err != nil {
		return fmt.Errorf("create the background cpu group: %w", err)
	}
	if err := writeFile(filepath.Join(d, "cpu.shares"), strconv.Itoa(backgroundShares)); err != nil {
		return err
	}
	return writeFile(filepath.Join(d, "tasks"), strconv.Itoa(tid))
}
