package sbinit

import (
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// denyKeyrings makes add_key, request_key and keyctl fail with EPERM in init and in
// everything it starts (a seccomp filter is inherited across fork and exec, and cannot
// be removed): the sandbox has no kernel keyrings.
//
// Why (issue 14: a restore gives back what the checkpoint held, or refuses). Keyrings
// belong to no namespace a sandbox has (no user namespace yet), so what a process of
// the sandbox could reach was shared with the host and beyond any checkpoint:
//   - its session keyring was init's, inherited from the daemon (the daemon's, or root's
//     user session keyring): shared with the daemon, every other sandbox and the host;
//   - its user keyring is root's, the host's (keyrings are per user namespace and UID);
//   - a template is a fork, which shares the session keyring (one object, by reference)
//     and drops the process keyring (fork gives the child none): a key added after a
//     checkpoint survived the restore, and a process keyring did not come back.
//
// Neither half can be made exact from outside: a key's payload is readable only with
// the permissions the sandbox sets on it, a process's session and process keyrings
// are named only by that process (KEY_SPEC_*), and clearing root's user keyring would
// clear the host's. Refusing the calls keeps the sandbox out of all of it, as Docker's
// default seccomp profile does ("keyrings are not namespaced"). EPERM, Docker's answer
// too, says it is a policy; programs that use keyrings (a KEYRING: Kerberos cache,
// pam_keyinit) see what they see under that profile. A user namespace per sandbox (the
// isolation work) would give the sandbox a user keyring of its own, and this could be
// revisited then.
//
// The filter tests only the architecture and the system call number, so the kernel
// caches its answer per call (no BPF run on the other calls). Without no_new_privs:
// init has CAP_SYS_ADMIN, and setuid programs of the sandbox keep working.
func denyKeyrings() error {
	const (
		x32Bit = 0x40000000 // __X32_SYSCALL_BIT: x32 calls are the 64-bit numbers with this bit
		// x86-64 (and x32): add_key, request_key, keyctl; i386: the same three.
		addKey64, requestKey64, keyctl64 = 248, 249, 250
		addKey32, requestKey32, keyctl32 = 286, 287, 288
		ld                               = unix.BPF_LD | unix.BPF_W | unix.BPF_ABS
		jeq                              = unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K
		and                              = unix.BPF_ALU | unix.BPF_AND | unix.BPF_K
		ret                              = unix.BPF_RET | unix.BPF_K
		nr, arch                         = 0, 4 // offsets in struct seccomp_data
	)
	// Jt and Jf count the instructions skipped: 12 allows, 13 refuses.
	prog := []unix.SockFilter{
		{Code: ld, K: arch}, // 0
		{Code: jeq, K: unix.AUDIT_ARCH_X86_64, Jt: 0, Jf: 5}, // 1: else to 7
		{Code: ld, K: nr},                                           // 2
		{Code: and, K: ^uint32(x32Bit)},                             // 3
		{Code: jeq, K: addKey64, Jt: 8},                             // 4
		{Code: jeq, K: requestKey64, Jt: 7},                         // 5
		{Code: jeq, K: keyctl64, Jt: 6, Jf: 5},                      // 6
		{Code: jeq, K: unix.AUDIT_ARCH_I386, Jf: 4},                 // 7
		{Code: ld, K: nr},                                           // 8
		{Code: jeq, K: addKey32, Jt: 3},                             // 9
		{Code: jeq, K: requestKey32, Jt: 2},                         // 10
		{Code: jeq, K: keyctl32, Jt: 1},                             // 11
		{Code: ret, K: unix.SECCOMP_RET_ALLOW},                      // 12
		{Code: ret, K: unix.SECCOMP_RET_ERRNO | uint32(unix.EPERM)}, // 13
	}
	fp := unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]}
	// TSYNC: every thread of init, so that whichever thread forks, the child has it.
	r, _, e := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, unix.SECCOMP_FILTER_FLAG_TSYNC, uintptr(unsafe.Pointer(&fp)))
	if e != 0 {
		return fmt.Errorf("seccomp filter (keyrings): %w", e)
	}
	if r != 0 {
		return fmt.Errorf("seccomp filter (keyrings): thread %d could not take it", r)
	}
	return nil
}
