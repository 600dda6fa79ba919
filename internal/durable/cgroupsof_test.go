package durable

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// Test helpers: what the tests read of a process's cgroups (the daemon joins cgroups,
// joinCgroups, and never lists them).

// CgroupsOf lists the cgroup directories (host paths, v1 and v2) that pid is in, for
// Sandbox.Cgroups.
func CgroupsOf(pid int) ([]string, error) {
	mounts, err := cgroupMounts()
	if err != nil {
		return nil, err
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return nil, fmt.Errorf("the cgroups of pid %d: %w", pid, err)
	}
	var dirs []string
	for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		// ID:CONTROLLERS:PATH, CONTROLLERS empty for cgroup2.
		f := strings.SplitN(l, ":", 3)
		if len(f) != 3 {
			continue
		}
		root, ok := mounts[f[1]]
		if !ok {
			return nil, fmt.Errorf("no mount of the cgroup hierarchy %q (pid %d is in %s)", f[1], pid, f[2])
		}
		dirs = append(dirs, filepath.Join(root, f[2]))
	}
	return dirs, nil
}

// cgroupMounts maps each hierarchy, by its controllers as /proc/PID/cgroup names them
// ("" for cgroup2, "name=systemd", "cpu"...), to where it is mounted here.
func cgroupMounts() (map[string]string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	m := map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		i := slices.Index(fs, "-")
		if i < 5 || i+3 >= len(fs) {
			continue
		}
		mp := unescapeMount(fs[4])
		switch fs[i+1] {
		case "cgroup2":
			if _, ok := m[""]; !ok {
				m[""] = mp
			}
		case "cgroup":
			var ctls []string
			for _, o := range strings.Split(fs[i+3], ",") {
				if o != "rw" && o != "ro" && !strings.HasPrefix(o, "release_agent") && o != "clone_children" &&
					o != "noprefix" && o != "xattr" && o != "cpuset_v2_mode" {
					ctls = append(ctls, o)
				}
			}
			if k := strings.Join(ctls, ","); k != "" {
				if _, ok := m[k]; !ok {
					m[k] = mp
				}
			}
		}
	}
	return m, sc.Err()
}
