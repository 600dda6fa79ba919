package state

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/durable"
	"deltabox/internal/errdefs"
	"deltabox/internal/fastpath"
	"deltabox/internal/netns"
	"deltabox/internal/procfs"
	"deltabox/internal/proctree"
	"deltabox/internal/sandbox"
	"deltabox/internal/session"
	"deltabox/internal/store"
)

// CRIU trees: the processes outside the sessions that the fast path refuses (several
// threads, live children, a pipe or a socket: fork copies one thread and no children,
// and a template must share nothing with the live process) are checkpointed through
// CRIU instead of refusing the checkpoint, where CRIU can take them. A fork cannot carry
// them; CRIU can, at the price of a dump inside the checkpoint (0.1-0.3 s for a small
// python tree here) and a CRIU restore at each restore of the node, where a template
// costs a fork. What neither path carries still refuses with 409, naming both reasons:
// a process that traces another, one in a PID namespace of its own, one outside the
// sandbox's cgroup, one holding a session's terminal or a locked description it shares.
// What a tree holds that has no name (an unlinked open file, a removed working
// directory) is carried by the daemon, never by CRIU's ghost files in the sandbox's
// files (internal/durable/removed.go; docs/design/criu-files.md).
//
// The unit is a tree: CRIU dumps a process with all its descendants, and restores it as
// a child of the sandbox's init. A tree is rooted at the child of init that leads to a
// refused process: any process of the fast path's below that root goes with the tree.
//
// A session's process that the fast path refuses for what CRIU can take
// (fastpath.Ineligible.CRIU: its children, such as `python3 -m http.server &` in a bash
// session, several threads, a pipe or a socket) roots a tree of its own, with its
// children. Its terminal is the session's: the daemon holds the master, so it is
// external to the image (CRIU's tty[rdev:dev]), and each restore hands CRIU the
// session's slave (TIOCGPTPEER), held open from before the tree is ended until the
// session is rebound to the restored process (same PID, a new exit watch from init,
// set after init reported the old one's exit). CRIU makes the terminal the restored
// leader's controlling one with its foreground group (measured: tcgetpgrp, ^C through
// the session); processes below the leader come back without a controlling terminal
// (Linux inherits it only at fork, and CRIU sets it after forking the tree), so one of
// them that opens /dev/tty fails with ENXIO. A tree may hold its own session's terminal
// and no other. A restore finds the session by name, or makes it (NewDetached) when it
// is gone, and puts back the terminal settings and log of the checkpoint (tree.json).
// Without durable images a session the fast path refuses is a 409, as before.
//
// Files and processes stay one atomic pair:
//
//   - step 1 (seize), once everything else is held: each tree is dumped, synced, and
//     left stopped by CRIU (leave_stopped: SIGSTOP before CRIU lets each task go), so
//     that nothing of it runs between its dump and the publish. Every process of the
//     sandbox is then stopped (held by the tracer, or stopped by CRIU), and nothing
//     could send the trees a SIGCONT but the daemon. Undo: SIGCONT, and the images go.
//   - step 3 (kill) keeps them.
//   - step 7 (move), when the checkpoint moved the sandbox onto a new state: a process
//     with several threads cannot setns into a mount namespace (its threads share
//     their fs_struct), so the trees move by CRIU: ended, and restored from their images
//     onto the new state, stopped. Undo: the same onto the old state. When nothing
//     changed (no new state), they stay where they are.
//   - step 8 (publish): the images become the node's (a rename, then an fsync of the
//     directory, before the node's record is queued), and the trees resume.
//
// A restore to the node, in the sandbox that made it (the trees keep their PIDs),
// restores them at step 6 onto the node's new state, stopped, and resumes them at step
// 7; step 4 has ended every live process and init reaped them, and each PID is waited
// for (waitPidFree). A restore in another sandbox brings the node's files and sessions
// and warns that its CRIU trees stay behind.
//
// On disk, beside the templates' images (durable.go), under ROOT/durable:
//
//	bg/.tmp-RANDOM/K/   a checkpoint's trees, while it runs
//	bg/NODE/K/          the node's tree K: CRIU's files, durable.json, tree.json
//	runs/criu-PID.json  a CRIU run, while it works (durable/runs.go; endLeftCRIU)
//
// A node's directory goes after its record (RemoveNode); start-up removes .tmp-* and
// the directories of nodes the index does not have.
//
// This file decides and records; package proctree holds the trees by pidfds (signals
// never reach a PID reused since), keeps tree.json, and reads from /proc what keeps
// trees from being taken apart (a shared pipe, a session or group across them).
//
// Trust: the images are written by CRIU as host root into the daemon's store (0700);
// nothing in the sandbox can reach them, and they are restored only into the sandbox
// whose processes they hold.

// criuTreeWait bounds how long a checkpoint that found a tree waits for the CRIU probe
// the daemon runs at start (criu.ProbeTimeout, twice at most).
const criuTreeWait = 15 * time.Second

// criuTree is one tree of a checkpoint or restore in progress.
type criuTree struct {
	Why string `json:"why"` // the fast path's refusal
	// Its processes, as dumped or as last restored (sandbox PIDs, root first; host PIDs
	// and start times), held by pidfds while an operation holds the tree. Left stopped
	// by CRIU, they stay so if the daemon dies before the checkpoint's publish, and the
	// next one lets them run (resumeCutCRIUTrees).
	proctree.Tree
	// A session's tree (the session's process is its root, its children go with it):
	// the session, with its kind and argv for one made again at a restore, and its
	// terminal's settings and log at the checkpoint. The terminal itself is the
	// session's (external to the image); a restore hands CRIU the session's slave.
	Session string             `json:"session,omitempty"`
	Kind    session.Kind       `json:"kind,omitempty"`
	Argv    []string           `json:"argv,omitempty"`
	Term    *session.TermState `json:"term,omitempty"`
	// TTY is CRIU's key of the session's terminal as dumped ("tty[rdev:dev]"): the only
	// terminal the image may name.
	TTY string `json:"tty,omitempty"`

	dir string
	// A session's tree, while an operation holds it: the session, the slave of its
	// terminal held open from before the tree is ended until the session is rebound
	// (when the last holder of a slave goes, reads on the master fail with EIO and the
	// session stops reading it for good), the restored root's exit from init, and
	// whether the session was made for a restore (NewDetached) or replaces a dead one.
	sess    *session.Session
	peer    *os.File
	exit    <-chan unix.WaitStatus
	created bool
	old     *session.Session
	// zombies are the processes (sandbox PIDs) that were zombies right after the dump.
	zombies []int
	// tcp are the TCP connections the dump took, in repair mode while repair is set:
	// from the dump until the tree is ended (closed so, they send nothing) or
	// RepairOff (resume).
	tcp    []durable.Conn
	repair bool
}

// sessionRoot is a session whose process the fast path refused (children, threads, a
// socket...): its tree goes through CRIU, rooted at the session's process.
type sessionRoot struct {
	name string
	sess *session.Session
	why  string
}

// criuTrees are the trees of one operation, in a directory of their own.
type criuTrees struct {
	dir   string
	trees []*criuTree
	// ended: the trees were killed (endCRIUTrees) and not restored since; a
	// checkpoint's undo restores them.
	ended bool
	// private: restored in a sandbox other than the one that made them (a fork's
	// branch), each from a copy of its image of its own (privateImage): restores of one
	// image in several sandboxes may run at once, and each changes its directory's mode.
	private bool
	// netLock is the sandbox's network namespace while the trees' TCP connections are
	// locked: by CRIU at a checkpoint's dumps (its tables), or by lockNet at a restore
	// (netns.Lock), until resume, which removes both before the trees run.
	netLock *os.File
}

func (ts *criuTrees) count() (n int) {
	if ts == nil {
		return 0
	}
	for _, t := range ts.trees {
		n += len(t.Pids)
	}
	return n
}

// prepareTreeSessions finds or makes, for a restore, the session of each of ts's session
// trees, and holds its terminal's slave open. On error what it made is let go.
// Precondition: s.opMu held.
// +checklocks:s.opMu
func (m *Manager) prepareTreeSessions(s *sb, ts *criuTrees) error {
	for _, t := range ts.trees {
		if t.Session == "" {
			continue
		}
		var err error
		t.sess, t.old, t.created, err = sessionToRevive(s, t.Session, t.Kind, t.Argv)
		if err == nil {
			_, err = t.holdPeer()
		}
		if err != nil {
			m.abortTreeSessions(ts)
			return fmt.Errorf("session %s of the node's CRIU trees: %w", t.Session, err)
		}
	}
	return nil
}

// abortTreeSessions undoes prepareTreeSessions.
func (m *Manager) abortTreeSessions(ts *criuTrees) {
	for _, t := range ts.trees {
		t.closePeer()
		if t.created {
			t.sess.Release()
		}
		t.sess, t.old, t.created, t.exit = nil, nil, false, nil
	}
}

// commitTreeSessions makes the sessions of ts's restored trees s's, with the node's
// terminal settings and log, before resume binds each to its process. It returns their
// names.
// +checklocks:s.opMu
func (m *Manager) commitTreeSessions(s *sb, ts *criuTrees) (names []string) {
	for _, t := range ts.trees {
		if t.Session == "" || t.sess == nil {
			continue
		}
		if t.old != nil {
			t.old.Release()
		}
		if t.Term != nil {
			t.sess.RestoreTerm(*t.Term)
		}
		s.mu.Lock()
		s.sessions[t.Session] = t.sess
		delete(s.ended, t.Session)
		if len(t.Host) > 0 {
			s.hostPids[t.Pids[0]] = int(t.Host[0][0])
		}
		s.mu.Unlock()
		t.created, t.old = false, nil
		names = append(names, t.Session)
	}
	return names
}

// sessions lists the sessions whose trees these are.
func (ts *criuTrees) sessions() (out []string) {
	if ts == nil {
		return nil
	}
	for _, t := range ts.trees {
		if t.Session != "" {
			out = append(out, t.Session)
		}
	}
	return out
}

// pids lists every process of the trees (sandbox PIDs): a checkpoint's kill keeps them.
func (ts *criuTrees) pids() (out []int) {
	if ts == nil {
		return nil
	}
	for _, t := range ts.trees {
		out = append(out, t.Pids...)
	}
	return out
}

// resume lets every tree run and drops the pidfds. A session's tree that was restored
// is first bound to its session (same PID and terminal, the new process's exit).
// Descendants get SIGCONT before their parents: a shell with job control that ran
// before its job was continued would see the job stopped, and print "Stopped" into the
// next call's output.
//
// A tree dumped and not ended since has its TCP connections in repair mode: turned off
// first (durable.RepairOff), as CRIU does for a tree that runs on. Then the sandbox's
// network is unlocked. The error says which sockets stayed in repair mode, or that the
// lock stayed: both break the sandbox's connections until its next checkpoint.
func (ts *criuTrees) resume() error {
	if ts == nil {
		return nil
	}
	var errs []error
	hosts := func(t *criuTree) (out []int) {
		for _, h := range t.Host {
			out = append(out, int(h[0]))
		}
		return out
	}
	for _, t := range ts.trees {
		if t.repair {
			if err := durable.RepairOff(hosts(t)); err != nil {
				errs = append(errs, err)
			}
			t.repair = false
		}
	}
	// Unlocked before they run: a segment a tree sends under the lock is dropped and
	// waits for its retransmission timer; unlocked after the trees' SIGCONT, the
	// connection paused up to 900 ms after a checkpoint (TestForkCarriesTCPConnection's
	// source, 1 run in 4; none in 20 since).
	errs = append(errs, ts.unlockNet())
	for _, t := range ts.trees {
		if t.sess != nil && t.exit != nil {
			t.sess.Rebind(t.Pids[0], t.exit)
			t.exit = nil
		}
		t.Continue()
		t.closePeer()
	}
	return errors.Join(errs...)
}

// openNet keeps an fd of s's network namespace, for unlockNet: a checkpoint's dumps
// leave CRIU's locks of the trees' connections there (durable.DumpOptions), until the
// trees run again.
// +checklocks:s.opMu
func (ts *criuTrees) openNet(s *sb) error {
	if ts.netLock != nil {
		return nil
	}
	nsf, err := s.rt.OpenInitNS("net")
	if err != nil {
		return fmt.Errorf("the sandbox's network namespace: %w", err)
	}
	ts.netLock = nsf
	return nil
}

// lockNet locks the trees' TCP connections in s's network namespace (netns.Lock) until
// unlockNet: a restore's, so that a connection restored before its peer (in a tree
// restored next) is not reset by it (durable/tcp.go).
// +checklocks:s.opMu
func (ts *criuTrees) lockNet(s *sb) error {
	var tuples []netns.Tuple
	for _, t := range ts.trees {
		tuples = append(tuples, durable.Tuples(t.tcp)...)
	}
	if err := ts.openNet(s); err != nil {
		return err
	}
	return netns.Lock(int(ts.netLock.Fd()), tuples)
}

// unlockNet ends the locks of openNet and lockNet, if any.
func (ts *criuTrees) unlockNet() error {
	if ts.netLock == nil {
		return nil
	}
	err := netns.Unlock(int(ts.netLock.Fd()))
	_ = ts.netLock.Close() // a namespace's fd: nothing written
	ts.netLock = nil
	return err
}

// holdTCP says whether a tree's image holds a TCP connection.
func (ts *criuTrees) holdTCP() bool {
	return ts != nil && slices.ContainsFunc(ts.trees, func(t *criuTree) bool { return len(t.tcp) > 0 })
}

func (t *criuTree) closePeer() {
	if t.peer != nil {
		_ = t.peer.Close() // a terminal's slave, opened to hold it (holdPeer): nothing written through it
		t.peer = nil
	}
}

// holdPeer opens the slave of t's session's terminal (TIOCGPTPEER: no path lookup) and
// returns CRIU's external key of it (durable.TTYKey, as durable.TreeTTYs names it).
func (t *criuTree) holdPeer() (string, error) {
	if t.peer == nil {
		fd, err := t.sess.OpenPeer()
		if err != nil {
			return "", err
		}
		t.peer = os.NewFile(uintptr(fd), "session-pts")
	}
	return durable.TTYKey(int(t.peer.Fd()))
}

// criuTreesUsable says whether CRIU can take trees here, waiting for the start-up probe
// (criuTreeWait at most); if not, why.
func (m *Manager) criuTreesUsable() (bool, string) {
	if m.img == nil {
		return false, "durable images are off"
	}
	select {
	case <-m.img.ready:
	case <-time.After(criuTreeWait):
		return false, fmt.Sprintf("CRIU's probe did not finish within %v", criuTreeWait)
	}
	m.img.mu.Lock()
	r := m.img.runner
	m.img.mu.Unlock()
	if r == nil || !r.Usable() {
		why := "CRIU is unusable here"
		if r != nil {
			why += ": " + r.Reason
		}
		return false, why
	}
	return true, ""
}

// criuRoots returns the trees that carry the refused processes (host PIDs, each with the
// fast path's refusal): for each, the child of init (initHost) among its ancestors. The
// processes of held below a root are let go: their tree carries them. A refused process
// below a session's (which the fast path holds: it has no children) is an error.
func (m *Manager) criuRoots(initHost int, refused map[int]error, sessions []*heldProc, held []*heldProc) (roots []int, why map[int]string, kept []*heldProc, err error) {
	why = map[int]string{}
	rootOf := func(h int) (int, error) {
		for range 4096 {
			p, err := procfs.PPid(h)
			if err != nil {
				return 0, err
			}
			if p == initHost {
				return h, nil
			}
			if p <= 1 {
				return 0, fmt.Errorf("process %d is not below the sandbox's init", h)
			}
			h = p
		}
		return 0, fmt.Errorf("process %d: no end to its ancestors", h)
	}
	for h, e := range refused {
		r, err := rootOf(h)
		if err != nil {
			if !fastpath.Exists(h) {
				continue // ended meanwhile
			}
			return nil, nil, nil, err
		}
		for _, s := range sessions {
			if s.h.P.HostPid == r {
				return nil, nil, nil, fmt.Errorf("%w (below %s)", e, s.what)
			}
		}
		if !slices.Contains(roots, r) {
			roots = append(roots, r)
		}
		if why[r] != "" {
			why[r] += "; "
		}
		why[r] += e.Error()
	}
	slices.Sort(roots)
	for _, l := range held {
		r, err := rootOf(l.h.P.HostPid)
		if err == nil && slices.Contains(roots, r) {
			if aerr := l.h.Abort(); aerr != nil { // its tree's dump goes on without it
				m.log.Error("a process left to its tree's CRIU dump could not be put back as it was seized", "process", l.what, "err", aerr)
			}
			continue
		}
		kept = append(kept, l)
	}
	return roots, why, kept, nil
}

// dumpCRIUTrees dumps the trees rooted at roots (host PIDs) and leaves them stopped (see
// above). On error, what it dumped runs on and nothing is left on disk.
// +checklocks:s.opMu
func (m *Manager) dumpCRIUTrees(s *sb, roots []int, why map[int]string, sessions map[int]*sessionRoot) (*criuTrees, error) {
	if ok, reason := m.criuTreesUsable(); !ok {
		return nil, errors.New(reason)
	}
	var rnd [8]byte
	rand.Read(rnd[:])
	ts := &criuTrees{dir: filepath.Join(m.img.root, "bg", ".tmp-"+hex.EncodeToString(rnd[:]))}
	fail := func(err error) (*criuTrees, error) {
		return nil, withUndo(err, errors.Join(ts.resume(), store.RemoveAll(ts.dir))) // +checklocksignore: an inline closure, under its caller's opMu (gVisor #11203)
	}
	// The state's layers, where the dumps name the directories of inotify watches (none
	// if the spec cannot be had: the watches are then looked for by a walk).
	var layers []string
	if sp, err := m.spec(s.rec.Image, s.rec.Head, s.rec.Upper); err == nil {
		layers = append([]string{sp.Upper}, sp.Lowers...)
	}
	if err := os.MkdirAll(ts.dir, 0o700); err != nil {
		return fail(err)
	}
	// CRIU locks the trees' TCP connections at their dumps, until the trees run again
	// (resume: unlockNet; durable/tcp.go says why).
	if err := ts.openNet(s); err != nil {
		return fail(err)
	}
	initHost := s.rt.InitPid()
	if err := proctree.SharedAcross(roots, initHost); err != nil {
		return fail(err)
	}
	if err := proctree.SessionsAcross(roots, initHost, func(p int) bool { st := s.rt.ProcState(p); return st != 0 && st != 'Z' && st != 'X' }); err != nil { // +checklocksignore: called by SessionsAcross, here, under opMu
		return fail(err)
	}
	for i, root := range roots {
		what := fmt.Sprintf("process %d (%s)", fastpath.SandboxPid(root, initHost), fastpath.Comm(root))
		t := &criuTree{Why: why[root], dir: filepath.Join(ts.dir, strconv.Itoa(i))}
		// A session's tree may hold its session's terminal, and no other: the restore
		// hands CRIU the session's slave for it.
		mine := ""
		if sr := sessions[root]; sr != nil {
			what = "session " + sr.name
			t.Session, t.sess, t.Kind, t.Argv = sr.name, sr.sess, sr.sess.Kind(), sr.sess.Info().Argv
			k, err := t.holdPeer()
			if err != nil {
				t.closePeer()
				return fail(fmt.Errorf("%s: %w", what, err))
			}
			mine, t.TTY = k, k
		}
		if ttys, err := durable.ExternalTTYs(root); err != nil {
			t.closePeer()
			return fail(err)
		} else if slices.ContainsFunc(ttys, func(k string) bool { return k != mine }) {
			t.closePeer()
			if mine != "" {
				return fail(fmt.Errorf("%s: its tree holds the terminal of another session, which CRIU would have to take from that session", what))
			}
			return fail(ttyRefusal(what, root, ttys, mine))
		}
		if err := proctree.PipesToDaemon(root); err != nil {
			t.closePeer()
			return fail(fmt.Errorf("%s: %w", what, err))
		}
		if err := os.Mkdir(t.dir, 0o700); err != nil {
			t.closePeer()
			return fail(err)
		}
		if t.sess != nil {
			term := t.sess.SaveTerm()
			t.Term = &term
		}
		// Who the dump will leave stopped, held by pidfds before it (and in tree.json,
		// for the next daemon if this one dies: resumeCutCRIUTrees), so that any error
		// from here on lets them run again (fail resumes ts.trees). They run until CRIU
		// seizes them: a process forked meanwhile is found after the dump.
		ts.trees = append(ts.trees, t)
		if err := t.track(root, initHost); err != nil {
			return fail(fmt.Errorf("%s: %w", what, err))
		}
		t.Stopped = t.PidsIn('T')
		// root was found while the tree ran: held by a pidfd now, it must still be the
		// sandbox's (and the session's) process, not one that took its PID since.
		if !fastpath.SamePidNS(root, initHost) || (t.sess != nil && (!t.sess.Alive() || t.Pids[0] != t.sess.Pid())) {
			return fail(fmt.Errorf("%s: its process ended during the checkpoint", what))
		}
		man, err := durable.Dump(context.Background(), m.img.runner, root, t.dir, durable.DumpOptions{LeaveStopped: true, Sync: true, FileLocks: true, TCPEstablished: true, Layers: layers})
		if err != nil {
			return fail(fmt.Errorf("%s: %w", what, err))
		}
		t.tcp, t.repair = man.TCP, len(man.TCP) > 0
		// What CRIU found, not what was checked before it: a terminal opened meanwhile.
		if slices.ContainsFunc(man.TTYs, func(k string) bool { return k != mine }) {
			return fail(fmt.Errorf("%s: its tree holds a terminal that is not its session's (%v), which CRIU would have to take from another session", what, man.TTYs))
		}
		// Stopped now: the tree cannot change.
		if err := t.track(root, initHost); err != nil {
			return fail(fmt.Errorf("%s: %w", what, err))
		}
		// A process that had exited and was not reaped yet (a subshell whose parent has
		// not waited) is dumped as a zombie, and stays one: checkAfterDump must not take
		// it for a process let run.
		t.zombies = t.PidsIn('Z')
	}
	if err := syncPath(ts.dir); err != nil {
		return fail(err)
	}
	return ts, nil
}

// track holds the tree rooted at root (host PID) by pidfds, replacing those it held, and
// records its processes in tree.json, written whole or not at all.
func (t *criuTree) track(root, initHost int) error {
	if err := t.Hold(root, initHost); err != nil {
		return err
	}
	return proctree.WriteRecord(t.dir, t)
}

// checkAfterDump lists the sandbox's processes again once every tree is dumped and left
// stopped. The trees ran unheld until their dumps: a process they made meanwhile
// (forked, or reparented to init when its parent in a tree ended) is in no tree and not
// held, so the node would not have it and step 3 would end it, and while it runs it
// could SIGCONT a tree whose image is taken. Such a process refuses the checkpoint
// (409), unless endBackground (step 3 ends it); a tree's process that is no longer
// stopped refuses it in any case. Precondition: s.opMu held, held and the trees stopped.
// +checklocks:s.opMu
func (m *Manager) checkAfterDump(s *sb, held []*heldProc, ts *criuTrees, endBackground bool) error {
	known := map[int]bool{1: true}
	for _, l := range held {
		known[l.h.P.Pid] = true
	}
	for _, t := range m.sandboxTemplates(s) {
		known[t.SelfPid] = true
	}
	deadline := time.Now().Add(leftStoppedWait)
	for _, t := range ts.trees {
		for _, p := range t.Pids {
			if st := waitLeftStopped(s.rt, p, deadline); st != 'T' && (st != 'Z' || !slices.Contains(t.zombies, p)) {
				return fmt.Errorf("process %d, which CRIU took and left stopped, was let run during the checkpoint (state %c): try again: %w", p, st, errdefs.ErrConflict)
			}
			known[p] = true
		}
	}
	s.copyMu.Lock()
	_, selfs := m.sandboxCopies(s)
	sbPids, err := s.rt.Procs()
	s.copyMu.Unlock()
	if err != nil {
		return err
	}
	for _, p := range selfs {
		known[p] = true
	}
	var hostPids []int
	initHost := s.rt.InitPid()
	for _, p := range sbPids {
		if known[p] {
			continue
		}
		if st := s.rt.ProcState(p); st == 0 || st == 'Z' || st == 'X' {
			continue
		}
		if hostPids == nil {
			if hostPids, err = s.rt.Pids(); err != nil {
				return err
			}
		}
		if h, err := fastpath.HostPid(hostPids, p); err == nil && fastpath.SamePidNS(h, initHost) {
			if k, _ := fastpath.Other(h); k == fastpath.Traced || k == fastpath.Zombie {
				continue // a memory holder the daemon traces, or gone
			}
		}
		if endBackground {
			continue // step 3 ends it
		}
		return fmt.Errorf("process %d appeared while CRIU took the processes the fast path refused (forked by them, or left by a parent that ended): it would be in no node, and step 3 would end it; try again, or checkpoint with end_background to end such processes: %w", p, errdefs.ErrConflict)
	}
	return nil
}

// afterTreeDump checks the trees once dumped: no process escaped them (checkAfterDump),
// and their images fit in the sandbox's disk quota (imageRoom: counted whole, in blocks).
// Precondition: as checkAfterDump's.
// +checklocks:s.opMu
func (m *Manager) afterTreeDump(s *sb, held []*heldProc, ts *criuTrees, endBackground bool) error {
	if err := m.checkAfterDump(s, held, ts, endBackground); err != nil {
		return err
	}
	b, err := dirAllocated(ts.dir)
	if err != nil {
		return err
	}
	return m.imageRoom(s, b, "the CRIU images of the processes the fast path refused")
}

// leftStoppedWait bounds how long checkAfterDump waits for a tree's process to reach
// the stop CRIU left it in. CRIU's leave_stopped queues SIGSTOP and then detaches
// (compel_resume_task): the task is runnable ('R') until it is scheduled and takes the
// signal, which on a loaded 2-core machine was seen to take longer than the dump's
// return (TestFailureAtEveryStepKeepsCRIUTrees: "was let run (state R)").
const leftStoppedWait = 2 * time.Second

// waitLeftStopped waits, until deadline at most, while the sandbox's process pid is
// runnable ('R': on its way to the stop CRIU queued), and returns its state then. Any
// other state is returned at once: stopped, or let run (sleeping, as a process that got
// SIGCONT and went back to its work).
func waitLeftStopped(rt *sandbox.Sandbox, pid int, deadline time.Time) byte {
	for {
		st := rt.ProcState(pid)
		if st != 'R' || time.Now().After(deadline) {
			return st
		}
		time.Sleep(time.Millisecond)
	}
}

// endCRIUTrees kills the trees and waits until init has reaped every process (their
// PIDs are free for the restore).
// +checklocks:s.opMu
func (m *Manager) endCRIUTrees(s *sb, ts *criuTrees) error {
	ts.ended = true
	for _, t := range ts.trees {
		t.Kill()
		t.exit = nil     // the killed root's; a restore watches its replacement
		t.repair = false // closed in repair mode: gone without a FIN or RST
	}
	for _, t := range ts.trees {
		for _, p := range t.Pids {
			if err := waitPidFree(s.rt, p, pidFreeWait); err != nil {
				return err
			}
		}
	}
	return nil
}

// restoreCRIUTrees restores the trees from their images onto st (a state of s), stopped.
// On error the trees restored so far are ended.
// +checklocks:s.opMu
func (m *Manager) restoreCRIUTrees(s *sb, ts *criuTrees, st sandbox.State) (err error) {
	sbx, closeAll, err := m.durableSandbox(s.rt, st.NS)
	if err != nil {
		return err
	}
	defer closeAll()
	rootFD, err := unix.FcntlInt(uintptr(st.Root), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return err
	}
	sbx.Root = os.NewFile(uintptr(rootFD), "state-root")
	defer func() { _ = sbx.Root.Close() }()
	initHost := s.rt.InitPid()
	var done []*criuTree
	defer func() {
		if err != nil {
			err = withUndo(err, m.endCRIUTrees(s, &criuTrees{trees: done}))
			ts.ended = true
		}
	}()
	for _, t := range ts.trees {
		for _, p := range t.Pids {
			if err := waitPidFree(s.rt, p, pidFreeWait); err != nil {
				return err
			}
		}
		sbx.TTYs = nil
		if t.Session != "" {
			// The session's terminal for the one the image names; init reports the
			// old root's exit (to the session's old watch) before its answer, so that
			// the new watch gets the restored root's.
			if t.peer == nil {
				return fmt.Errorf("restore session %s's tree: no terminal for it", t.Session)
			}
			man, err := durable.ReadManifest(t.dir)
			if err != nil {
				return fmt.Errorf("restore session %s's tree: %w", t.Session, err)
			}
			sbx.TTYs = map[string]*os.File{}
			for _, k := range man.TTYs {
				if k != t.TTY {
					return fmt.Errorf("restore session %s's tree: its image names terminal %s, not its session's (%s)", t.Session, k, t.TTY)
				}
				sbx.TTYs[k] = t.peer
			}
			if _, err := s.rt.Reap(t.Pids[0]); err != nil {
				return fmt.Errorf("restore session %s's tree: %w", t.Session, err)
			}
			t.exit = s.rt.Watch(t.Pids[0])
		}
		from := t.dir
		if ts.private {
			if from, err = m.privateImage(t.dir, true); err != nil {
				return err
			}
		}
		rs, err := m.restoreFreeingPid(initHost, proctree.Holders, func() (*durable.RestoreStats, error) {
			return durable.Restore(context.Background(), m.img.runner, from, sbx, durable.RestoreOptions{LeaveStopped: true})
		})
		if ts.private {
			_ = store.RemoveAll(filepath.Dir(from)) // a private copy: the start-up sweep removes what is left
		}
		if err != nil {
			if pt := (*durable.PidTakenError)(nil); errors.As(err, &pt) {
				err = fmt.Errorf("%w: held by %s", err, proctree.Holders(initHost, pt.Pid))
			}
			if t.exit != nil {
				s.rt.Unwatch(t.Pids[0])
				t.exit = nil
			}
			if t.Session != "" {
				return fmt.Errorf("restore session %s's tree: %w", t.Session, err)
			}
			return fmt.Errorf("restore process %d's tree: %w", t.Pids[0], err)
		}
		done = append(done, t)
		// Held again by pidfds, and its new host PIDs in tree.json (a daemon that dies
		// before the resume leaves it stopped: resumeCutCRIUTrees).
		want := t.Pids
		track := t.track
		if ts.private {
			// A fork's branch: held by pidfds only. The node's tree.json names the
			// processes of the sandbox that made it; branches restored at once raced on
			// it (rename of tree.json.tmp: no such file) and would write their own PIDs
			// into it. A daemon that dies before the resume leaves the branch's tree
			// stopped.
			track = t.Hold
		}
		if err := track(rs.HostPid, initHost); err != nil {
			proctree.Kill(rs.HostPid)
			return fmt.Errorf("restore process %d's tree: %w", want[0], err)
		}
		for _, p := range t.Pids {
			if !slices.Contains(want, p) {
				return fmt.Errorf("restore process %d's tree: process %d is not in its image", want[0], p)
			}
		}
	}
	ts.ended = false
	return nil
}

// commitCRIUTrees makes a checkpoint's trees node's: renamed, and the rename synced
// before the node's record is queued.
func (m *Manager) commitCRIUTrees(ts *criuTrees, node string) error {
	dst := m.criuTreesDir(node)
	if err := os.Rename(ts.dir, dst); err != nil {
		return err
	}
	ts.dir = dst
	return syncPath(filepath.Dir(dst))
}

func (m *Manager) criuTreesDir(node string) string {
	return filepath.Join(m.img.root, "bg", node)
}

// criuTreesOf reads node's trees (nil if it has none).
func (m *Manager) criuTreesOf(node string) (*criuTrees, error) {
	if m.img == nil {
		return nil, nil
	}
	dir := m.criuTreesDir(node)
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	ts := &criuTrees{dir: dir}
	for _, e := range ents {
		t := &criuTree{dir: filepath.Join(dir, e.Name())}
		err := proctree.ReadRecord(t.dir, t)
		if err == nil && len(t.Pids) == 0 {
			err = errors.New("no processes")
		}
		if err == nil {
			var man *durable.Manifest
			if man, err = durable.ReadManifest(t.dir); err == nil {
				t.tcp = man.TCP
			}
		}
		if err != nil {
			return nil, fmt.Errorf("node %s's CRIU tree %s: %w", node, e.Name(), err)
		}
		ts.trees = append(ts.trees, t)
	}
	return ts, nil
}

// criuRunsDir is where each CRIU run is recorded while it works (criu.Runner.Runs).
func criuRunsDir(root string) string { return filepath.Join(root, "durable", "runs") }

// endLeftCRIU ends, at start and before any sandbox's process is touched (resumed,
// adopted, killed), every CRIU run a dead daemon left working (durable/runs.go): a CRIU
// still dumping a tree would leave it stopped once done, after resumeCutCRIUTrees let
// it run, and would read its sockets while RepairOff takes them out of repair mode.
// Each is given until its deadline, as its daemon would have, then killed.
func (m *Manager) endLeftCRIU() {
	runs, err := durable.LeftRuns(criuRunsDir(m.st.Root))
	if err != nil {
		m.log.Warn("the records of CRIU runs a previous daemon left", "err", err)
	}
	for _, r := range runs {
		m.log.Info("waiting for a CRIU run a previous daemon left working", "run", r.What, "pid", r.Pid, "until", r.Deadline)
	}
	for _, r := range runs {
		start := time.Now()
		killed, err := r.End()
		switch {
		case err != nil:
			m.log.Error("a CRIU run a previous daemon left could not be ended: the processes it works on may stay stopped", "run", r.What, "pid", r.Pid, "err", err)
		case killed:
			m.log.Warn("a CRIU run a previous daemon left was killed at its deadline", "run", r.What, "pid", r.Pid)
		default:
			m.log.Info("a CRIU run a previous daemon left has finished", "run", r.What, "pid", r.Pid, "waited", time.Since(start))
		}
	}
}

// resumeCutCRIUTrees lets run, at start and before the sandboxes are adopted, the trees
// that a dead daemon left stopped by CRIU: a checkpoint's cut between their dump and
// their resume, a restore's cut between theirs and its publish. Each process still
// running under the host PID and start time tree.json names gets SIGCONT. Those on a
// state no record names (a checkpoint's move done, a restore's record not written)
// are ended by adopt. cleanCRIUTrees removes the cut checkpoints' directories afterwards.
func resumeCutCRIUTrees(root string) {
	// Every tree.json: those of cut checkpoints (.tmp-*), and the nodes', which name the
	// processes last restored from them (a restore or a checkpoint's move cut before
	// its resume; SIGCONT is nothing to one that runs).
	proctree.ContinueCut(filepath.Join(root, "durable", "bg", "*", "*", proctree.RecordFile))
}

// cleanCRIUTrees removes, at start, what no node names: the trees of checkpoints cut
// before their publish, and of nodes removed before their directory went.
func (m *Manager) cleanCRIUTrees() {
	ents, _ := os.ReadDir(filepath.Join(m.img.root, "bg"))
	for _, e := range ents {
		if _, known := m.nodes[e.Name()]; !known || strings.HasPrefix(e.Name(), ".") { // +checklocksignore: start-up: New has not shared the manager yet
			_ = store.RemoveAll(filepath.Join(m.img.root, "bg", e.Name())) // what stays, the next start tries again
		}
	}
}

// criuRefusal is the 409 of a tree neither path can take.
// CRIU's reason comes first: it is what stops the checkpoint (the fast path's, which sent
// the tree to CRIU, is most often only shared anonymous memory, which every tree CRIU
// takes may have).
func criuRefusal(fastWhy, criuWhy string, sessions bool) error {
	if sessions {
		return fmt.Errorf("%s (end what makes it so, or end the session: deltabox session kill; end_background ends such processes outside the sessions); nor can the fast path take it: %s: %w", criuWhy, fastWhy, errdefs.ErrConflict)
	}
	return fmt.Errorf("%s (end it, or checkpoint with end_background to end such processes outside the sessions); nor can the fast path take it: %s: %w", criuWhy, fastWhy, errdefs.ErrConflict)
}

// syncPath fsyncs a directory.
func syncPath(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer func() { _ = f.Close() }() // read-only: Sync's error is the one that counts
	return f.Sync()
}

// currentState duplicates the fds of rt's current state (the caller closes them).
func currentState(rt *sandbox.Sandbox) (sandbox.State, error) {
	ns, err := rt.StateNS()
	if err != nil {
		return sandbox.None, err
	}
	root, err := rt.RootFD()
	if err != nil {
		unix.Close(ns)
		return sandbox.None, err
	}
	return sandbox.State{NS: ns, Root: root}, nil
}

// ttyRefusal is why the tree of root (what) cannot go to CRIU: it holds pseudo-terminals
// other than mine (its session's, "" outside the sessions), named by ttys (TreeTTYs').
// A pty the tree opened itself (it holds the master) is told apart from a terminal whose
// master is elsewhere (a session's, another process's).
func ttyRefusal(what string, root int, ttys []string, mine string) error {
	var own, closed, other []string
	for _, t := range durable.TreePTYs(root, slices.DeleteFunc(slices.Clone(ttys), func(k string) bool { return k == mine })) {
		switch {
		case t.Own:
			own = append(own, t.Path)
		case t.Closed:
			closed = append(closed, t.Path)
		default:
			other = append(other, t.Path)
		}
	}
	switch {
	case len(other) > 0 && mine != "":
		return fmt.Errorf("%s: its tree holds %s, the terminal of another session (or a pty another process holds the master of), which CRIU would have to take from its holder", what, strings.Join(other, ", "))
	case len(other) > 0:
		return fmt.Errorf("%s: its tree holds %s, a terminal whose master it does not hold (a session's, or another process's pty), which CRIU would have to take from its holder", what, strings.Join(other, ", "))
	case len(closed) > 0:
		return fmt.Errorf("%s: its tree holds %s, a pseudo-terminal whose master was closed, which DeltaBox does not carry through CRIU (close it)", what, strings.Join(closed, ", "))
	case len(own) > 0:
		return fmt.Errorf("%s: its tree holds %s, a pseudo-terminal it opened itself (it holds the master too: openpty, /dev/ptmx), which DeltaBox does not carry through CRIU (close it)", what, strings.Join(own, ", "))
	}
	return fmt.Errorf("%s: its tree holds a terminal that is not its session's, which CRIU would have to take from its holder", what)
}
