package sbinit

import (
	"os"
	"runtime"
	"testing"

	"golang.org/x/sys/unix"

	"deltabox/internal/testutil/skip"
)

// TestFilter installs the sandbox's filter on a thread of the test (then discarded) and
// checks one call per kind of rule: the assembler's jumps land where the table says.
func TestFilter(t *testing.T) {
	skip.Require(t, os.Geteuid() == 0, "needs root (a seccomp filter without no_new_privs needs CAP_SYS_ADMIN)")
	type call struct {
		name string
		nr   uintptr
		args [4]uintptr
		want unix.Errno // 0: allowed (whatever the call then answers, but not want's)
	}
	calls := []call{
		{"getpid", unix.SYS_GETPID, [4]uintptr{}, 0},
		{"mount", unix.SYS_MOUNT, [4]uintptr{}, unix.EPERM},
		{"keyctl", unix.SYS_KEYCTL, [4]uintptr{0, ^uintptr(2), 0}, unix.EPERM},
		{"open_tree_attr", unix.SYS_OPEN_TREE_ATTR, [4]uintptr{}, unix.EPERM},
		{"modify_ldt", unix.SYS_MODIFY_LDT, [4]uintptr{}, unix.EPERM},
		{"clone3", unix.SYS_CLONE3, [4]uintptr{}, unix.ENOSYS},
		{"listmount", unix.SYS_LISTMOUNT, [4]uintptr{}, unix.ENOSYS},
		{"unshare CLONE_NEWNS", unix.SYS_UNSHARE, [4]uintptr{unix.CLONE_NEWNS}, unix.EPERM},
		{"unshare CLONE_NEWTIME", unix.SYS_UNSHARE, [4]uintptr{unix.CLONE_NEWTIME}, unix.EPERM},
		{"unshare CLONE_FS", unix.SYS_UNSHARE, [4]uintptr{unix.CLONE_FS}, 0},
		// clone with a namespace flag and an invalid combination otherwise (CLONE_THREAD
		// without CLONE_SIGHAND: EINVAL when allowed), so nothing is made either way.
		{"clone CLONE_NEWNET", unix.SYS_CLONE, [4]uintptr{unix.CLONE_NEWNET | unix.CLONE_THREAD}, unix.EPERM},
		{"clone invalid", unix.SYS_CLONE, [4]uintptr{unix.CLONE_THREAD}, 0},
		{"personality query", unix.SYS_PERSONALITY, [4]uintptr{0xffffffff}, 0},
		{"personality READ_IMPLIES_EXEC", unix.SYS_PERSONALITY, [4]uintptr{0x0400000}, unix.EPERM},
		{"ioprio_set RT", unix.SYS_IOPRIO_SET, [4]uintptr{1, 0, 1<<13 | 4}, unix.EPERM},
		{"ioprio_set BE", unix.SYS_IOPRIO_SET, [4]uintptr{1, 0, 2<<13 | 4}, 0},
		// The sandbox cannot make a Landlock domain of its own (the version query would
		// answer 7 here; restrict_self of fd -1 EBADF).
		{"landlock_create_ruleset", unix.SYS_LANDLOCK_CREATE_RULESET, [4]uintptr{0, 0, unix.LANDLOCK_CREATE_RULESET_VERSION}, unix.ENOSYS},
		{"landlock_restrict_self", unix.SYS_LANDLOCK_RESTRICT_SELF, [4]uintptr{^uintptr(0), 0, 0}, unix.ENOSYS},
	}
	got := make(chan []unix.Errno, 1)
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread keeps the filter and dies
		if err := installFilter(); err != nil {
			errc <- err
			return
		}
		var out []unix.Errno
		for _, c := range calls {
			_, _, e := unix.RawSyscall(c.nr, c.args[0], c.args[1], c.args[2])
			out = append(out, e)
		}
		got <- out
	}()
	var out []unix.Errno
	select {
	case err := <-errc:
		t.Fatal(err)
	case out = <-got:
	}
	prog, err := filter()
	if err != nil {
		t.Fatal(err)
	}
	for i, c := range calls {
		if e := emulate(prog, uint32(c.nr), unix.AUDIT_ARCH_X86_64, c.args); e != c.want {
			t.Errorf("%s: the emulated filter answers errno %v, want %v", c.name, e, c.want)
		}
		switch {
		case c.want != 0 && out[i] != c.want:
			t.Errorf("%s: errno %v, want %v", c.name, out[i], c.want)
		case c.want == 0 && (out[i] == unix.EPERM || out[i] == unix.ENOSYS):
			t.Errorf("%s: errno %v, want it allowed", c.name, out[i])
		}
	}
}

// TestFilterArchitectures checks on the program (emulated: this kernel has no x32, and
// no call above lastReviewed, so both would fail with ENOSYS unfiltered) that x32
// numbers, i386 calls and numbers newer than the table fail with ENOSYS.
func TestFilterArchitectures(t *testing.T) {
	prog, err := filter()
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name string
		nr   uint32
		arch uint32
		want unix.Errno
	}{
		{"x86-64 getpid", unix.SYS_GETPID, unix.AUDIT_ARCH_X86_64, 0},
		{"x32 getpid", 0x40000000 + unix.SYS_GETPID, unix.AUDIT_ARCH_X86_64, unix.ENOSYS},
		{"x32 mount", 0x40000000 + unix.SYS_MOUNT, unix.AUDIT_ARCH_X86_64, unix.ENOSYS},
		{"i386 getpid", 20, unix.AUDIT_ARCH_I386, unix.ENOSYS},
		{"the last reviewed", lastReviewed, unix.AUDIT_ARCH_X86_64, 0},
		{"after the table", lastReviewed + 1, unix.AUDIT_ARCH_X86_64, unix.ENOSYS},
	} {
		if e := emulate(prog, c.nr, c.arch, [4]uintptr{}); e != c.want {
			t.Errorf("%s: errno %v, want %v", c.name, e, c.want)
		}
	}
}

// emulate runs the filter on one call as the kernel would (the opcodes buildFilter
// uses) and returns the errno it answers, 0 for ALLOW.
func emulate(prog []unix.SockFilter, nr, arch uint32, args [4]uintptr) unix.Errno {
	data := map[uint32]uint32{0: nr, 4: arch}
	for i, a := range args {
		data[uint32(16+8*i)] = uint32(a)
		data[uint32(20+8*i)] = uint32(uint64(a) >> 32)
	}
	var acc uint32
	for pc := 0; pc < len(prog); pc++ {
		in := prog[pc]
		switch in.Code {
		case unix.BPF_LD | unix.BPF_W | unix.BPF_ABS:
			acc = data[in.K]
		case unix.BPF_ALU | unix.BPF_AND | unix.BPF_K:
			acc &= in.K
		case unix.BPF_JMP | unix.BPF_JA:
			pc += int(in.K)
		case unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, unix.BPF_JMP | unix.BPF_JGE | unix.BPF_K,
			unix.BPF_JMP | unix.BPF_JGT | unix.BPF_K, unix.BPF_JMP | unix.BPF_JSET | unix.BPF_K:
			var ok bool
			switch in.Code &^ (unix.BPF_JMP | unix.BPF_K) {
			case unix.BPF_JEQ:
				ok = acc == in.K
			case unix.BPF_JGE:
				ok = acc >= in.K
			case unix.BPF_JGT:
				ok = acc > in.K
			case unix.BPF_JSET:
				ok = acc&in.K != 0
			}
			if ok {
				pc += int(in.Jt)
			} else {
				pc += int(in.Jf)
			}
		case unix.BPF_RET | unix.BPF_K:
			if in.K == unix.SECCOMP_RET_ALLOW {
				return 0
			}
			return unix.Errno(in.K & unix.SECCOMP_RET_DATA)
		default:
			panic("emulate: opcode not used by buildFilter")
		}
	}
	panic("emulate: ran off the end")
}

// TestFilterFallocate: with a disk quota, a fallocate longer than it fails with EDQUOT
// (the high and the low word of its 64-bit length each decide), one as long or shorter
// passes, and punching or collapsing a range of any length passes (they free blocks).
// Emulated: tests/security's TestDiskFallocateRefusedInCall runs it in a sandbox.
func TestFilterFallocate(t *testing.T) {
	const max = 5<<32 + 200<<20 // high word 5: both words are tested
	prog, err := buildFilter(max)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name      string
		mode, len uintptr
		want      unix.Errno
	}{
		{"at the limit", 0, max, 0},
		{"one byte over", 0, max + 1, unix.EDQUOT},
		{"high word over", 0, 6 << 32, unix.EDQUOT},
		{"high word under, low word large", 0, 4<<32 + 0xffffffff, 0},
		{"keep size, over", unix.FALLOC_FL_KEEP_SIZE, max + 1, unix.EDQUOT},
		{"zero range, over", unix.FALLOC_FL_ZERO_RANGE, max + 1, unix.EDQUOT},
		{"punch hole, over", unix.FALLOC_FL_PUNCH_HOLE | unix.FALLOC_FL_KEEP_SIZE, 1 << 62, 0},
		{"collapse range, over", unix.FALLOC_FL_COLLAPSE_RANGE, 1 << 62, 0},
		{"negative length", 0, 1 << 63, unix.EDQUOT},
	} {
		if e := emulate(prog, unix.SYS_FALLOCATE, unix.AUDIT_ARCH_X86_64, [4]uintptr{3, c.mode, 0, c.len}); e != c.want {
			t.Errorf("%s: errno %v, want %v", c.name, e, c.want)
		}
	}
	// Without a quota fallocate is not tested at all.
	prog, err = buildFilter(0)
	if err != nil {
		t.Fatal(err)
	}
	if e := emulate(prog, unix.SYS_FALLOCATE, unix.AUDIT_ARCH_X86_64, [4]uintptr{3, 0, 0, 1 << 62}); e != 0 {
		t.Errorf("no quota: errno %v, want it allowed", e)
	}
}
