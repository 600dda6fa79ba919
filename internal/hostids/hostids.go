// Package hostids hands out sandboxes' host id ranges across every daemon of a host.
//
// A sandbox's user namespace maps its ids onto a range of host ids of its own (package
// state: ids.go), and the range is what keeps sandboxes apart where the kernel compares
// ids (signals, ptrace, /proc, files) and what the kernel charges the sandbox's
// per-user budgets to (the namespace's owner). Ranges picked per daemon collided: two
// daemons on one host (tests start many) gave their first sandboxes the same range,
// and then one sandbox's root owned the other's processes. So the host keeps one
// record of the ranges taken, shared by every daemon:
//
//	DIR/.lock     flock(2)ed while a daemon reads or changes the records
//	DIR/<base>    one file per range taken, named by its first id, holding its Holder
//
// A record outlives the daemon that wrote it (sandboxes outlive their daemon), and is
// released when its sandbox is removed. One whose sandbox is gone without that (the
// daemon died between, the store was deleted) is stale: its Holder's Dir, the
// sandbox's directory in its store, which exists from before the claim until after the
// sandbox is removed, no longer exists, and the next claim takes the range over. A
// record is written whole (a temporary file renamed into place) under the lock, so a
// crash leaves either the old record or the new one.
package hostids

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
)

// DefaultDir is where the host's records live: beside the daemons' sockets, the same
// for every daemon whatever its store.
const DefaultDir = "/run/deltabox/ids"

// lockTimeout bounds the wait for another daemon's claim or release (each holds the
// lock for a directory read and a few small files: milliseconds).
const lockTimeout = 10 * time.Second

// Holder is who holds a range.
type Holder struct {
	Store   string `json:"store"`   // the daemon's store root
	Sandbox string `json:"sandbox"` // the sandbox's id in it
	// Dir exists as long as the sandbox does (its directory in the store): the record
	// is stale once it is gone.
	Dir string `json:"dir"`
}

// Ranges are the ranges a registry hands out: First + k*Size for k in [0, Count).
type Ranges struct {
	First, Size, Count uint32
}

// Registry is the host's record of taken ranges in one directory.
type Registry struct {
	dir    string
	ranges Ranges
}

// Open opens (creating it, 0700) the registry in dir.
func Open(dir string, r Ranges) (*Registry, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("the host's record of sandbox id ranges: %w", err)
	}
	return &Registry{dir: dir, ranges: r}, nil
}

// ErrTaken: the range asked for is another live sandbox's.
var ErrTaken = errors.New("the id range is another sandbox's")

// ErrFull: every range is taken.
var ErrFull = errors.New("every id range of the host is taken")

// Claim records that h holds a range and returns its first id: want if it is not 0
// (an error wrapping ErrTaken when another live holder has it), or else the lowest
// range that is free or stale (ErrFull when none is). Claiming again what h already
// holds is a no-op.
func (r *Registry) Claim(h Holder, want uint32) (uint32, error) {
	if want != 0 && !r.valid(want) {
		return 0, fmt.Errorf("id base %d is not one of the host's ranges (%d + k*%d, k < %d)", want, r.ranges.First, r.ranges.Size, r.ranges.Count)
	}
	unlock, err := r.lock()
	if err != nil {
		return 0, err
	}
	defer unlock()
	try := func(base uint32) (bool, error) {
		cur, ok, err := r.read(base)
		if err != nil {
			return false, err
		}
		if ok && cur != h && live(cur) {
			return false, nil
		}
		if ok && cur == h {
			return true, nil
		}
		return true, r.write(base, h)
	}
	if want != 0 {
		ok, err := try(want)
		if err == nil && !ok {
			cur, _, _ := r.read(want)
			err = fmt.Errorf("id base %d is held by sandbox %s of the store %s: %w", want, cur.Sandbox, cur.Store, ErrTaken)
		}
		if err != nil {
			return 0, err
		}
		return want, nil
	}
	for k := uint32(0); k < r.ranges.Count; k++ {
		base := r.ranges.First + k*r.ranges.Size
		ok, err := try(base)
		if err != nil {
			return 0, err
		}
		if ok {
			return base, nil
		}
	}
	return 0, fmt.Errorf("%w (%d, recorded in %s): remove sandboxes", ErrFull, r.ranges.Count, r.dir)
}

// Release removes h's record of base, if the record is still h's (a stale record taken
// over by another holder stays).
func (r *Registry) Release(h Holder, base uint32) error {
	unlock, err := r.lock()
	if err != nil {
		return err
	}
	defer unlock()
	cur, ok, err := r.read(base)
	if err != nil || !ok || cur != h {
		return err
	}
	if err := os.Remove(r.path(base)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("release id base %d: %w", base, err)
	}
	return nil
}

// Holder returns who holds base (false when nobody does, stale records included).
func (r *Registry) Holder(base uint32) (Holder, bool, error) {
	h, ok, err := r.read(base)
	return h, ok && live(h), err
}

func (r *Registry) valid(base uint32) bool {
	return base >= r.ranges.First && (base-r.ranges.First)%r.ranges.Size == 0 && (base-r.ranges.First)/r.ranges.Size < r.ranges.Count
}

func (r *Registry) path(base uint32) string {
	return filepath.Join(r.dir, strconv.FormatUint(uint64(base), 10))
}

// read returns the record of base (false: none). A record that does not parse is
// treated as stale: it names no directory that exists.
func (r *Registry) read(base uint32) (Holder, bool, error) {
	b, err := os.ReadFile(r.path(base))
	if errors.Is(err, os.ErrNotExist) {
		return Holder{}, false, nil
	}
	if err != nil {
		return Holder{}, false, fmt.Errorf("read the record of id base %d: %w", base, err)
	}
	var h Holder
	json.Unmarshal(b, &h)
	return h, true, nil
}

// write records h as base's holder: a temporary file renamed over the record.
func (r *Registry) write(base uint32, h Holder) error {
	b, _ := json.Marshal(h)
	tmp := r.path(base) + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return fmt.Errorf("record id base %d: %w", base, err)
	}
	if err := os.Rename(tmp, r.path(base)); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("record id base %d: %w", base, err)
	}
	return nil
}

// live reports whether h's sandbox still exists.
func live(h Holder) bool {
	if h.Dir == "" || !filepath.IsAbs(h.Dir) {
		return false
	}
	_, err := os.Lstat(h.Dir)
	return !errors.Is(err, os.ErrNotExist)
}

// lock takes the registry's lock, waiting at most lockTimeout for another daemon.
func (r *Registry) lock() (func(), error) {
	return LockFile(filepath.Join(r.dir, ".lock"), lockTimeout, "another daemon (stuck while it allocated a sandbox's id range?)")
}

// LockFile takes an exclusive flock of path (made 0600 if absent), polling: flock(2)
// has no timeout, and a holder that hangs must not hang the waiter. It waits at most
// wait; the error then names path and holder (who is expected to hold it). unlock
// closes the fd, which drops the lock.
func LockFile(path string, wait time.Duration, holder string) (unlock func(), err error) {
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_CREAT|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", path, err)
	}
	for deadline := time.Now().Add(wait); ; {
		err := unix.Flock(fd, unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return func() { unix.Close(fd) }, nil
		}
		if err != unix.EWOULDBLOCK && err != unix.EINTR {
			unix.Close(fd)
			return nil, fmt.Errorf("lock %s: %w", path, err)
		}
		if time.Now().After(deadline) {
			unix.Close(fd)
			return nil, fmt.Errorf("%s held %s for over %v", holder, path, wait)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
