package durable

import (
	"fmt"
	"os"
	"unsafe"

	"golang.org/x/sys/unix"
)

// CRIU dumps with the real uid and gid of the sandbox's root.
//
// Each sandbox's user namespace is owned by the sandbox's own uid base, not by host
// root (sbinit.startIn says why: the kernel's per-user budgets). Host root keeps every
// capability it has over the namespace, but no longer gets, as its owner, those it
// lacks on the host: on these VMs CAP_SYS_RESOURCE is not in the bounding set, and
// CRIU's dump reads each task's rlimits with prlimit(2), which the kernel allows on
// another user's task only with CAP_SYS_RESOURCE in the task's user namespace
// (check_prlimit_permission: "Can't get rlimit 0: Operation not permitted"), or when
// the caller's real uid and gid are all of the task's uids and gids. So a dump's CRIU
// runs with the real uid and gid of the sandbox's root (the owner: root inside maps to
// it) and effective ids 0: CRIU requires euid 0 (or its --unprivileged mode, which
// gives up lazy pages, cgroups and more), the capabilities stay those of root, its
// files are root's, and prlimit of the sandbox's root tasks is an id match. A task of
// another uid inside still needs CAP_SYS_RESOURCE: on a host whose root has it,
// nothing changes; on these VMs CRIU cannot dump it (the checkpoint says so).
// The exec is a set-id one to the kernel (euid differs from the real uid): glibc
// ignores LD_* and a few other variables in CRIU's environment (none is set), and CRIU
// is not dumpable (CRIU is never the target of ptrace).

// nsGetOwnerUID is NS_GET_OWNER_UID (linux/nsfs.h): _IO(0xb7, 0x4).
const nsGetOwnerUID = 0xb704

// nsOwnerOf returns the owner uid of pid's user namespace, as the daemon's namespace
// sees it.
func nsOwnerOf(pid int) (uint32, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/ns/user", pid))
	if err != nil {
		return 0, fmt.Errorf("the user namespace of pid %d: %w", pid, err)
	}
	defer f.Close()
	var uid uint32
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), nsGetOwnerUID, uintptr(unsafe.Pointer(&uid))); e != 0 {
		return 0, fmt.Errorf("the owner of the user namespace of pid %d: %w", pid, e)
	}
	return uid, nil
}

// hasCapSysResource reports whether the daemon has CAP_SYS_RESOURCE in its effective
// set (then CRIU has it too, and needs no owner's ids).
func hasCapSysResource() bool {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var c [2]unix.CapUserData
	if unix.Capget(&hdr, &c[0]) != nil {
		return false
	}
	return c[unix.CAP_SYS_RESOURCE/32].Effective&(1<<(unix.CAP_SYS_RESOURCE%32)) != 0
}

// realIDs sets the calling thread's real uid and gid to id (raw calls: per thread, where
// Go's syscall.Setresuid changes every thread), its effective and saved ids staying 0,
// so its capabilities do not change, and returns a function that sets them back to 0
// and reports whether it could. Precondition: the OS thread is locked, and is discarded
// (never unlocked) when the way back fails.
func realIDs(id uint32) (back func() bool, err error) {
	keep := ^uintptr(0) // -1: unchanged
	back = func() bool {
		unix.RawSyscall(unix.SYS_SETRESUID, 0, keep, keep)
		unix.RawSyscall(unix.SYS_SETRESGID, 0, keep, keep)
		var ids [6]uint32
		unix.RawSyscall(unix.SYS_GETRESUID, uintptr(unsafe.Pointer(&ids[0])), uintptr(unsafe.Pointer(&ids[1])), uintptr(unsafe.Pointer(&ids[2])))
		unix.RawSyscall(unix.SYS_GETRESGID, uintptr(unsafe.Pointer(&ids[3])), uintptr(unsafe.Pointer(&ids[4])), uintptr(unsafe.Pointer(&ids[5])))
		return ids == [6]uint32{}
	}
	if _, _, e := unix.RawSyscall(unix.SYS_SETRESGID, uintptr(id), keep, keep); e != 0 {
		back()
		return nil, fmt.Errorf("set the real gid to the sandbox's root %d for CRIU: %w", id, e)
	}
	if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, uintptr(id), keep, keep); e != 0 {
		back()
		return nil, fmt.Errorf("set the real uid to the sandbox's root %d for CRIU: %w", id, e)
	}
	return back, nil
}
