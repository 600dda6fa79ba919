package security

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// hostPidsWith returns the host PIDs of the processes whose command line contains
// marker, read from the host's /proc (the test's own view, not the daemon's).
func hostPidsWith(t *testing.T, marker string) []int {
	t.Helper()
	ents, _ := os.ReadDir("/proc")
	var out []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err == nil && strings.Contains(string(b), marker) {
			out = append(out, pid)
		}
	}
	return out
}
