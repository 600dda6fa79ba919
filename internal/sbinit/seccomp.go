package sbinit

import (
	"fmt"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The sandbox's seccomp filter: a deny list in the spirit of Docker's and Podman's
// default profile (moby/profiles seccomp default.json, an allow list), installed by
// each spawn thread on itself alone, just before it forks (spawn): every process of the
// sandbox descends from such a fork and inherits it; init and its other threads do not
// have it, so init keeps its setns, unshare and mounts.
//
// Why hand-written BPF rather than a library: moby/profiles compiles through libseccomp
// (cgo, a C library on the host); elastic/go-seccomp-bpf is pure Go but a dependency for
// what is a table of ~70 numbers and four argument tests here. The program tests the
// architecture and the number first and loads an argument only on the branch of the
// five calls that need one, so the kernel's per-call action cache (since 5.11: it
// emulates the filter for every number at attach) answers ALLOW for every other call
// without running BPF at all.
//
// Why a deny list where Docker allows a list: what Docker's list leaves out is either
// here, or obsolete (ENOSYS anyway), or given by a capability the sandbox keeps for the
// fast path (CAP_SYS_ADMIN: dropCapabilities), which is why the calls it opens are
// listed. Calls newer than this table (lastReviewed) fail with ENOSYS, as in Docker's
// profile, so a new kernel's calls are refused until someone reads them.
//
// Where this differs from Docker's profile, beyond what the tables below say:
//   - 32-bit (i386, via int 0x80) and x32 calls are refused; Docker allows both
//     architectures. Their numbers differ from x86-64's, so a deny list would need a
//     table each; agents run 64-bit programs.
//   - Allowed here, refused by Docker without CAP_SYS_NICE: mbind, set_mempolicy,
//     migrate_pages, move_pages. On the caller's own memory they are harmless (numpy's
//     BLAS and hwloc call mbind); on another process's they need CAP_SYS_NICE, dropped.
//   - unshare and clone are refused only with namespace flags (Docker: unshare refused
//     outright without CAP_SYS_ADMIN); unshare(CLONE_FS|CLONE_FILES) is harmless.
//
// The fast path's injected calls (setns, clone3 with set_tid) are not filtered: the
// daemon seizes with PTRACE_O_SUSPEND_SECCOMP (internal/remote), which a tracer may set
// only with CAP_SYS_ADMIN in the initial user namespace and no filter of its own.
//
// No no_new_privs: it is not needed to install the filter (the spawn thread has
// CAP_SYS_ADMIN), and it would stop setuid programs, sudo for a run-as user first of
// all, as Docker's default (no-new-privileges is opt-in there). What a setuid program
// gains is bounded anyway: the bounding set applies to it and the filter is inherited.

// lastReviewed is the highest x86-64 system call number this table was written
// against (Linux 6.18: rseq_slice_yield).
const lastReviewed = 471

// denied are refused with EPERM, whatever their arguments. Where Docker differs, the
// comment says so.
var denied = []struct {
	nr  uint32
	why string
}{
	// Mounts: the sandbox's mount namespaces are the daemon's to build; a fresh proc or
	// cgroup v1 mount would make core_pattern or release_agent writable.
	{unix.SYS_MOUNT, "mount"}, {unix.SYS_UMOUNT2, "umount2"}, {unix.SYS_PIVOT_ROOT, "pivot_root"},
	{unix.SYS_FSOPEN, "fsopen"}, {unix.SYS_FSCONFIG, "fsconfig"}, {unix.SYS_FSMOUNT, "fsmount"},
	{unix.SYS_FSPICK, "fspick"}, {unix.SYS_MOVE_MOUNT, "move_mount"}, {unix.SYS_OPEN_TREE, "open_tree"},
	{unix.SYS_MOUNT_SETATTR, "mount_setattr"}, {unix.SYS_OPEN_TREE_ATTR, "open_tree_attr"},
	// Namespaces: setns would reach the host's through any nsfs fd; unshare and clone
	// with namespace flags are tested below (nsFlags).
	{unix.SYS_SETNS, "setns"},
	// Kernel keyrings are in no namespace of the sandbox (issue 14): its session keyring
	// would be the daemon's, its user keyring root's, and a template shares the session
	// keyring by reference, so a key added after a checkpoint survived its restore.
	// Docker refuses them for the same reason ("keyrings are not namespaced").
	{unix.SYS_ADD_KEY, "add_key"}, {unix.SYS_REQUEST_KEY, "request_key"}, {unix.SYS_KEYCTL, "keyctl"},
	// The kernel itself: modules, kexec, reboot (in a PID namespace it kills init, which
	// the daemon, not the sandbox, ends), swap, accounting, quotas.
	{unix.SYS_INIT_MODULE, "init_module"}, {unix.SYS_FINIT_MODULE, "finit_module"},
	{unix.SYS_DELETE_MODULE, "delete_module"}, {unix.SYS_CREATE_MODULE, "create_module"},
	{unix.SYS_GET_KERNEL_SYMS, "get_kernel_syms"}, {unix.SYS_QUERY_MODULE, "query_module"},
	{unix.SYS_KEXEC_LOAD, "kexec_load"}, {unix.SYS_KEXEC_FILE_LOAD, "kexec_file_load"},
	{unix.SYS_REBOOT, "reboot"}, {unix.SYS_SWAPON, "swapon"}, {unix.SYS_SWAPOFF, "swapoff"},
	{unix.SYS_ACCT, "acct"}, {unix.SYS_QUOTACTL, "quotactl"}, {unix.SYS_QUOTACTL_FD, "quotactl_fd"},
	{unix.SYS_NFSSERVCTL, "nfsservctl"}, {unix.SYS_USELIB, "uselib"}, {unix.SYS__SYSCTL, "_sysctl"},
	{unix.SYS_LOOKUP_DCOOKIE, "lookup_dcookie"},
	// The host's clock. Docker allows adjtimex and clock_adjtime (a read with modes 0
	// needs no capability) and relies on CAP_SYS_TIME being absent for writes; here they
	// are refused outright: the clock is the host's and every sandbox's, and a reader
	// (ntp_gettime) is rare in what agents run.
	{unix.SYS_SETTIMEOFDAY, "settimeofday"}, {unix.SYS_CLOCK_SETTIME, "clock_settime"},
	{unix.SYS_CLOCK_ADJTIME, "clock_adjtime"}, {unix.SYS_ADJTIMEX, "adjtimex"},
	// The kernel log, hardware ports, the terminal hang-up of every session.
	{unix.SYS_SYSLOG, "syslog"}, {unix.SYS_IOPL, "iopl"}, {unix.SYS_IOPERM, "ioperm"},
	{unix.SYS_VHANGUP, "vhangup"},
	// Kernel attack surface out of proportion to its use by agents: bpf and perf (Docker:
	// only with CAP_BPF, CAP_PERFMON or CAP_SYS_ADMIN, which the sandbox keeps, so here
	// always), userfaultfd (stalls the kernel in a copy at will), io_uring (Docker refuses
	// it since 25.0; libuv, Node's, falls back to threads), fanotify (Docker: only with
	// CAP_SYS_ADMIN; its permission events on the sandbox's overlay would block the
	// daemon's own file API calls there).
	{unix.SYS_BPF, "bpf"}, {unix.SYS_PERF_EVENT_OPEN, "perf_event_open"},
	{unix.SYS_USERFAULTFD, "userfaultfd"}, {unix.SYS_IO_URING_SETUP, "io_uring_setup"},
	{unix.SYS_IO_URING_ENTER, "io_uring_enter"}, {unix.SYS_IO_URING_REGISTER, "io_uring_register"},
	{unix.SYS_FANOTIFY_INIT, "fanotify_init"},
	// open_by_handle_at opens any inode of a filesystem from an fd on it, past the
	// sandbox's root: the store's XFS through an fd the sandbox should never have had.
	{unix.SYS_OPEN_BY_HANDLE_AT, "open_by_handle_at"},
	// modify_ldt: 16-bit segments (Wine), a source of kernel bugs; Docker refuses it.
	{unix.SYS_MODIFY_LDT, "modify_ldt"},
}

// enosys are refused with ENOSYS: a caller falls back as on an older kernel.
var enosys = []struct {
	nr  uint32
	why string
}{
	// clone3 passes its flags in memory, which BPF cannot read: glibc then falls back
	// to clone, whose flags the filter tests (nsFlags). As Docker does.
	{unix.SYS_CLONE3, "clone3"},
	// With CAP_SYS_ADMIN in the initial user namespace (until the sandbox has its own),
	// these list every mount and namespace of the host by id. libmount falls back to
	// /proc/self/mountinfo on ENOSYS.
	{unix.SYS_LISTMOUNT, "listmount"}, {unix.SYS_STATMOUNT, "statmount"}, {unix.SYS_LISTNS, "listns"},
	// Landlock, as on a kernel without it (programs that sandbox themselves with it
	// carry on without: landrun, Landlock-aware builds of curl or ssh). Every command
	// already runs in a domain of its own (package landlock, made before this filter);
	// a domain a process made for itself could not be kept: CRIU's images do not carry
	// it (a restore would silently lift it), and file rights it handled would refuse
	// the fast path's injected open and chdir on the state's next overlay.
	{unix.SYS_LANDLOCK_CREATE_RULESET, "landlock_create_ruleset"}, {unix.SYS_LANDLOCK_ADD_RULE, "landlock_add_rule"},
	{unix.SYS_LANDLOCK_RESTRICT_SELF, "landlock_restrict_self"},
}

// nsFlags are the namespace flags refused in clone (its first argument; CLONE_NEWTIME
// is not one there, its bit is part of the exit signal) and unshare (CLONE_NEWTIME
// too): a new namespace is a way around the sandbox's (a user namespace gives a process
// every capability again, in it; Docker refuses them likewise).
const nsFlags = unix.CLONE_NEWNS | unix.CLONE_NEWCGROUP | unix.CLONE_NEWUTS | unix.CLONE_NEWIPC |
	unix.CLONE_NEWUSER | unix.CLONE_NEWPID | unix.CLONE_NEWNET

// personalities are the personality(2) values allowed, as in Docker (PER_LINUX,
// PER_LINUX32, UNAME26 with each, and 0xffffffff, the query) plus ADDR_NO_RANDOMIZE with
// each, which gdb sets to start a program (Docker refuses it: gdb then warns and goes
// on). It weakens only the caller's own layout, and exec of a setuid program clears it.
var personalities = []uint32{0, 0x8, 0x20000, 0x20008, 0xffffffff, 0x40000, 0x40008, 0x60000, 0x60008}

// ioprioClassRT is IOPRIO_CLASS_RT in ioprio_set's third argument (class << 13):
// CAP_SYS_ADMIN allows it, and a real-time I/O class would starve the store's other
// users (the daemon's index commits, other sandboxes).
const ioprioClassMask, ioprioClassRT = 0x7 << 13, 1 << 13

// seccomp_data offsets (include/uapi/linux/seccomp.h), arguments little-endian: the
// low 32 bits of argument i are at 16+8i.
const (
	offNr, offArch = 0, 4
	offArg0Lo      = 16
	offArg1Lo      = 16 + 1*8
	offArg2Lo      = 16 + 2*8
	offArg3Lo      = 16 + 3*8
	offArg3Hi      = 16 + 3*8 + 4
	x32Bit         = 0x40000000 // __X32_SYSCALL_BIT
)

// fallocateMax is Config.DiskQuota, set by Main before the filter is built.
var fallocateMax int64

// filter is the assembled program (built once; the spawn threads share it).
var filter = sync.OnceValues(func() ([]unix.SockFilter, error) { return buildFilter(fallocateMax) })

// fallocate(2) modes that free blocks, which any length may do.
const fallocFree = unix.FALLOC_FL_PUNCH_HOLE | unix.FALLOC_FL_COLLAPSE_RANGE

// installFilter puts the sandbox's filter on the calling thread alone (no TSYNC).
// Precondition: the OS thread is locked and is discarded afterwards (spawn), and has
// CAP_SYS_ADMIN (no no_new_privs).
func installFilter() error {
	prog, err := filter()
	if err != nil {
		return err
	}
	fp := unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]}
	if _, _, e := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, 0, uintptr(unsafe.Pointer(&fp))); e != 0 {
		return fmt.Errorf("install the sandbox's seccomp filter: %w", e)
	}
	return nil
}

// buildFilter assembles the filter:
//
//	arch != x86-64                  -> ENOSYS (i386 via int 0x80 would have other numbers)
//	nr >= x32 bit or > lastReviewed -> ENOSYS
//	nr in denied                    -> EPERM
//	nr in enosys                    -> ENOSYS
//	clone   flags & nsFlags         -> EPERM
//	unshare flags & nsFlags|NEWTIME -> EPERM
//	personality not in the list     -> EPERM
//	ioprio_set class RT             -> EPERM
//	fallocate len > fallocMax       -> EDQUOT (fallocMax > 0; modes that free blocks pass)
//	else                            -> ALLOW
//
// The fallocate test is the sandbox's disk quota made at the call: the kernel has no
// XFS quotas here, and the daemon's watcher (state/diskquota.go) sees what a call
// allocated only at its next pass, while one fallocate reserves any number of blocks at
// once (200 MiB in 3 ms here, the exec of fallocate(1) included). A length over the
// whole quota can never fit, so it is refused in the call with the error a quota gives
// (EDQUOT, "Disk quota exceeded"). Shorter calls that add up past it are the watcher's.
func buildFilter(fallocMax int64) ([]unix.SockFilter, error) {
	var a asm
	a.ld(offArch)
	a.jeq(unix.AUDIT_ARCH_X86_64, "", "enosys")
	a.ld(offNr)
	a.jge(x32Bit, "enosys", "")
	a.jgt(lastReviewed, "enosys", "")
	for _, d := range denied {
		a.jeq(d.nr, "eperm", "")
	}
	for _, d := range enosys {
		a.jeq(d.nr, "enosys", "")
	}
	a.jeq(unix.SYS_CLONE, "clone", "")
	a.jeq(unix.SYS_UNSHARE, "unshare", "")
	a.jeq(unix.SYS_PERSONALITY, "personality", "")
	a.jeq(unix.SYS_IOPRIO_SET, "ioprio", "")
	if fallocMax > 0 {
		a.jeq(unix.SYS_FALLOCATE, "fallocate", "")
	}
	a.ret(unix.SECCOMP_RET_ALLOW) // jumps are forward only: "allow" is repeated at the end

	a.label("clone")
	a.ld(offArg0Lo)
	a.jset(nsFlags, "eperm", "allow")
	a.label("unshare")
	a.ld(offArg0Lo)
	a.jset(nsFlags|unix.CLONE_NEWTIME, "eperm", "allow")
	a.label("personality")
	a.ld(offArg0Lo)
	for _, p := range personalities {
		a.jeq(p, "allow", "")
	}
	a.ja("eperm")
	a.label("ioprio")
	a.ld(offArg2Lo)
	a.and(ioprioClassMask)
	a.jeq(ioprioClassRT, "eperm", "allow")

	if fallocMax > 0 {
		// len is 64 bits: its high word first, then its low one when the high ones tie.
		hi, lo := uint32(uint64(fallocMax)>>32), uint32(fallocMax)
		a.label("fallocate")
		a.ld(offArg1Lo)
		a.jset(fallocFree, "allow", "")
		a.ld(offArg3Hi)
		a.jgt(hi, "edquot", "")
		a.jeq(hi, "", "allow")
		a.ld(offArg3Lo)
		a.jgt(lo, "edquot", "allow")
	}

	a.label("allow")
	a.ret(unix.SECCOMP_RET_ALLOW)
	a.label("edquot")
	a.ret(unix.SECCOMP_RET_ERRNO | uint32(unix.EDQUOT))
	a.label("eperm")
	a.ret(unix.SECCOMP_RET_ERRNO | uint32(unix.EPERM))
	a.label("enosys")
	a.ret(unix.SECCOMP_RET_ERRNO | uint32(unix.ENOSYS))
	return a.assemble()
}

// asm is a classic BPF assembler with named forward jumps ("" is the next instruction).
type asm struct {
	prog   []unix.SockFilter
	jt, jf []string
	labels map[string]int
}

func (a *asm) emit(code uint16, k uint32, jt, jf string) {
	a.prog = append(a.prog, unix.SockFilter{Code: code, K: k})
	a.jt = append(a.jt, jt)
	a.jf = append(a.jf, jf)
}

func (a *asm) label(name string) {
	if a.labels == nil {
		a.labels = map[string]int{}
	}
	a.labels[name] = len(a.prog)
}

func (a *asm) ld(off uint32) { a.emit(unix.BPF_LD|unix.BPF_W|unix.BPF_ABS, off, "", "") }
func (a *asm) and(k uint32)  { a.emit(unix.BPF_ALU|unix.BPF_AND|unix.BPF_K, k, "", "") }
func (a *asm) ret(k uint32)  { a.emit(unix.BPF_RET|unix.BPF_K, k, "", "") }
func (a *asm) ja(to string)  { a.emit(unix.BPF_JMP|unix.BPF_JA, 0, to, "") }
func (a *asm) jeq(k uint32, t, f string) {
	a.emit(unix.BPF_JMP|unix.BPF_JEQ|unix.BPF_K, k, t, f)
}
func (a *asm) jge(k uint32, t, f string) {
	a.emit(unix.BPF_JMP|unix.BPF_JGE|unix.BPF_K, k, t, f)
}
func (a *asm) jgt(k uint32, t, f string) {
	a.emit(unix.BPF_JMP|unix.BPF_JGT|unix.BPF_K, k, t, f)
}
func (a *asm) jset(k uint32, t, f string) {
	a.emit(unix.BPF_JMP|unix.BPF_JSET|unix.BPF_K, k, t, f)
}

// assemble resolves the labels: conditional jumps are forward and at most 255
// instructions long (8-bit offsets), JA's offset is K.
func (a *asm) assemble() ([]unix.SockFilter, error) {
	rel := func(i int, name string, max int) (int, error) {
		if name == "" {
			return 0, nil
		}
		to, ok := a.labels[name]
		if !ok {
			return 0, fmt.Errorf("seccomp: no label %q", name)
		}
		d := to - i - 1
		if d < 0 || d > max {
			return 0, fmt.Errorf("seccomp: jump from %d to %q (%d) out of range", i, name, to)
		}
		return d, nil
	}
	out := append([]unix.SockFilter(nil), a.prog...)
	for i := range out {
		if out[i].Code == unix.BPF_JMP|unix.BPF_JA {
			d, err := rel(i, a.jt[i], 1<<30)
			if err != nil {
				return nil, err
			}
			out[i].K = uint32(d)
			continue
		}
		t, err := rel(i, a.jt[i], 255)
		if err != nil {
			return nil, err
		}
		f, err := rel(i, a.jf[i], 255)
		if err != nil {
			return nil, err
		}
		out[i].Jt, out[i].Jf = uint8(t), uint8(f)
	}
	return out, nil
}
