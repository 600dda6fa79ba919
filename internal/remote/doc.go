// Package remote makes a stopped, traced process execute syscalls by injection
// (x86-64 Linux): the fast path's template fork (clone3, with set_tid for a PID-stable
// restore) and the fix-ups after it (open, lseek, dup3, close, chdir, setns, setsid,
// ioctl, setitimer, prctl, madvise, mmap...), with the process left exactly as it was.
//
// # Life of a tracee
//
//	tr := remote.NewTracer()            // one locked OS thread
//	t, err := tr.Seize(pid)             // PTRACE_SEIZE + PTRACE_INTERRUPT, registers saved
//	err = tr.Do(func() error {          // one hand-off to the thread for the whole sequence
//		fd, err := t.Open(path, unix.O_RDONLY, 0) // each result checked here, before the
//		...                                      // tracee runs any code of its own
//	})
//	child, err := t.Clone3(remote.CloneArgs{Flags: unix.CLONE_PARENT}) // traced, stopped
//	err = child.KeepStopped()           // a template: held in its ptrace-stop, SIGSTOP queued
//	err = t.Detach()                    // memory, registers, signals restored; it resumes
//
// Between Seize and Detach the tracee runs none of its own code: it sits in a ptrace-stop
// and only ever executes the injected syscall instruction, one single-step at a time.
//
// # Ownership (who may call what)
//
// ptrace binds a tracee to the tracer *thread*. A Tracer owns one goroutine locked to its
// OS thread (runtime.LockOSThread, never unlocked) that makes every ptrace request and
// every wait for its tracees; the thread exits when Close returns, after Close detached
// (or, failing to restore, killed) every tracee still held, so the kernel's implicit
// detach at thread exit never applies to a tracee this package holds. One Tracer may own
// many tracees (an injected clone3's child is traced by the same thread, necessarily);
// their work is serialised. Use several Tracers for parallelism.
//
// Every exported method may be called from any goroutine: it is sent as a closure to the
// Tracer's thread, so no function here has the precondition "called on the tracer's
// thread". Tracer.Do runs a caller's closure there; Tracee methods called inside it run
// directly (a sequence costs one hand-off instead of one per call). Nothing else in the
// process may wait for a tracee (wait4(-1) or wait4(pid) with __WALL would steal its ptrace
// stops). A Tracee's fields are touched only on the Tracer's thread; Pid, Regs, WasStopped
// and InSyscall read values fixed at Seize.
//
// # Preconditions
//
//   - The caller has CAP_SYS_PTRACE over the process (root), and CAP_CHECKPOINT_RESTORE is
//     held by the *tracee* for clone3 set_tid (in the owner of its PID namespace).
//   - The process is single-threaded (checked once it is stopped: ErrMultiThreaded), runs
//     64-bit code (ErrNot64Bit), and nobody else traces it.
//   - It is not a vfork child (it would share the parent's memory) and not inside an rseq
//     critical section that needs an abort (glibc 2.36 and CPython have none): the kernel
//     may clear rseq_cs when the injected rip is outside the section.
//   - Injected syscalls run with the tracee's credentials (capabilities: a sandbox keeps
//     CAP_SYS_ADMIN for setns and set_tid) but not its seccomp filter: tracees are seized
//     with PTRACE_O_SUSPEND_SECCOMP, which needs the caller to have CAP_SYS_ADMIN in the
//     initial user namespace and no filter of its own.
//   - An injected syscall that blocks (open of a FIFO, a read) blocks the Tracer's thread
//     and all its tracees until it returns. Seize waits up to 10 ms for a process in
//     uninterruptible sleep (a vfork parent, for instance) and then returns
//     ErrUninterruptible; one that enters it just after that check delays Seize until it
//     leaves it.
//
// # How one syscall is injected
//
// Registers are the saved ones with rax = nr, the arguments in rdi rsi rdx r10 r8 r9,
// rip = a syscall instruction, and orig_rax = -1. The tracee is single-stepped: the step
// trap is forced at syscall exit (a SIGTRAP signal-delivery-stop, taken before any other
// signal because synchronous signals are dequeued first), so it is the stop whose rip is
// just past the instruction. rax is then the result; -errno comes back as a unix.Errno.
// A result of -ERESTARTSYS, -ERESTARTNOINTR, -ERESTARTNOHAND or -ERESTART_RESTARTBLOCK
// means a signal interrupted the injected call: the call is injected again.
//
// Syscall restart. A tracee interrupted in a blocking syscall is seized with
// orig_rax = that syscall and rax = -ERESTART*; the kernel's restart logic runs when a
// ptrace-stop in the signal path returns, and looks at orig_rax and rax. Injecting with
// orig_rax = -1 keeps it away from the injected calls; putting the saved registers back
// unchanged before the tracee leaves its last stop makes it restart the original call
// exactly (read, ppoll and nanosleep through restart_syscall are tested; the nanosleep
// still ends at its original deadline). Calls that may overwrite the restart block
// (nanosleep, clock_nanosleep, poll, futex, restart_syscall) are refused, like those
// Restore cannot follow (the fork family: use Clone3; execve; exit; rt_sigreturn).
//
// The syscall instruction: while the tracee is stopped in a syscall, rip-2 holds one
// (checked: 0f 05). In user code it does not; any executable 0f 05 byte pair is a syscall
// instruction when jumped to (the step trap comes before the bytes after it run), so the
// vDSO is searched (its clock_gettime fallbacks contain syscall instructions), then libc's
// text, then other executable mappings. The address is cached per Tracee and inherited by
// clone3 children (same address space); UseSyscallAddr takes a remembered one.
//
// Memory for arguments: below the red zone of the saved rsp (rsp-128 and down, at most
// 64 KiB) when rsp is on the main stack, where nothing live is kept; the original bytes are
// saved first and written back by Restore. process_vm_readv/writev are used (they respect
// page protections, unlike PTRACE_POKEDATA, the fallback where they are not permitted).
// Remote access does not grow a stack VMA (Linux 6.5+), and a thread or sigaltstack may
// have live data below it, so elsewhere an anonymous mapping is injected (mmap) and
// removed (munmap) by Restore.
//
// Registers suffice: a syscall changes only rax, rcx and r11 of the user state, and the
// FPU/SSE/AVX state is not touched by syscalls (tested: PTRACE_GETFPREGS is identical).
//
// # Batches: several syscalls in one round trip
//
// Each injected call is a round trip between the tracer's thread and the tracee, two
// cross-CPU wake-ups on these VMs (an idle vCPU halts at once). A Batch (batch_linux_amd64.go)
// compiles a list of calls into a small program (per call: load the argument registers,
// one of them possibly an earlier call's result, syscall, store rax in a result slot on
// the scratch stack, jump to a trap on -4095..-1), writes it over the first page of the
// tracee's vDSO through /proc/PID/mem (FOLL_FORCE, as a debugger writes a breakpoint: the
// tracee gets a private copy of the page), sets rip to it and resumes the tracee once,
// with PTRACE_CONT, until its int3; the page's bytes are put back at once. Signals that
// arrive meanwhile are held as above; a call they interrupt is restarted by the kernel
// itself (the program is real code, rip-2 is its syscall instruction); a failing call
// ends the batch there, and descriptors it opened for a later Close are closed. The vDSO
// and not libc's text: a private page gives its mapping an anon_vma, and fork copies the
// page tables of such mappings instead of leaving them to faults (2 PTEs for the vDSO).
// A revive's 16 calls took 0.75-1.05 ms one by one in the daemon and take one batch of
// 0.25-0.3 ms, most of it the forked child's first run.
//
// # Signals and job control
//
// A signal-delivery-stop while injecting means the tracee dequeued a signal meant for its
// own code. It is taken (the tracee resumed with signal 0) and its siginfo kept; Restore
// re-queues every such signal in arrival order, with its original siginfo: it blocks all
// signals with PTRACE_SETSIGMASK, injects rt_tgsigqueueinfo(self, self, sig, &info) for
// each (a process may queue any si_code to itself), removes the arena if any, and puts the
// tracee's mask back with PTRACE_SETSIGMASK after that last injection. Blocking matters: a
// re-queued deliverable signal would be dequeued again by the next injected instruction.
// After Detach each is delivered exactly once (tested with a kill() SIGUSR1, sender pid and
// si_code kept, and two queued real-time signals, values kept, in order). SIGSTOP cannot be
// blocked: it is re-sent with kill() after the last injection (dropped if a SIGCONT came
// after it). Signals the injected call raised against the tracee itself (SIGSYS of
// seccomp, SIGPIPE, SIGXFSZ) are dropped.
//
// Group stops: a tracee seized in a group stop is not sent SIGCONT. The interrupt trap
// carries the stop signal (WasStopped); resuming it for a step runs it while the group stop
// stays in effect at the signal level (at most one extra PTRACE_EVENT_STOP is reported and
// ignored), and PTRACE_DETACH puts it back into the stop. DetachStopped leaves any tracee
// in a SIGSTOP group stop: SIGSTOP is queued with kill() before PTRACE_DETACH, whose
// signal argument is ignored outside a signal-delivery-stop. A template is not detached:
// KeepStopped holds it in its ptrace-stop, which SIGCONT does not end (a group stop it
// would), with SIGSTOP queued, so that a detach, or the tracer thread's exit when the
// daemon dies, leaves it in a group stop before it runs an instruction of its own.
//
// # Failures
//
// An injected syscall's failure is an errno and changes nothing else. A failure to drive
// the tracee (ptrace error, unexpected stop, death) is a *TraceeError: the tracee was then
// restored and is still attached, or it could not be and this package killed it (Killed),
// or it died on its own (Exited); never half-modified. PTRACE_O_EXITKILL is set only while
// the tracee differs from its saved state (registers, scratch memory, held signals): a
// daemon crash then kills it instead of letting it run half-modified, while a crash with
// clean tracees merely detaches them (sandbox processes must not die with the daemon).
//
// # Traps (each one cost a failure first)
//
//  1. clone3 refuses a non-zero exit_signal with CLONE_PARENT (EINVAL); the child inherits
//     the caller's. CloneArgs says so and Clone3 checks it.
//  2. A failed injected syscall must not leak into the tracee: its errno came back into
//     python's read() and python exited. Results are checked by the caller before Detach,
//     and rax is restored regardless.
//  3. PTRACE_DETACH's signal argument is ignored unless the tracee is in a
//     signal-delivery-stop: DetachStopped queues SIGSTOP with kill() first.
//  4. A seized process in a group stop reports PTRACE_EVENT_STOP again when resumed; job
//     control must not be lost either way (see above; no SIGCONT is sent).
//  5. rip-2 is a syscall instruction only while the process is blocked in a syscall.
//  6. PTRACE_INTERRUPT may catch a process leaving a completed syscall (orig_rax = write,
//     rax = its result): InSyscall is true, rax is not -ERESTART*, nothing is restarted.
//  7. Remote reads and writes below the stack VMA fail with EFAULT (GUP no longer grows
//     stacks); the scratch allocator falls back to an injected mapping.
//  8. Re-queueing a taken signal while it is deliverable makes the next injected step take
//     it again, forever: signals are blocked (PTRACE_SETSIGMASK) for the re-queue.
//
// # Measured costs
//
// On the target machine kind (2 vCPUs shared with other work, load average 0.5-2.8 during
// the runs), medians of 30 runs against a 13 MB python3 blocked in read (TestCosts,
// TestTemplateSetTID log them):
//
//	one injected syscall                         18-30 us  (SETREGS, single-step, wait,
//	                                                        GETREGS: two cross-CPU wake-ups)
//	10 syscalls (open, lseek, dup3, close x2,    0.22-0.30 ms
//	  getpid x2, getitimer, prctl, chdir), one Do
//	one call from another goroutine              +2-30 us of hand-off to the thread
//	Seize + Detach, nothing injected             0.09-0.16 ms (two /proc/PID/stat reads)
//	clone3 of the python                         0.35-0.65 ms (the probe saw 0.46 ms)
//	Seize + clone3 + detach parent and child     0.54-1.1 ms
//	restore: Seize the SIGSTOPped template,      0.6-1.4 ms (up to 4 ms under load)
//	  clone3 with set_tid, detach both
//
// Killing and reaping the live python before such a restore (so that its pid is free for
// set_tid) took another 0.8-2.5 ms in the test: the exit's teardown, outside this package.
// Batches (above) are that parasite, in its smallest form: no code stays in the tracee.
package remote
