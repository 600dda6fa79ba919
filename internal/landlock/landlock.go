// Package landlock walls each command a sandbox runs off from every other one: the
// command starts in a Landlock domain of its own, and a process in a domain cannot
// ptrace, open /proc/PID/mem of, process_vm_readv/writev, pidfd_getfd from, nor read
// /proc/PID/fd of a process outside that domain and the domains nested in it
// (security/landlock/task.c: every ptrace_may_access of a domained caller, whatever
// the scopes), nor signal it (LANDLOCK_SCOPE_SIGNAL). So a background process one
// command left cannot seize the next command and rewrite its exit_group argument,
// while a command's own children (same domain, or nested) stay within its reach: gdb
// and strace on their own children work.
//
// Who calls Restrict, and why there:
//
//	sandbox init (no domain)
//	  spawn thread: Restrict, seccomp filter, fork+exec --> command, domain D1
//	  spawn thread: Restrict, seccomp filter, fork+exec --> command, domain D2
//	daemon (no domain)
//	  criu swrk, started through ExecArg (Restrict, exec) --> restored tree, domain D3
//	  ptrace injection (fast path): a template or a restored child is the fork of a
//	  process, and fork keeps the forking task's domain
//
// Init and the daemon stay outside every domain: init reaps and signals every
// process of its namespace, the daemon traces them (fast path) and CRIU dumps them.
// CRIU does not carry a domain in its images, so a restore is run inside a fresh one
// (ExecArg): the restored tree comes back walled off from what runs beside it.
//
// The ruleset handles no access right, only a scope: handled file-system rights
// would be tied to paths of the state's overlay, which every checkpoint replaces, and
// handled network rights refuse binds and connects. Landlock refuses a ruleset that
// handles nothing, and the ptrace wall comes with any domain; one scope is needed.
//
//   - LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET cannot be the one: CRIU's parasite, run
//     inside the dumped process, connects to an abstract socket the dumper bound
//     ("compel/src/lib/infect.c: Unable to connect a transport socket: Operation not
//     permitted", measured), so no process in such a domain could be checkpointed
//     through CRIU.
//   - LANDLOCK_SCOPE_SIGNAL is the one set, and it is what a grader wants besides: no
//     process outside a command's tree can stop, interrupt or kill it. A signal cannot
//     forge an exit code by itself (measured: TestSignalsDoNotForgeZero, a killed
//     command is answered as killed), but killing a command's child changes what the
//     command does: `pytest > log; ! grep -q FAILED log` with pytest killed half-way
//     answers 0. The price: a command cannot signal (nor `kill -0`) what
//     another command started; a server left in the background is stopped from the
//     command (or session) that started it, by a restore, or by the sandbox's removal
//     (docs/API.md).
//
// Needs Landlock ABI 6 (Linux 6.12) for scopes; Check says what is missing.
package landlock

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Scopes are the scopes of every domain this package makes (the package doc says why
// these).
const Scopes = unix.LANDLOCK_SCOPE_SIGNAL

// minABI is the first Landlock ABI with scopes.
const minABI = 6

// rulesetAttr is struct landlock_ruleset_attr up to the scopes (ABI 6): the kernel
// takes the size it is given, so the fields of later ABIs need not be passed.
type rulesetAttr struct {
	handledAccessFS  uint64
	handledAccessNet uint64
	scoped           uint64
}

// ABI returns the kernel's Landlock ABI version, or an error when Landlock is not
// enabled (EOPNOTSUPP: not in the lsm= list) or not built (ENOSYS).
func ABI() (int, error) {
	v, _, e := unix.Syscall(unix.SYS_LANDLOCK_CREATE_RULESET, 0, 0, unix.LANDLOCK_CREATE_RULESET_VERSION)
	if e != 0 {
		return 0, e
	}
	return int(v), nil
}

// Check returns nil if the kernel can make the domains this package makes, else an
// error saying what to change.
func Check() error {
	v, err := ABI()
	if err != nil {
		return fmt.Errorf("landlock is not available (%w): DeltaBox needs it to keep a sandbox's processes from tracing "+
			"or signalling the commands it runs; boot a kernel with CONFIG_SECURITY_LANDLOCK=y and landlock in lsm=", err)
	}
	if v < minABI {
		return fmt.Errorf("landlock ABI %d is too old: DeltaBox needs ABI %d (Linux 6.12) for scopes", v, minABI)
	}
	return nil
}

// Restrict puts the calling thread, and every process it forks from now on, in a new
// Landlock domain nested in its current one (none, for init's spawn threads). There is
// no way out of a domain: the thread is never to run anything else.
// Precondition: the OS thread is locked and is discarded (or execs) afterwards, and it
// has CAP_SYS_ADMIN in its user namespace (no no_new_privs: it would stop setuid
// programs such as sudo for a run-as user).
func Restrict() error {
	attr := rulesetAttr{scoped: Scopes}
	fd, _, e := unix.Syscall(unix.SYS_LANDLOCK_CREATE_RULESET, uintptr(unsafe.Pointer(&attr)), unsafe.Sizeof(attr), 0)
	if e != 0 {
		return fmt.Errorf("landlock_create_ruleset: %w (%v)", e, Check())
	}
	defer unix.Close(int(fd))
	if _, _, e := unix.Syscall(unix.SYS_LANDLOCK_RESTRICT_SELF, fd, 0, 0); e != 0 {
		return fmt.Errorf("landlock_restrict_self: %w", e)
	}
	return nil
}

// ExecArg is os.Args[1] of this binary re-executed to run a program in a new domain:
// `/proc/self/exe ExecArg PROGRAM ARGS...` restricts itself (Restrict) and execs
// PROGRAM (looked up in PATH) with the same environment and fds. Every binary that
// links this package does it, from the package's init, before main runs: the daemon
// and the test binaries alike. CRIU's restore runs this way (internal/durable).
const ExecArg = "__landlock-exec"

// Command is the argv that runs argv in a new domain.
func Command(argv ...string) []string {
	return append([]string{"/proc/self/exe", ExecArg}, argv...)
}

func init() {
	if len(os.Args) < 3 || os.Args[1] != ExecArg {
		return
	}
	// Package initialisation runs on the main thread, locked there by the runtime; the
	// domain is the thread's and execve keeps it.
	runtime.LockOSThread()
	if err := Restrict(); err != nil {
		fmt.Fprintf(os.Stderr, "deltabox %s: %v\n", ExecArg, err)
		os.Exit(127)
	}
	path, err := exec.LookPath(os.Args[2])
	if err != nil {
		fmt.Fprintf(os.Stderr, "deltabox %s: %v\n", ExecArg, err)
		os.Exit(127)
	}
	err = syscall.Exec(path, os.Args[2:], os.Environ())
	fmt.Fprintf(os.Stderr, "deltabox %s: exec %s: %v\n", ExecArg, path, err)
	os.Exit(127)
}
