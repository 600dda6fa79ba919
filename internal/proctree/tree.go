package proctree

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"

	"golang.org/x/sys/unix"

	"deltabox/internal/durable"
	"deltabox/internal/fastpath"
	"deltabox/internal/procfs"
)

// RecordFile is the name of a tree's record in its directory, beside CRIU's images.
const RecordFile = "tree.json"

// Record is what a tree's record keeps of its processes: enough for a daemon started
// after a crash to let run, by host PID and start time (never a PID alone, which may be
// another process's by then), what a dead one left stopped (ContinueCut).
type Record struct {
	Pids []int `json:"pids"` // sandbox PIDs, root first, parents before children
	// Host is each process's host PID and start time (clock ticks since boot, as
	// /proc/PID/stat gives it), in the order of Pids.
	Host [][2]uint64 `json:"host"`
	// Stopped are the processes (sandbox PIDs) that were stopped before the dump (kill
	// -STOP, ^Z): CRIU brings them back stopped, and Continue leaves them so.
	Stopped []int `json:"stopped,omitempty"`
}

// Tree is a tree of processes held by pidfds: a signal sent through one reaches the
// process it was opened on or none, even after its PID is reused. A Tree embedded in a
// record's type writes its Record fields at the record's top level.
type Tree struct {
	Record
	fds []int // pidfds, in the order of Pids
}

// Hold holds the tree rooted at host PID root by pidfds, replacing what t held, and
// records its processes in t.Record (sandbox PIDs in the PID namespace of initHost).
// A descendant that ended while the tree was listed is left out. Precondition: the tree
// is stopped, or what it forks meanwhile is not held.
func (t *Tree) Hold(root, initHost int) error {
	return t.hold(durable.Tree(root), initHost)
}

// hold is Hold on the list tree (root first).
func (t *Tree) hold(tree []int, initHost int) error {
	var fds []int
	var pids []int
	var host [][2]uint64
	fail := func(err error) error {
		for _, fd := range fds {
			_ = unix.Close(fd) // a pidfd: nothing to flush
		}
		return err
	}
	for i, h := range tree {
		fd, err := unix.PidfdOpen(h, 0)
		if err != nil {
			if i == 0 {
				return fail(fmt.Errorf("its root: %w", err))
			}
			if !fastpath.Exists(h) {
				continue // ended meanwhile
			}
			return fail(fmt.Errorf("a process of its tree: %w", err))
		}
		st, _ := procfs.StartTime(h)
		fds, pids, host = append(fds, fd), append(pids, fastpath.SandboxPid(h, initHost)), append(host, [2]uint64{uint64(h), st})
	}
	t.Close()
	t.fds, t.Pids, t.Host = fds, pids, host
	return nil
}

// Close lets go of the pidfds, sending nothing.
func (t *Tree) Close() {
	for _, fd := range t.fds {
		_ = unix.Close(fd) // a pidfd: nothing to flush
	}
	t.fds = nil
}

// Continue sends SIGCONT to every process held but those in Stopped, descendants before
// their parents, and lets go of them: a shell with job control that ran before its job
// was continued would see the job stopped, and print "Stopped".
func (t *Tree) Continue() {
	for i := len(t.fds) - 1; i >= 0; i-- {
		if i < len(t.Pids) && slices.Contains(t.Stopped, t.Pids[i]) {
			continue // stopped by the sandbox's own code before the checkpoint
		}
		_ = unix.PidfdSendSignal(t.fds[i], unix.SIGCONT, nil, 0) // ESRCH: ended, nothing to resume
	}
	t.Close()
}

// Kill sends SIGKILL to every process held, descendants first, and lets go of them: a
// shell killed before its stopped jobs orphans their process groups, and the kernel then
// sends them SIGHUP and SIGCONT. The processes are gone when their parent (the sandbox's
// init) has reaped them, not when Kill returns.
func (t *Tree) Kill() {
	for i := len(t.fds) - 1; i >= 0; i-- {
		_ = unix.PidfdSendSignal(t.fds[i], unix.SIGKILL, nil, 0) // ESRCH: ended already
	}
	t.Close()
}

// PidsIn returns the processes of Record (sandbox PIDs) whose state (/proc's letter:
// 'T' stopped, 'Z' zombie) is st now.
func (t *Tree) PidsIn(st byte) (out []int) {
	for i, h := range t.Host {
		if i < len(t.Pids) && procfs.State(int(h[0])) == st {
			out = append(out, t.Pids[i])
		}
	}
	return out
}

// WriteRecord writes v (a type that embeds Tree, or a Record) as dir's record, whole
// or not at all: a temporary file, synced, renamed, and the rename synced.
func WriteRecord(dir string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	tmp := filepath.Join(dir, RecordFile+".tmp")
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	_, err = f.Write(b)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	if err := os.Rename(tmp, filepath.Join(dir, RecordFile)); err != nil {
		return err
	}
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer func() { _ = d.Close() }() // read-only: Sync's error is the one that counts
	return d.Sync()
}

// ReadRecord reads dir's record into v.
func ReadRecord(dir string, v any) error {
	b, err := os.ReadFile(filepath.Join(dir, RecordFile))
	if err != nil {
		return err
	}
	return json.Unmarshal(b, v)
}

// ContinueCut sends SIGCONT, descendants first, to each process named by the records
// that match pattern (filepath.Glob) and still running under the host PID and start
// time recorded, but those recorded as Stopped: to one that runs, SIGCONT is nothing.
// A record that cannot be read is passed over.
func ContinueCut(pattern string) {
	files, _ := filepath.Glob(pattern)
	for _, f := range files {
		var r Record
		if b, err := os.ReadFile(f); err != nil || json.Unmarshal(b, &r) != nil {
			continue
		}
		var live []int
		for _, h := range r.Host {
			if st, err := procfs.StartTime(int(h[0])); err == nil && st == h[1] {
				live = append(live, int(h[0]))
			}
		}
		// A checkpoint's tree cut between its dump and its move holds its TCP
		// connections in repair mode (durable/tcp.go). (CRIU's locks of them, in the
		// sandbox's namespace, go at its adoption: netns.Configure.)
		_ = durable.RepairOff(live) // best effort: the tree runs either way
		for i := len(r.Host) - 1; i >= 0; i-- {
			h := r.Host[i]
			if i < len(r.Pids) && slices.Contains(r.Stopped, r.Pids[i]) {
				continue
			}
			if slices.Contains(live, int(h[0])) {
				_ = unix.Kill(int(h[0]), unix.SIGCONT) // ESRCH: ended since it was read
			}
		}
	}
}
