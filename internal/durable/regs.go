package durable

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	criucore "github.com/checkpoint-restore/go-criu/v7/crit/images/criu-core"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
)

// Regs are the general registers of an image's task that show whether it ran between
// two moments: its instruction and stack pointers and the callee-saved registers (a
// syscall restart changes ax and ip by the restart's rules only when the task runs on).
type Regs struct {
	IP, SP, BP, BX, R12, R13, R14, R15 uint64
}

// taskStopped is CRIU's TASK_STOPPED (criu/include/pstree.h; images/core.proto's
// task_state): the task was in a group stop when CRIU seized it, and its restore leaves
// it there.
const taskStopped = 3

// CheckCopyImage says whether the image in dir is of a stopped copy that never ran since
// it was left with regs (fastpath.CopyTemplate), that is of its template: a SIGCONT from
// the sandbox ends the copy's group stop. Two checks, as each misses what the other
// sees: the registers show a copy that ran on; the task state shows one that was
// continued but had not run yet when CRIU seized it (it was woken in the kernel, so its
// registers are still the ones it was left with), which CRIU then dumps as running
// and restores running, and which no template can be made of (fastpath.AdoptStopped
// refuses a process that is not stopped).
func CheckCopyImage(dir string, regs unix.PtraceRegs) error {
	got, state, err := imageTask(dir)
	if err != nil {
		return err
	}
	want := Regs{IP: regs.Rip, SP: regs.Rsp, BP: regs.Rbp, BX: regs.Rbx, R12: regs.R12, R13: regs.R13, R14: regs.R14, R15: regs.R15}
	if int64(regs.Orig_rax) != -1 && got.IP == want.IP-2 {
		// Seized in a blocking syscall: its detach set it to restart the syscall
		// (remote.Tracee.Detach), one 2-byte instruction back.
		want.IP = got.IP
	}
	if got != want {
		return errors.New("its copy ran before its dump (a SIGCONT from the sandbox?): the image is not the template's")
	}
	if state != taskStopped {
		return fmt.Errorf("its copy was not stopped when CRIU took it (task state %d; a SIGCONT from the sandbox?): its restore would not be a template", state)
	}
	return nil
}

// imageTask reads the registers and the task state of the image's single task.
func imageTask(dir string) (Regs, uint32, error) {
	cores, err := filepath.Glob(filepath.Join(dir, "core-*.img"))
	if err != nil || len(cores) != 1 {
		return Regs{}, 0, fmt.Errorf("%s: %d core images, want 1 (%v)", dir, len(cores), err)
	}
	f, err := os.Open(cores[0])
	if err != nil {
		return Regs{}, 0, err
	}
	defer func() { _ = f.Close() }() // read-only, after the read
	r := bufio.NewReader(f)
	var magic [2]uint32
	if err := binary.Read(r, binary.LittleEndian, &magic); err != nil || magic[0] != imgCommonMagic {
		return Regs{}, 0, fmt.Errorf("%s: not a CRIU image (%v)", cores[0], err)
	}
	var n uint32
	if err := binary.Read(r, binary.LittleEndian, &n); err != nil {
		return Regs{}, 0, fmt.Errorf("%s: %w", cores[0], err)
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(r, b); err != nil {
		return Regs{}, 0, fmt.Errorf("%s: %w", cores[0], err)
	}
	var c criucore.CoreEntry
	if err := proto.Unmarshal(b, &c); err != nil {
		return Regs{}, 0, fmt.Errorf("%s: %w", cores[0], err)
	}
	g := c.GetThreadInfo().GetGpregs()
	if g == nil {
		return Regs{}, 0, fmt.Errorf("%s: no x86 registers", cores[0])
	}
	return Regs{IP: g.GetIp(), SP: g.GetSp(), BP: g.GetBp(), BX: g.GetBx(), R12: g.GetR12(), R13: g.GetR13(), R14: g.GetR14(), R15: g.GetR15()},
		c.GetTc().GetTaskState(), nil
}
