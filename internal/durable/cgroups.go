package durable

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
)

// joinCgroups writes pid into each directory's cgroup.procs.
func joinCgroups(pid int, dirs []string) error {
	for _, d := range dirs {
		if err := os.WriteFile(filepath.Join(d, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0); err != nil {
			return fmt.Errorf("move CRIU (pid %d) into the sandbox's cgroup %s: %w", pid, d, err)
		}
	}
	return nil
}
