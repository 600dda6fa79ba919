package fastpath

import (
	"os"

	"golang.org/x/sys/unix"
)

// readProc reads the /proc file path into buf (grown if it fills up) and returns what it
// read. A checkpoint reads several /proc files per process and one per fd: os.ReadFile's
// *os.File (registration with the runtime poller, which /proc files refuse, fstat for a
// size they do not report) made those reads 60% of inspect's time (BenchmarkInspect); a
// bare open, read and close cost half as much.
func readProc(path string, buf []byte) ([]byte, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	defer unix.Close(fd)
	if buf == nil {
		buf = make([]byte, 4096)
	}
	n := 0
	for {
		if n == len(buf) {
			buf = append(buf, make([]byte, len(buf))...)
		}
		r, err := unix.Read(fd, buf[n:])
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return nil, &os.PathError{Op: "read", Path: path, Err: err}
		}
		if r == 0 {
			return buf[:n], nil
		}
		n += r
	}
}
