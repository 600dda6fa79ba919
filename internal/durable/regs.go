package durable

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"
	"os"
	"path/filepath"

	criucore "github.com/checkpoint-restore/go-criu/v7/crit/images/criu-core"
	"google.golang.org/protobuf/proto"
)

// Regs are the general registers of an image's task that show whether it ran between
// two moments: its instruction and stack pointers and the callee-saved registers (a
// syscall restart changes ax and ip by the restart's rules only when the task runs on).
type Regs struct {
	IP, SP, BP, BX, R12, R13, R14, R15 uint64
}

// ImageRegs reads the registers CRIU recorded for the single task of the image in dir
// (core-PID.img).
func ImageRegs(dir string) (Regs, error) {
	cores, err := filepath.Glob(filepath.Join(dir, "core-*.img"))
	if err != nil || len(cores) != 1 {
		return Regs{}, fmt.Errorf("%s: %d core images, want 1 (%v)", dir, len(cores), err)
	}
	f, err := os.Open(cores[0])
	if err != nil {
		return Regs{}, err
	}
	defer f.Close()
	r := bufio.NewReader(f)
	var magic [2]uint32
	if err := binary.Read(r, binary.LittleEndian, &magic); err != nil || magic[0] != imgCommonMagic {
		return Regs{}, fmt.Errorf("%s: not a CRIU image (%v)", cores[0], err)
	}
	var n uint32
	if err := binary.Read(r, binary.LittleEndian, &n); err != nil {
		return Regs{}, fmt.Errorf("%s: %w", cores[0], err)
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(r, b); err != nil {
		return Regs{}, fmt.Errorf("%s: %w", cores[0], err)
	}
	var c criucore.CoreEntry
	if err := proto.Unmarshal(b, &c); err != nil {
		return Regs{}, fmt.Errorf("%s: %w", cores[0], err)
	}
	g := c.GetThreadInfo().GetGpregs()
	if g == nil {
		return Regs{}, fmt.Errorf("%s: no x86 registers", cores[0])
	}
	return Regs{IP: g.GetIp(), SP: g.GetSp(), BP: g.GetBp(), BX: g.GetBx(), R12: g.GetR12(), R13: g.GetR13(), R14: g.GetR14(), R15: g.GetR15()}, nil
}
