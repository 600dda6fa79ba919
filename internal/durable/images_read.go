package durable

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	criucore "github.com/checkpoint-restore/go-criu/v7/crit/images/criu-core"
	"google.golang.org/protobuf/proto"
)

// Readers of CRIU's images, framed as images.go says. (Not go-criu's crit package: it
// cannot be linked beside go-criu's stats package, unixsk.go says why.)

// readImageFile reads the entries of a CRIU image without a head (files.img, fdinfo-N.img).
func readImageFile(path string, magic uint32) ([][]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer func() { _ = f.Close() }() // read-only, after the read
	r := bufio.NewReader(f)
	var m [2]uint32
	if err := binary.Read(r, binary.LittleEndian, &m); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if m[0] != imgCommonMagic || m[1] != magic {
		return nil, fmt.Errorf("%s: magic %#x %#x, want %#x %#x", path, m[0], m[1], imgCommonMagic, magic)
	}
	var out [][]byte
	for {
		var n uint32
		if err := binary.Read(r, binary.LittleEndian, &n); err != nil {
			if errors.Is(err, io.EOF) {
				return out, nil
			}
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		b := make([]byte, n)
		if _, err := io.ReadFull(r, b); err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		out = append(out, b)
	}
}

// readCore reads the core image at path (core-PID.img): one entry, the task's (nil
// TaskCoreEntry for a thread's) and its thread's.
func readCore(path string) (*criucore.CoreEntry, error) {
	ents, err := readImageFile(path, coreMagic)
	if err != nil {
		return nil, err
	}
	if len(ents) != 1 {
		return nil, fmt.Errorf("%s: %d entries, want one", path, len(ents))
	}
	var c criucore.CoreEntry
	if err := proto.Unmarshal(ents[0], &c); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return &c, nil
}

// ImageMaxPid is the largest PID or thread ID (in the sandbox) of the image in dir:
// CRIU writes one core-ID.img per thread, so a tree's threads, which its restore gives
// back their IDs too (clone3 set_tid), count; 0 if it holds none.
func ImageMaxPid(dir string) int {
	ents, _ := os.ReadDir(dir)
	n := 0
	for _, e := range ents {
		s, ok := strings.CutPrefix(e.Name(), "core-")
		if !ok {
			continue
		}
		if id, err := strconv.Atoi(strings.TrimSuffix(s, ".img")); err == nil {
			n = max(n, id)
		}
	}
	return n
}
