package fastpath

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"deltabox/internal/procfs"
)

// Memory that fork does not copy. A mapping marked MADV_DONTFORK (VM_DONTCOPY, "dc" in
// /proc/PID/smaps VmFlags; the kernel also sets it on some device mappings) is not in the
// child at all: a restored process touching it dies of SIGSEGV. One marked
// MADV_WIPEONFORK (VM_WIPEONFORK, "wf") is in the child empty: a restored process reads
// zeros where the checkpoint held data. Either refuses the checkpoint, naming the
// mapping; nothing is carried (MADV_DOFORK around the fork would copy memory that its
// owner asked never to be shared with a child: RDMA buffers, random-number state).
//
// The flags are shown only by smaps, which walks every page table: 1.5 ms for a 63 MB
// python on these VMs, too much for every checkpoint. So the template is compared with
// its process right after the fork, before either runs: fork copies every mapping and
// every anonymous page but those, so two reads of /proc/PID/statm (a few microseconds)
// show a difference exactly when there is one: fewer pages mapped (total_vm: a
// "dc" mapping) or fewer anonymous pages resident (resident - shared: a "wf" mapping
// that held data, or a "dc" one). A "wf" mapping the process never touched reads as zeros
// in both, and is no difference. Only then is smaps read, for the mapping's name. The
// counts are exact sums on this kernel (a one-page difference is seen:
// TestForkCopyFindsDontforkAndWipeonfork).
//
// Memory marked droppable as well (VM_DROPPABLE, "dp": the kernel may free its pages at
// any time, as for the vDSO getrandom state of glibc 2.41+, which is also "wf") holds
// nothing a process may count on, and is not refused.

// statm returns the pages mapped and the anonymous pages resident of hostPid
// (/proc/PID/statm: size resident shared ...; anonymous = resident - shared).
func statm(hostPid int) (size, anon uint64, err error) {
	st, err := procfs.ReadStatm(hostPid)
	if err != nil {
		return 0, 0, err
	}
	return st.Size, st.Resident - st.Shared, nil
}

// checkForkCopy compares the template tmplHost, just forked from p (host PIDs; neither
// has run since), with p, and returns an *Ineligible naming what the template lacks.
// Precondition: right after the clone3, before anything is injected into either.
func checkForkCopy(p *Proc, tmplHost int) error {
	ls, la, err := statm(p.HostPid)
	if err != nil {
		return fmt.Errorf("process %d: %w", p.Pid, err)
	}
	ts, ta, err := statm(tmplHost)
	if err != nil {
		return fmt.Errorf("the template of process %d: %w", p.Pid, err)
	}
	if ls == ts && la == ta {
		return nil
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps", p.HostPid))
	if err != nil {
		return fmt.Errorf("process %d: %w", p.Pid, err)
	}
	for _, v := range parseSmaps(b) {
		name := v.path
		if name == "" {
			name = "anonymous"
		}
		switch {
		case v.flags["dc"]:
			return &Ineligible{Pid: p.Pid, Reason: fmt.Sprintf("its memory %x-%x (%s) is marked MADV_DONTFORK (VmFlags dc), which fork does not copy: a restored process would lack it", v.start, v.end, name)}
		case v.flags["wf"] && !v.flags["dp"]:
			return &Ineligible{Pid: p.Pid, Reason: fmt.Sprintf("its memory %x-%x (%s) is marked MADV_WIPEONFORK (VmFlags wf), which fork gives back zero-filled: a restored process would not see the checkpoint's contents", v.start, v.end, name)}
		}
	}
	if ls != ts {
		return &Ineligible{Pid: p.Pid, Reason: fmt.Sprintf("its template did not get all its memory (%d pages mapped, the template %d), and smaps names no MADV_DONTFORK mapping", ls, ts)}
	}
	// Fewer anonymous pages and no "wf" mapping but droppable ones: the template's
	// page walk says whether it lacks anything but those (counters that are not exact
	// sums, on other kernels, would differ for nothing).
	tb, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps", tmplHost))
	if err != nil {
		return fmt.Errorf("the template of process %d: %w", p.Pid, err)
	}
	if lk, tk := anonKB(parseSmaps(b)), anonKB(parseSmaps(tb)); lk != tk {
		return &Ineligible{Pid: p.Pid, Reason: fmt.Sprintf("its template did not get all its memory (%d kB anonymous, the template %d kB), and smaps names no MADV_WIPEONFORK mapping", lk, tk)}
	}
	return nil
}

// anonKB sums the anonymous memory of vmas but the droppable ones.
func anonKB(vmas []smapsVMA) uint64 {
	var n uint64
	for _, v := range vmas {
		if !v.flags["dp"] {
			n += v.anonKB
		}
	}
	return n
}

// smapsVMA is one mapping of /proc/PID/smaps with its VmFlags.
type smapsVMA struct {
	mapsLine
	flags  map[string]bool
	anonKB uint64 // "Anonymous:"
}

// parseSmaps parses /proc/PID/smaps: each mapping's maps line and its VmFlags.
func parseSmaps(b []byte) []smapsVMA {
	var out []smapsVMA
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) == 0 {
			continue
		}
		if f[0] == "VmFlags:" {
			if len(out) > 0 {
				for _, fl := range f[1:] {
					out[len(out)-1].flags[fl] = true
				}
			}
			continue
		}
		if f[0] == "Anonymous:" && len(f) >= 2 && len(out) > 0 {
			out[len(out)-1].anonKB, _ = strconv.ParseUint(f[1], 10, 64)
			continue
		}
		if strings.HasSuffix(f[0], ":") || !strings.Contains(f[0], "-") {
			continue
		}
		if m := parseMaps([]byte(l)); len(m) == 1 {
			out = append(out, smapsVMA{mapsLine: m[0], flags: map[string]bool{}})
		}
	}
	return out
}
