package fastpath

import (
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// The kernel's own reports that tests check the fast path's faster answers against:
// code only tests use lives here, not in the daemon.

// isPtySlave reports whether the fd at path (/proc/PID/fd/N) is a pseudo-terminal slave:
// a character device of the UNIX98 pty majors (136-143, Documentation/admin-guide/devices.txt),
// or /dev/tty (5:0), which is the process's controlling terminal.
func isPtySlave(path string) bool {
	var st unix.Stat_t
	return unix.Stat(path, &st) == nil && isTerminal(st.Mode&unix.S_IFMT, unix.Major(st.Rdev), unix.Minor(st.Rdev))
}

// smapsMayWrite answers mayWriteFunc from /proc/PID/smaps ("mw" in VmFlags), read once.
// smaps walks the page tables of every mapping: 1.5 ms for a 63 MB python on these VMs,
// which is why a held process is asked with probeMayWrite instead. Tests use this one to
// check the probe against the kernel's own report.
func smapsMayWrite(base string) mayWriteFunc {
	var mw map[uint64]bool
	return func(start, _ uint64, _ int) (bool, error) {
		if mw == nil {
			b, err := os.ReadFile(base + "/smaps")
			if err != nil {
				return false, err
			}
			mw = parseSmapsMayWrite(b)
		}
		return mw[start], nil
	}
}

// parseSmapsMayWrite returns the start addresses of the mappings of an smaps text whose
// VmFlags hold "mw".
func parseSmapsMayWrite(b []byte) map[uint64]bool {
	out := map[uint64]bool{}
	var cur uint64
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) > 0 {
			if lo, _, ok := strings.Cut(f[0], "-"); ok && !strings.HasSuffix(f[0], ":") {
				if v, err := strconv.ParseUint(lo, 16, 64); err == nil {
					cur = v
				}
				continue
			}
			if f[0] == "VmFlags:" {
				for _, fl := range f[1:] {
					if fl == "mw" {
						out[cur] = true
					}
				}
			}
		}
	}
	return out
}
