package durable

import (
	"fmt"
	"os"
	"path/filepath"
	"unsafe"

	"golang.org/x/sys/unix"

	"deltabox/internal/criu"
)

// A dump's CRIU runs as the owner of the sandbox's user namespace.
//
// Each sandbox's user namespace is owned by the sandbox's own uid base, not by host
// root (sbinit.startIn says why: the kernel's per-user budgets). Host root keeps every
// capability it has over the namespace, but no longer gets, as its owner, those it
// lacks on the host: on these VMs CAP_SYS_RESOURCE is not in the bounding set, and
// CRIU's dump reads each task's rlimits with prlimit(2), which the kernel allows on
// another user's task only with CAP_SYS_RESOURCE in the task's user namespace
// (check_prlimit_permission: "Can't get rlimit 0: Operation not permitted"). The kernel
// grants the namespace's owner, from the parent namespace, every capability in it
// (cap_capable). So where the daemon lacks CAP_SYS_RESOURCE, a dump's CRIU runs with
// the owner's uids (real, effective, saved) and the daemon's capabilities as ambient
// ones (Go raises them in the child: SysProcAttr.AmbientCaps), which an exec of a
// binary without file capabilities keeps as its effective set. CRIU refuses a non-zero
// euid unless in its --unprivileged mode (the request's unprivileged field); for a dump
// that mode only skips what DeltaBox does not use (the cgroup images: restores ignore
// cgroups; the loginuid; netfilter modules; raising its own RLIMIT_NOFILE, which fails
// here anyway) and keeps its kernel probe cache under XDG_RUNTIME_DIR (unprivKdatDir).
// The image files it writes are the owner's, in a directory of the daemon's (0700) that
// nothing of the sandbox reaches. CRIU runs in the host's PID namespace for a dump, so
// no process of the sandbox (the same uid, but in a child user namespace without
// CAP_SYS_PTRACE over the host's) can name it, let alone trace it.
//
// Restores stay root's: nothing in them needs the owner.

// nsGetOwnerUID is NS_GET_OWNER_UID (linux/nsfs.h): _IO(0xb7, 0x4).
const nsGetOwnerUID = 0xb704

// unprivKdatDir is where an owner's CRIU keeps its kernel probes (XDG_RUNTIME_DIR): a
// directory of its own in criu.KdatDir (root's, 0700), since --unprivileged probes
// less and must not share root's cache.
var unprivKdatDir = filepath.Join(criu.KdatDir, "unprivileged")

// nsOwnerOf returns the owner uid of pid's user namespace, as the daemon's namespace
// sees it.
func nsOwnerOf(pid int) (uint32, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/ns/user", pid))
	if err != nil {
		return 0, fmt.Errorf("the user namespace of pid %d: %w", pid, err)
	}
	defer func() { _ = f.Close() }() // read-only: an ioctl
	var uid uint32
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), nsGetOwnerUID, uintptr(unsafe.Pointer(&uid))); e != 0 {
		return 0, fmt.Errorf("the owner of the user namespace of pid %d: %w", pid, e)
	}
	return uid, nil
}

// hasCapSysResource reports whether the daemon has CAP_SYS_RESOURCE in its effective
// set (then CRIU, root, has it too and needs to be no owner).
func hasCapSysResource() bool {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var c [2]unix.CapUserData
	if unix.Capget(&hdr, &c[0]) != nil {
		return false
	}
	return c[unix.CAP_SYS_RESOURCE/32].Effective&(1<<(unix.CAP_SYS_RESOURCE%32)) != 0
}

// becomeOwner sets the calling thread's uids to uid, keeping its capabilities
// (PR_SET_KEEPCAPS across the setresuid, then the effective set raised again), and
// returns the capabilities to give the child as ambient ones, and a function that puts
// the thread back (uids 0, capabilities and keep-caps as they were) and reports whether
// it could. Precondition: the OS thread is locked, and is discarded (never unlocked)
// when the way back fails.
func becomeOwner(uid uint32) (ambient []uintptr, back func() bool, err error) {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var saved [2]unix.CapUserData
	if err := unix.Capget(&hdr, &saved[0]); err != nil {
		return nil, nil, fmt.Errorf("capget: %w", err)
	}
	back = func() bool {
		// Back to uid 0 the kernel sets the effective set to the permitted one
		// (cap_emulate_setxuid); capset then puts it back as it was.
		if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, 0, 0, 0); e != 0 {
			return false
		}
		if unix.Prctl(unix.PR_SET_KEEPCAPS, 0, 0, 0, 0) != nil {
			return false
		}
		h := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
		c := saved
		if unix.Capset(&h, &c[0]) != nil {
			return false
		}
		var r, e, s uint32
		_, _, _ = unix.RawSyscall(unix.SYS_GETRESUID, uintptr(unsafe.Pointer(&r)), uintptr(unsafe.Pointer(&e)), uintptr(unsafe.Pointer(&s))) // cannot fail: the pointers are valid
		return r == 0 && e == 0 && s == 0
	}
	if err := unix.Prctl(unix.PR_SET_KEEPCAPS, 1, 0, 0, 0); err != nil {
		return nil, nil, fmt.Errorf("keep capabilities across setresuid: %w", err)
	}
	if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, uintptr(uid), uintptr(uid), uintptr(uid)); e != 0 {
		back()
		return nil, nil, fmt.Errorf("setresuid to the sandbox's owner %d for CRIU: %w", uid, e)
	}
	c := saved
	c[0].Effective, c[1].Effective = c[0].Permitted, c[1].Permitted
	if err := unix.Capset(&hdr, &c[0]); err != nil {
		back()
		return nil, nil, fmt.Errorf("raise the capabilities again as uid %d for CRIU: %w", uid, err)
	}
	for i := 0; i < 64; i++ {
		if saved[i/32].Permitted&(1<<(i%32)) != 0 {
			ambient = append(ambient, uintptr(i))
		}
	}
	return ambient, back, nil
}

// ensureUnprivKdatDir makes unprivKdatDir (in root's criu.KdatDir).
func ensureUnprivKdatDir() error {
	if err := os.MkdirAll(unprivKdatDir, 0o700); err != nil {
		return fmt.Errorf("CRIU's probe cache for dumps as a sandbox's owner: %w", err)
	}
	return nil
}
