package fastpath

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"deltabox/internal/remote"
)

// Shared file mappings. fork(2) copies a MAP_SHARED mapping as the same shared mapping:
// the child's pages are the parent's, in the page cache of the same file. A live
// process and its template would share them, and since the file is the one the
// checkpoint froze (its inode was renamed into the node's layer), whatever the live
// process writes through the mapping afterwards would change a frozen layer and the
// template's memory. So after the move onto the new state (setns), the live process
// maps the file again over the same range: an open of the same path on the new stack
// with O_RDWR copies the file up into the new upper (a reflink, after the kernel wrote
// back the mapping's dirty pages), mmap(MAP_SHARED|MAP_FIXED) at the same address,
// length, protection and file offset replaces the old mapping, and the fd is closed. The
// template keeps the old mapping: it never runs, so nothing writes through it. At a
// restore the new child (which inherits the template's mapping of the frozen file) is
// remapped the same way onto the restored state: it sees the checkpoint's contents and
// writes into the restored state's upper.
//
// Which shared mappings are remapped: those that can write their file, now (PROT_WRITE)
// or after an mprotect (VM_MAYWRITE, "mw" in /proc/PID/smaps: the file was opened for
// writing; asked of the kernel by an injected mprotect, probeMayWrite). A read-only
// shared mapping of a file opened read-only can never write: it
// changes no layer and shares nothing writable with the template, and both see the frozen
// file, whose contents are the checkpoint's. What it does not see is a later write to
// that path in the new state, which copies the file up into a new inode; that is
// overlayfs's documented behaviour for any read-only shared mapping of a lower file, and
// remapping would not change it (an O_RDONLY open on the new stack resolves to the same
// frozen file): only a forced copy-up would, which would give the mapping a write
// permission it did not have, and put the file into every checkpoint's layer. So those
// are kept as they are.
//
// Refused (the process is ineligible, with the mapping named): writable shared mappings
// of anything that cannot be opened again by path on the new state: shared anonymous
// memory (MAP_SHARED|MAP_ANONYMOUS, shown as /dev/zero (deleted)), SysV shared memory,
// memfds, deleted files and devices. fork shares each of those with the template, and
// there is no file on the new state to map instead.

// Mapping is a shared file mapping that can write its file: remapped onto each state.
type Mapping struct {
	Start, End uint64
	Prot       int   // PROT_READ|PROT_WRITE|PROT_EXEC as mapped now
	Offset     int64 // in the file
	Path       string
}

func (m Mapping) String() string {
	return fmt.Sprintf("%s (%x-%x)", m.Path, m.Start, m.End)
}

// mapsLine is one line of /proc/PID/maps.
type mapsLine struct {
	start, end uint64
	perms      string
	offset     int64
	path       string // may contain spaces; " (deleted)" suffix for deleted files
	tooLong    bool   // the kernel could not report the path (PROCMAP_QUERY: ENAMETOOLONG)
}

// parseMaps parses /proc/PID/maps.
func parseMaps(b []byte) []mapsLine {
	var out []mapsLine
	for _, l := range strings.Split(string(b), "\n") {
		var f [5]string
		rest := l
		ok := true
		for i := range f {
			rest = strings.TrimLeft(rest, " ")
			j := strings.IndexByte(rest, ' ')
			if j < 0 {
				if i < 4 {
					ok = false
					break
				}
				j = len(rest)
			}
			f[i], rest = rest[:j], rest[j:]
		}
		if !ok || len(f[1]) != 4 {
			continue
		}
		lo, hi, found := strings.Cut(f[0], "-")
		if !found {
			continue
		}
		var m mapsLine
		var err1, err2, err3 error
		m.start, err1 = strconv.ParseUint(lo, 16, 64)
		m.end, err2 = strconv.ParseUint(hi, 16, 64)
		m.offset, err3 = strconv.ParseInt(f[2], 16, 64)
		if err1 != nil || err2 != nil || err3 != nil {
			continue
		}
		m.perms = f[1]
		m.path = strings.TrimLeft(rest, " ")
		out = append(out, m)
	}
	return out
}

// mayWriteFunc answers whether the read-only shared mapping [start, end) can be made
// writable (VM_MAYWRITE: its file was opened for writing).
type mayWriteFunc func(start, end uint64, prot int) (bool, error)

// probeMayWrite answers mayWriteFunc by asking the kernel in the stopped tracee t: an
// injected mprotect adding PROT_WRITE to a shared file mapping fails with EACCES exactly
// when VM_MAYWRITE is clear (mm/mprotect.c), and changes nothing then; when it succeeds
// the mapping is put back to prot at once (the same range and the flags it had, so the
// kernel merges it back into the same VMA), before the tracee runs. One injected syscall
// (two when the answer is yes) instead of the smaps walk. If the mapping cannot be put
// back, the tracee is killed: never left with a write permission it did not have.
// Precondition: inside Do, t seized and stopped since it was inspected.
func probeMayWrite(t *remote.Tracee) mayWriteFunc {
	return func(start, end uint64, prot int) (bool, error) {
		err := t.Mprotect(uintptr(start), uintptr(end-start), prot|unix.PROT_WRITE)
		if errors.Is(err, unix.EACCES) {
			return false, nil
		}
		if err != nil {
			return false, fmt.Errorf("probe the mapping %x-%x: %w", start, end, err)
		}
		if err := t.Mprotect(uintptr(start), uintptr(end-start), prot); err != nil {
			kerr := t.Kill()
			return false, errors.Join(fmt.Errorf("put the mapping %x-%x back to read-only after probing it: %w (process killed rather than left with a write permission it did not have)", start, end, err), kerr)
		}
		return true, nil
	}
}

// sharedMappings returns the shared mappings of process base (/proc/PID) that can write
// their file, or an *Ineligible naming one that cannot be remapped. mayWrite answers for
// the read-only ones; lookup and onMount tell a deleted file and a file on a mount the
// new state does not have (inspect).
func sharedMappings(base string, pid int, mayWrite mayWriteFunc, lookup lookupFunc, onMount func(what string, mnt uint64) error) ([]Mapping, error) {
	shared, err := sharedMapsLines(base)
	if err != nil {
		return nil, err
	}
	var out []Mapping
	for _, m := range shared {
		prot := 0
		if m.perms[0] == 'r' {
			prot |= unix.PROT_READ
		}
		if m.perms[1] == 'w' {
			prot |= unix.PROT_WRITE
		}
		if m.perms[2] == 'x' {
			prot |= unix.PROT_EXEC
		}
		if m.perms[1] != 'w' {
			mw, err := mayWrite(m.start, m.end, prot)
			if err != nil {
				return nil, err
			}
			if !mw {
				continue // can never write: kept (see above)
			}
		}
		what := fmt.Sprintf("a writable shared mapping (%x-%x) of %s", m.start, m.end, m.path)
		if m.tooLong {
			return nil, &Ineligible{Pid: pid, Reason: pathTooLong(fmt.Sprintf("a writable shared mapping (%x-%x)", m.start, m.end), unix.ENAMETOOLONG)}
		}
		if !strings.HasPrefix(m.path, "/") {
			return nil, &Ineligible{Pid: pid, Reason: what + ", which is not a file"}
		}
		// Deleted or not by the file itself (isDeleted); the kernel's names of shared
		// memory say what it is.
		sx, err := statxAt(fmt.Sprintf("%s/map_files/%x-%x", base, m.start, m.end))
		if err != nil {
			return nil, fmt.Errorf("stat the mapping %x-%x of process %d: %w", m.start, m.end, pid, err)
		}
		deleted, err := isDeleted(&sx, m.path, lookup)
		if err != nil {
			return nil, fmt.Errorf("process %d: the mapping %x-%x: %w", pid, m.start, m.end, err)
		}
		switch {
		case deleted && strings.HasPrefix(m.path, "/dev/zero (deleted)"):
			return nil, &Ineligible{Pid: pid, Reason: fmt.Sprintf("it has shared anonymous memory (%x-%x), which fork shares with the template and no file holds", m.start, m.end), CRIU: true}
		case deleted && strings.HasPrefix(m.path, "/SYSV"):
			return nil, &Ineligible{Pid: pid, Reason: fmt.Sprintf("it has SysV shared memory attached (%x-%x, %s), which fork shares with the template", m.start, m.end, m.path)}
		case deleted && strings.HasPrefix(m.path, "/memfd:"):
			return nil, &Ineligible{Pid: pid, Reason: what + ": a memfd, which fork shares with the template and no state holds", CRIU: true}
		case deleted:
			return nil, &Ineligible{Pid: pid, Reason: what + ": the file was deleted, so it cannot be mapped again from the new state", CRIU: true}
		case sx.Mode&unix.S_IFMT != unix.S_IFREG:
			return nil, &Ineligible{Pid: pid, Reason: what + ": not a regular file (a device?), which fork shares with the template"}
		}
		if err := onMount(what, sx.Mnt_id); err != nil {
			return nil, err
		}
		out = append(out, Mapping{Start: m.start, End: m.end, Prot: prot, Offset: m.offset, Path: m.path})
	}
	return out, nil
}

// mapCalls appends to b the calls that map path (m's file, as the tracee's current state
// has it) shared over m's range, at m's protection and offset; the mmap's result is to be
// checked with checkMaps. Precondition: after the setns onto the state.
func mapCalls(b *remote.Batch, m Mapping, path string) remote.Ref {
	fd := b.Add(fmt.Sprintf("open the mapped file %s (%s)", m, path), unix.SYS_OPENAT, unix.AT_FDCWD, path, unix.O_RDWR|unix.O_CLOEXEC, 0)
	r := b.Add(fmt.Sprintf("map %s again", m), unix.SYS_MMAP, m.Start, m.End-m.Start, m.Prot, unix.MAP_SHARED|unix.MAP_FIXED, fd, m.Offset)
	b.Close("close the mapped file", fd)
	return r
}

// checkMaps checks that each mmap of a batch (refs, for maps) mapped at the address asked.
func checkMaps(res []uintptr, refs []remote.Ref, maps []Mapping) error {
	for i, r := range refs {
		if uint64(res[r]) != maps[i].Start {
			return fmt.Errorf("map %s again: mapped at %#x", maps[i], res[r])
		}
	}
	return nil
}

// remapBack undoes move's remapping for a move that is undone: the live process maps again the
// very file it mapped before, which its template (forked before the move, never run)
// still maps, opened through the template's /proc/PID/map_files. Precondition: inside
// Do, the tracee back on the template's state; tmplPid is the template's pid as the
// tracee sees it.
func remapBack(t *remote.Tracee, maps []Mapping, tmplPid int) error {
	if len(maps) == 0 {
		return nil
	}
	var b remote.Batch
	var refs []remote.Ref
	for _, m := range maps {
		refs = append(refs, mapCalls(&b, m, fmt.Sprintf("/proc/%d/map_files/%x-%x", tmplPid, m.Start, m.End)))
	}
	res, err := t.RunBatch(&b)
	if err != nil {
		return err
	}
	return checkMaps(res, refs, maps)
}
