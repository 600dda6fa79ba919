package fastpath

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"deltabox/internal/apitypes"
	"deltabox/internal/remote"
)

// Memory is what a process costs, from /proc/PID/smaps_rollup (bytes); its doc in
// apitypes says what the figures mean for a template and its live process. The wire
// form is defined once, in apitypes.
type Memory = apitypes.Memory

// AddMemory adds o to m.
func AddMemory(m *Memory, o Memory) {
	m.Rss += o.Rss
	m.Pss += o.Pss
	m.PssAnon += o.PssAnon
	m.PrivateDirty += o.PrivateDirty
}

// ReadMemory reads hostPid's smaps_rollup (it walks the page tables: about 0.1 ms for a
// python with 50 MB of heap).
func ReadMemory(hostPid int) (Memory, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(hostPid) + "/smaps_rollup")
	if err != nil {
		return Memory{}, err
	}
	var m Memory
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) != 3 || f[2] != "kB" {
			continue
		}
		v, err := strconv.ParseInt(f[1], 10, 64)
		if err != nil {
			continue
		}
		switch f[0] {
		case "Rss:":
			m.Rss = v << 10
		case "Pss:":
			m.Pss = v << 10
		case "Pss_Anon:":
			m.PssAnon = v << 10
		case "Private_Dirty:":
			m.PrivateDirty = v << 10
		}
	}
	return m, nil
}

// Run is a range of pages [Addr, Addr+Len).
type Run struct{ Addr, Len uintptr }

const pageSize = 4096

// TouchedWritable lists the pages of hostPid's private writable mappings that are
// present or swapped (pagemap), coalesced into runs: the pages it wrote (or read from
// the zero page) and still has. For a template, they are the pages its live process is
// likely to write again after a restore, each of which costs a copy-on-write fault.
func TouchedWritable(hostPid int) ([]Run, error) {
	base := "/proc/" + strconv.Itoa(hostPid)
	maps, err := os.ReadFile(base + "/maps")
	if err != nil {
		return nil, err
	}
	pm, err := os.Open(base + "/pagemap")
	if err != nil {
		return nil, err
	}
	defer func() { _ = pm.Close() }() // read-only, after the read
	var runs []Run
	buf := make([]byte, 8*512)
	sc := bufio.NewScanner(bytes.NewReader(maps))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 5 || f[1] != "rw-p" {
			continue
		}
		if len(f) >= 6 && (f[5] == "[vvar]" || f[5] == "[vdso]" || f[5] == "[vsyscall]" || f[5] == "[vvar_vclock]") {
			continue
		}
		lo, hi, ok := strings.Cut(f[0], "-")
		if !ok {
			continue
		}
		start, err1 := strconv.ParseUint(lo, 16, 64)
		end, err2 := strconv.ParseUint(hi, 16, 64)
		if err1 != nil || err2 != nil {
			continue
		}
		var cur *Run
		for a := start; a < end; {
			n := min((end-a)/pageSize, uint64(len(buf)/8))
			got, err := pm.ReadAt(buf[:n*8], int64(a/pageSize*8))
			if err != nil && got == 0 {
				break
			}
			for i := 0; i < got/8; i++ {
				e := binary.LittleEndian.Uint64(buf[i*8:])
				addr := uintptr(a) + uintptr(i)*pageSize
				if e&(1<<63|1<<62) != 0 {
					if cur != nil && cur.Addr+cur.Len == addr {
						cur.Len += pageSize
					} else {
						runs = append(runs, Run{addr, pageSize})
						cur = &runs[len(runs)-1]
					}
				}
			}
			a += uint64(got/8) * pageSize
		}
	}
	return runs, nil
}

// ErrWarmStopped: Warm returned because stop was closed or budget said no.
var ErrWarmStopped = errors.New("warm-up stopped")

// Warm pre-faults runs of the process hostPid for writing: MADV_POPULATE_WRITE (Linux
// 5.14+; process_madvise refuses it) injected chunk bytes at a time, so that the
// copy-on-write faults its next command would take happen now. The process is seized
// for the whole warm-up (it runs none of its code meanwhile; it is meant to be idle)
// and let go when Warm returns. Between chunks Warm returns ErrWarmStopped as soon as
// stop is closed or budget() is false. It returns the bytes populated.
func Warm(tr *remote.Tracer, hostPid int, runs []Run, chunk uintptr, stop <-chan struct{}, budget func() bool) (uintptr, error) {
	if chunk < pageSize {
		chunk = pageSize
	}
	t, err := tr.Seize(hostPid)
	if err != nil {
		return 0, fmt.Errorf("seize %d: %w", hostPid, err)
	}
	var done uintptr
	for _, r := range runs {
		for off := uintptr(0); off < r.Len; off += chunk {
			select {
			case <-stop:
				err = ErrWarmStopped
			default:
				if budget != nil && !budget() {
					err = ErrWarmStopped
				}
			}
			if err == nil {
				n := min(chunk, r.Len-off)
				if err = t.Madvise(r.Addr+off, n, unix.MADV_POPULATE_WRITE); err == nil {
					done += n
				}
			}
			if err != nil {
				if derr := t.Detach(); derr != nil {
					err = errors.Join(err, derr)
				}
				return done, err
			}
		}
	}
	return done, t.Detach()
}
