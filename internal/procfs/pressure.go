package procfs

import (
	"os"
	"strconv"
	"strings"
	"time"
)

// CPUStall is the kernel's total of the time a runnable task waited for a CPU, the
// "some" line's total= (microseconds) of /proc/pressure/cpu (pressure stall
// information, Documentation/accounting/psi.rst); ok is false without pressure
// accounting (CONFIG_PSI off, or psi=0 at boot).
func CPUStall() (_ time.Duration, ok bool) {
	b, err := os.ReadFile("/proc/pressure/cpu")
	if err != nil {
		return 0, false
	}
	return parseCPUStall(b)
}

func parseCPUStall(b []byte) (time.Duration, bool) {
	line, _, _ := strings.Cut(string(b), "\n")
	_, tot, found := strings.Cut(line, "total=")
	if !strings.HasPrefix(line, "some ") || !found {
		return 0, false
	}
	us, err := strconv.ParseInt(strings.TrimSpace(tot), 10, 64)
	if err != nil {
		return 0, false
	}
	return time.Duration(us) * time.Microsecond, true
}
