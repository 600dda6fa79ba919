package remote

import (
	"encoding/binary"
	"fmt"
	"os"
	"strconv"

	"golang.org/x/sys/unix"
)

// A Batch is a list of syscalls a tracee runs in one hand-off.
//
// Each injected syscall (Syscall and the wrappers) is a round trip between the tracer's
// thread and the tracee: set the registers, resume, wait for the stop. On these VMs each
// leg is a cross-CPU wake-up (an idle vCPU halts at once), and a revive's 16 calls (setns,
// chdir, the terminal's open, dup3s and ioctls) took 0.8 ms of a restore in the daemon.
// A Batch is compiled into a short machine-code sequence (per call: load the argument
// registers, syscall, store the result, stop at the first failure) that is written over
// the first page of the tracee's vDSO, run with one PTRACE_CONT up to an int3, and
// replaced at once by the original bytes: one round trip for the lot.
//
// What holds for a single injection holds here: none of the tracee's own code runs (the
// program ends in int3, and its text is put back before anything else happens), a
// signal that arrives meanwhile is held and re-queued by Restore, a call interrupted by
// one is restarted by the kernel's own restart logic (the program is real code at a real
// address, so rip-2 is its syscall instruction), and registers are restored by Restore
// or Detach. The page is written through /proc/PID/mem (FOLL_FORCE, as a debugger sets
// a breakpoint): the tracee gets a private copy of it, byte-identical to the original
// once the batch is done. The vDSO rather than the libc's text: a private page gives its
// mapping an anon_vma, and fork copies the page tables of such a mapping instead of
// leaving the child to fault them in: 2 PTEs for the vDSO, a few hundred for libc's
// resident text, on every later fork of the process (checkpoints, restores). Without a
// vDSO (moved, unmapped) the page of the syscall instruction is used.
type Batch struct {
	calls  []batchCall
	closes []batchClose
}

type batchCall struct {
	name string
	nr   uintptr
	args []any
}

type batchClose struct{ open, close int }

// Ref names the result of an earlier call of the same Batch. As an argument of a later
// call it is replaced by that result when the call runs (a descriptor an open returned).
type Ref int

// Add appends syscall nr under name (which errors quote). An argument is an integer
// (int, int32, int64, uint32, uint64, uintptr), a Ref, a string (passed as the address
// of a NUL-terminated copy in scratch memory), a []byte (the address of a copy) or an
// *Out (the address of an output buffer).
func (b *Batch) Add(name string, nr uintptr, args ...any) Ref {
	if len(args) > 6 {
		panic(fmt.Sprintf("remote: batch call %s: %d arguments, at most 6", name, len(args)))
	}
	for _, a := range args {
		switch a := a.(type) {
		case int, int32, int64, uint32, uint64, uintptr, string, []byte, *Out:
		case Ref:
			if int(a) < 0 || int(a) >= len(b.calls) {
				panic(fmt.Sprintf("remote: batch call %s: Ref %d is not an earlier call", name, a))
			}
		default:
			panic(fmt.Sprintf("remote: batch call %s: argument of type %T", name, a))
		}
	}
	b.calls = append(b.calls, batchCall{name: name, nr: nr, args: args})
	return Ref(len(b.calls) - 1)
}

// Close appends close(fd) for a descriptor an earlier call returned. If the batch fails
// between that call and this close, RunBatch closes the descriptor all the same: the
// tracee is not left holding a descriptor it did not have.
func (b *Batch) Close(name string, fd Ref) {
	c := b.Add(name, unix.SYS_CLOSE, fd)
	b.closes = append(b.closes, batchClose{open: int(fd), close: int(c)})
}

// Out is an output buffer of a Batch: a call given it as an argument gets the address of
// its bytes in scratch memory, and Bytes holds what the calls wrote there once RunBatch
// has returned.
type Out struct {
	b    []byte
	addr uintptr
}

// Out returns an output buffer of n zero bytes.
func (b *Batch) Out(n int) *Out { return &Out{b: make([]byte, n)} }

// Bytes returns the buffer's contents (after RunBatch).
func (o *Out) Bytes() []byte { return o.b }

// Len is the number of calls.
func (b *Batch) Len() int { return len(b.calls) }

// BatchError is a call of a Batch that failed with Errno; the calls after it did not run.
type BatchError struct {
	Index int
	Name  string
	Errno unix.Errno
}

func (e *BatchError) Error() string { return e.Name + ": " + e.Errno.Error() }
func (e *BatchError) Unwrap() error { return e.Errno }

// RunBatch runs b in the tracee and returns every call's result. If a call fails, the
// calls after it do not run, the descriptors opened for a Close that was not reached are
// closed, and the error is a *BatchError (errors.Is(err, unix.ENOENT) works). A failure
// to drive the tracee is a *TraceeError, as for Syscall. Calls listed in the package doc
// as refused are refused here too.
func (t *Tracee) RunBatch(b *Batch) ([]uintptr, error) {
	var res []uintptr
	_, err := t.call("batch", func() (uintptr, error) {
		var err error
		res, err = t.runBatch(b)
		return 0, err
	})
	return res, err
}

const (
	pageSize  = 4096
	maxErrno  = 4095
	int3      = 0xcc
	siKernel  = 0x80 // si_code of the SIGTRAP an int3 raises
	batchTail = 2    // the two int3s: success, failure
)

// runBatch is RunBatch on the tracer's thread.
func (t *Tracee) runBatch(b *Batch) ([]uintptr, error) {
	n := len(b.calls)
	if n == 0 {
		return nil, nil
	}
	for _, c := range b.calls {
		if name, ok := refused[c.nr]; ok {
			return nil, fmt.Errorf("remote: %s: %w", name, ErrRefused)
		}
	}
	sc, err := t.syscallAddr()
	if err != nil {
		return nil, t.failed("find a syscall instruction", err)
	}
	if err := t.dirty(); err != nil {
		return nil, t.failed("set PTRACE_O_EXITKILL", err)
	}
	// Pointer arguments and the result slots go into scratch memory.
	var outs []*Out
	args := make([][]operand, n)
	for i, c := range b.calls {
		args[i] = make([]operand, len(c.args))
		for k, a := range c.args {
			var data []byte
			switch a := a.(type) {
			case Ref:
				args[i][k] = operand{ref: int(a), isRef: true}
				continue
			case string:
				data = append([]byte(a), 0)
			case []byte:
				data = a
			case *Out:
				if a.addr == 0 {
					addr, err := t.alloc(a.b)
					if err != nil {
						return nil, t.failed("scratch memory", err)
					}
					a.addr = addr
					outs = append(outs, a)
				}
				args[i][k] = operand{val: uint64(a.addr)}
				continue
			default:
				args[i][k] = operand{val: toUint64(a)}
				continue
			}
			addr, err := t.alloc(data)
			if err != nil {
				return nil, t.failed("scratch memory", err)
			}
			args[i][k] = operand{val: uint64(addr)}
		}
	}
	slots, err := t.alloc(make([]byte, 8*n))
	if err != nil {
		return nil, t.failed("scratch memory", err)
	}
	mem, err := unix.Open("/proc/"+strconv.Itoa(t.pid)+"/mem", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, t.failed("open /proc/PID/mem", err)
	}
	defer unix.Close(mem)
	page := t.batchPage(mem, sc)
	failedAt, errno := -1, unix.Errno(0)
	for first := 0; first < n && failedAt < 0; {
		code, next := compileBatch(b.calls, args, first, uint64(slots))
		idx, e, err := t.runCode(mem, page, code)
		if err != nil {
			return nil, t.failed("run a batch of syscalls", err)
		}
		if idx >= 0 {
			failedAt, errno = idx, e
		}
		first = next
	}
	raw, err := t.readSlots(slots, n)
	if err != nil {
		return nil, t.failed("read the batch's results", err)
	}
	for _, o := range outs {
		if err := t.readMem(o.addr, o.b); err != nil {
			return nil, t.failed("read the batch's output", err)
		}
		o.addr = 0 // the scratch memory is released on return
	}
	if failedAt < 0 {
		return raw, nil
	}
	// Close what was opened for a close that did not run (not a close that failed).
	for _, c := range b.closes {
		if c.open < failedAt && c.close > failedAt {
			if _, _, err := t.inject(unix.SYS_CLOSE, []uintptr{raw[c.open]}, nil); err != nil {
				return nil, t.failed("close a descriptor of a failed batch", err)
			}
		}
	}
	return raw[:failedAt], &BatchError{Index: failedAt, Name: b.calls[failedAt].name, Errno: errno}
}

// batchPage returns the page a batch's code is written to: the vDSO's first page (its
// address from the auxiliary vector, AT_SYSINFO_EHDR, checked to hold the vDSO's ELF
// header), else the page of the syscall instruction sc. Cached; a Clone3 child inherits
// it with the address space.
func (t *Tracee) batchPage(mem int, sc uintptr) uintptr {
	if t.codePage != 0 {
		return t.codePage
	}
	t.codePage = sc &^ (pageSize - 1)
	if v := vdsoBase(t.pid); v != 0 {
		var magic [4]byte
		if n, err := unix.Pread(mem, magic[:], int64(v)); err == nil && n == 4 && string(magic[:]) == "\x7fELF" {
			t.codePage = v
		}
	}
	return t.codePage
}

// vdsoBase returns AT_SYSINFO_EHDR from /proc/PID/auxv (0 if none).
func vdsoBase(pid int) uintptr {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/auxv")
	if err != nil {
		return 0
	}
	for i := 0; i+16 <= len(b); i += 16 {
		switch binary.LittleEndian.Uint64(b[i:]) {
		case 0: // AT_NULL
			return 0
		case 33: // AT_SYSINFO_EHDR
			return uintptr(binary.LittleEndian.Uint64(b[i+8:]))
		}
	}
	return 0
}

func (t *Tracee) readSlots(addr uintptr, n int) ([]uintptr, error) {
	buf := make([]byte, 8*n)
	if err := t.readMem(addr, buf); err != nil {
		return nil, err
	}
	out := make([]uintptr, n)
	for i := range out {
		out[i] = uintptr(binary.LittleEndian.Uint64(buf[8*i:]))
	}
	return out, nil
}

// runCode writes code over the tracee's text at page, runs it from its start to one of
// its two final int3s and puts the text back. It returns the index of the call that
// failed (-1 if none) and its errno; err is a failure to drive the tracee.
func (t *Tracee) runCode(mem int, page uintptr, code []byte) (failed int, errno unix.Errno, err error) {
	orig := make([]byte, len(code))
	if _, err := unix.Pread(mem, orig, int64(page)); err != nil {
		return -1, 0, fmt.Errorf("read the text to overwrite: %w", err)
	}
	if _, err := unix.Pwrite(mem, code, int64(page)); err != nil {
		return -1, 0, fmt.Errorf("write the batch's code: %w", err)
	}
	regs, err := t.runToTrap(page, page+uintptr(len(code))-batchTail)
	// The text is put back whatever happened (unless the tracee is gone).
	if t.state != gone {
		if _, werr := unix.Pwrite(mem, orig, int64(page)); werr != nil && err == nil {
			err = fmt.Errorf("put the text back: %w", werr)
		}
	}
	if err != nil {
		return -1, 0, err
	}
	if uintptr(regs.Rip) == page+uintptr(len(code)) { // past the failure int3
		return int(regs.Rbx), unix.Errno(-int64(regs.Rax)), nil
	}
	return -1, 0, nil
}

// runToTrap starts the tracee at entry with its saved registers otherwise (orig_rax -1,
// as for an injection) and resumes it until it stops on the int3 at done or done+1. Other
// stops are handled as step handles them: group-stop reports ignored, signals held (or
// dropped when the program raised them against the tracee), fork events refused.
func (t *Tracee) runToTrap(entry, done uintptr) (unix.PtraceRegs, error) {
	regs := t.saved
	regs.Rip = uint64(entry)
	regs.Orig_rax = ^uint64(0)
	t.regsDirt = true
	if err := unix.PtraceSetRegs(t.pid, &regs); err != nil {
		return regs, fmt.Errorf("set registers: %w", err)
	}
	for stops := 0; ; stops++ {
		if stops == maxStepStops {
			return regs, fmt.Errorf("%d stops without reaching the end of the batch", stops)
		}
		ws, err := t.resume(unix.PTRACE_CONT)
		if err != nil {
			return regs, err
		}
		if ev, err := t.event(ws, nil); err != nil {
			return regs, err
		} else if ev {
			continue
		}
		var si siginfo
		if err := t.getSiginfo(&si); err != nil {
			return regs, fmt.Errorf("get siginfo of %v: %w", ws.StopSignal(), err)
		}
		switch ws.StopSignal() {
		case unix.SIGSEGV, unix.SIGBUS, unix.SIGILL, unix.SIGFPE:
			// A fault of the program itself (the page not executable after all): not the
			// tracee's signal, and not one to deliver to it.
			if si.code() > 0 && unix.PtraceGetRegs(t.pid, &regs) == nil && uintptr(regs.Rip) >= entry && uintptr(regs.Rip) < done+2 {
				return regs, fmt.Errorf("the batch's code faulted (%v at %#x)", ws.StopSignal(), regs.Rip)
			}
		}
		if ws.StopSignal() == unix.SIGTRAP && si.code() == siKernel {
			if err := unix.PtraceGetRegs(t.pid, &regs); err != nil {
				return regs, fmt.Errorf("get registers: %w", err)
			}
			if rip := uintptr(regs.Rip); rip == done+1 || rip == done+2 {
				return regs, nil
			}
		}
		t.take(&si)
	}
}

// operand is a resolved argument: a value, or the result of call ref.
type operand struct {
	val   uint64
	ref   int
	isRef bool
}

func toUint64(a any) uint64 {
	switch a := a.(type) {
	case int:
		return uint64(a)
	case int32:
		return uint64(int64(a))
	case int64:
		return uint64(a)
	case uint32:
		return uint64(a)
	case uint64:
		return a
	case uintptr:
		return uint64(a)
	}
	panic(fmt.Sprintf("remote: batch argument of type %T", a))
}

// x86-64 register numbers of the syscall argument registers, in order.
var argRegs = [6]byte{7 /* rdi */, 6 /* rsi */, 2 /* rdx */, 10 /* r10 */, 8 /* r8 */, 9 /* r9 */}

// compileBatch emits the code of calls[first:next], as many as fit in a page (the code is
// position-independent), and returns it with next. Per call i:
//
//	mov ebx, i                 ; which call, for the failure trap
//	mov <arg regs>, values     ; a Ref: mov rax, [slot]; mov reg, rax
//	mov eax, nr
//	syscall
//	mov [slots+8*i], rax
//	cmp rax, -4095
//	jae fail                   ; -4095..-1: an errno
//
// then "int3" (done) and "fail: int3". Unused argument registers are zeroed, as Syscall
// does. The tracer reads rbx and rax at the failure trap.
func compileBatch(calls []batchCall, args [][]operand, first int, slots uint64) ([]byte, int) {
	var code []byte
	var fixups []int // offsets of jae rel32 fields
	i := first
	for ; i < len(calls); i++ {
		var c []byte
		c = append(c, 0xbb) // mov ebx, imm32
		c = binary.LittleEndian.AppendUint32(c, uint32(i))
		for k, reg := range argRegs {
			var op operand
			if k < len(args[i]) {
				op = args[i][k]
			}
			if op.isRef {
				c = append(c, 0x48, 0xa1) // mov rax, [moffs64]
				c = binary.LittleEndian.AppendUint64(c, slots+8*uint64(op.ref))
				c = append(c, rexB(0x48, reg), 0x89, 0xc0|reg&7) // mov reg, rax
				continue
			}
			c = movImm(c, reg, op.val)
		}
		c = movImm(c, 0, uint64(calls[i].nr))
		c = append(c, 0x0f, 0x05)                                  // syscall
		c = append(c, 0x48, 0xa3)                                  // mov [moffs64], rax
		c = binary.LittleEndian.AppendUint64(c, slots+8*uint64(i)) //
		c = append(c, 0x48, 0x3d, 0x01, 0xf0, 0xff, 0xff)          // cmp rax, -4095
		c = append(c, 0x0f, 0x83, 0, 0, 0, 0)                      // jae fail (patched below)
		if i > first && len(code)+len(c)+batchTail > pageSize {
			break
		}
		fixups = append(fixups, len(code)+len(c)-4)
		code = append(code, c...)
	}
	code = append(code, int3, int3)
	fail := len(code) - 1
	for _, f := range fixups {
		binary.LittleEndian.PutUint32(code[f:], uint32(int32(fail-(f+4))))
	}
	return code, i
}

// rexB returns rex with REX.B set when reg is r8-r15.
func rexB(rex, reg byte) byte {
	if reg >= 8 {
		return rex | 1
	}
	return rex
}

// movImm appends the shortest "reg = v": xor for 0, mov r32, imm32 (zero-extending) below
// 2^32, mov r64, imm64 otherwise.
func movImm(c []byte, reg byte, v uint64) []byte {
	switch {
	case v == 0:
		if reg >= 8 {
			c = append(c, 0x45)
		}
		return append(c, 0x31, 0xc0|(reg&7)<<3|reg&7) // xor r32, r32
	case v < 1<<32:
		if reg >= 8 {
			c = append(c, 0x41)
		}
		c = append(c, 0xb8+reg&7)
		return binary.LittleEndian.AppendUint32(c, uint32(v))
	}
	c = append(c, rexB(0x48, reg), 0xb8+reg&7)
	return binary.LittleEndian.AppendUint64(c, v)
}
