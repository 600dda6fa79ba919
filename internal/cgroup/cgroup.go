// Package cgroup manages a sandbox's cgroups. One cgroup2 directory (Group): init is
// cloned into it (CLONE_INTO_CGROUP, Open), so every process of the sandbox starts
// there; its cgroup.procs gives their host PIDs (Pids, an index the fast path checks
// against the sandbox's PID namespace), and its cgroup.kill ends them all when the
// sandbox goes (Destroy; the daemon's start-up destroys every group no adopted sandbox
// owns). And one directory per v1 controller (v1.go), which hold the limits. On this
// machine kind cgroup2 is mounted at /sys/fs/cgroup/unified with no controllers: memory,
// pids and cpu are v1 hierarchies. Membership is not the list of the sandbox's
// processes: a process can move out of the directory (through a cgroup2 mount of its
// own), not out of its PID namespace, so that is what lists them (sandbox.Sandbox.Procs).
package cgroup

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Root is where this daemon's sandbox cgroups live (see SetRootFor).
var Root = "/sys/fs/cgroup/unified/deltabox"

// SetRootFor gives each store its own cgroup directory, so that a daemon on a test
// store never kills the sandboxes of the daemon on the main store at its startup sweep.
func SetRootFor(storeRoot, defaultStore string) {
	if filepath.Clean(storeRoot) == filepath.Clean(defaultStore) {
		return
	}
	Root = RootFor(storeRoot)
}

// RootFor is the cgroup directory of a store other than the default one.
func RootFor(storeRoot string) string {
	h := sha256.Sum256([]byte(filepath.Clean(storeRoot)))
	return "/sys/fs/cgroup/unified/deltabox-" + hex.EncodeToString(h[:4])
}

// RemoveRoot removes this daemon's (empty) cgroup directories at shutdown (the v1
// parents too).
func RemoveRoot() {
	unix.Rmdir(Root)
	removeV1Roots()
}

// Group is one sandbox's cgroup.
type Group struct{ Path string }

// Create makes (or reuses) the cgroup for id.
func Create(id string) (*Group, error) {
	if _, err := os.Stat(filepath.Dir(Root) + "/cgroup.controllers"); err != nil {
		return nil, fmt.Errorf("cgroup2 is not mounted at %s: mount it (mount -t cgroup2 none %s) or run scripts/setup.sh", filepath.Dir(Root), filepath.Dir(Root))
	}
	p := filepath.Join(Root, id)
	if err := os.MkdirAll(p, 0o755); err != nil {
		return nil, fmt.Errorf("create cgroup: %w", err)
	}
	return &Group{Path: p}, nil
}

// Open returns an O_PATH fd of the directory, for clone3's CLONE_INTO_CGROUP.
func (g *Group) Open() (int, error) {
	return unix.Open(g.Path, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
}

// Pids lists the processes in the group (host PIDs). It reads cgroup.procs with raw
// open/read/close: checkpoints and restores call it on their critical path, and
// os.ReadFile makes 9 syscalls for a kernfs file (the runtime poller registers it),
// each 10-50 us on a vCPU that was idle a moment before.
func (g *Group) Pids() ([]int, error) {
	p := g.Path + "/cgroup.procs"
	fd, err := unix.Open(p, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: p, Err: err}
	}
	defer unix.Close(fd)
	var b []byte
	buf := make([]byte, 8192) // a sandbox with ~1000 processes (templates) in one read
	for {
		n, err := unix.Read(fd, buf)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return nil, &os.PathError{Op: "read", Path: p, Err: err}
		}
		if n <= 0 {
			break
		}
		b = append(b, buf[:n]...)
	}
	var out []int
	for _, f := range strings.Fields(string(b)) {
		pid, err := strconv.Atoi(f)
		if err != nil {
			return nil, fmt.Errorf("%s: bad pid %q", p, f)
		}
		out = append(out, pid)
	}
	return out, nil
}

func (g *Group) populated() bool {
	b, err := os.ReadFile(filepath.Join(g.Path, "cgroup.events"))
	if err != nil {
		return false
	}
	return bytes.Contains(b, []byte("populated 1"))
}

// Destroy kills every process in the group, waits for them to go, and removes it.
func (g *Group) Destroy(timeout time.Duration) error {
	if _, err := os.Stat(g.Path); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err := os.WriteFile(filepath.Join(g.Path, "cgroup.kill"), []byte("1"), 0); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("cgroup.kill: %w", err)
	}
	deadline := time.Now().Add(timeout)
	for g.populated() {
		if time.Now().After(deadline) {
			return fmt.Errorf("cgroup %s still has processes after %v", g.Path, timeout)
		}
		time.Sleep(2 * time.Millisecond)
	}
	// Children first: groups a process of the sandbox made in its cgroup namespace.
	for _, sub := range subtree(g.Path) {
		for {
			err := unix.Rmdir(sub)
			if err == nil || errors.Is(err, unix.ENOENT) {
				break
			}
			if !errors.Is(err, unix.EBUSY) || time.Now().After(deadline) {
				return fmt.Errorf("remove cgroup %s: %w", sub, err)
			}
			time.Sleep(2 * time.Millisecond)
		}
	}
	return nil
}

// Freeze stops every process of the group (cgroup.freeze: each stops at its next return
// to user space; a fatal signal still ends a frozen one, so Destroy works after it).
func (g *Group) Freeze() error {
	return os.WriteFile(filepath.Join(g.Path, "cgroup.freeze"), []byte("1"), 0)
}

// Thaw lets the group's processes run again (cgroup.freeze 0).
func (g *Group) Thaw() error {
	return os.WriteFile(filepath.Join(g.Path, "cgroup.freeze"), []byte("0"), 0)
}

// List returns the ids of existing sandbox cgroups (for the startup sweep).
func List() []string {
	ents, _ := os.ReadDir(Root)
	var out []string
	for _, e := range ents {
		if e.IsDir() {
			out = append(out, e.Name())
		}
	}
	return out
}

// Add moves process pid (a host PID, all its threads) into the group.
func (g *Group) Add(pid int) error {
	return writeFile(filepath.Join(g.Path, "cgroup.procs"), strconv.Itoa(pid))
}
