package state

import (
	"errors"
	"fmt"
	"sort"
	"time"

	"deltabox/internal/errdefs"
	"deltabox/internal/fastpath"
	"deltabox/internal/procfs"
	"deltabox/internal/remote"
	"deltabox/internal/session"
)

// Process state (DeltaCR's fast path, package fastpath): at a checkpoint every bash or
// python session forks into a template kept stopped at the node; at a restore of that
// node in the same sandbox, the live session processes are killed and the templates fork
// again with the same PIDs. Templates live in the sandbox that made them (a fork cannot
// leave its PID namespace), or after a fast fork in its family's holder, from which
// every member's restore forks (family.go); restoring a node into any other sandbox
// carries its files only and ends the sessions. They outlive the daemon: the next one takes them back
// (restart.go); a node whose templates are gone (evicted, killed) brings them back from
// its durable image (durable.go), or without one refuses the restore (409). Processes
// outside sessions (background jobs an exec left behind) are checkpointed the same way
// (holdOthers), with no terminal; one the fast path cannot take goes to CRIU with its
// tree (criutrees.go), and what neither can take refuses the checkpoint, or with
// CheckpointOptions.EndBackground is ended. Config.FastPath off turns the fast path off.
//
// Atomicity. A checkpoint seizes the processes before anything changes and keeps them
// seized (they run none of their own code) until it is published: the templates fork
// from them first, on the old state; the files part follows; then the processes move
// onto the new state. A failure at any step moves back the ones already moved
// (fastpath.Held.MoveBack: the same namespace, cwd and open file descriptions as before),
// undoes the files part and kills the templates made: the sandbox is exactly as it was
// (checkpoint.go). A restore does everything that can be checked or prepared before it
// kills the live processes (templates seized, sessions' terminals found, the node's state
// mounted), because clone3 set_tid needs the live PID free: once a live process is killed
// it cannot be kept aside while its replacement is tried (restore.go).

// heldProc is a process seized for a checkpoint: a session's process, or (name "", sess
// nil) one outside the sessions.
type heldProc struct {
	name string
	what string // "session NAME" or "process PID (COMM)", for messages
	sess *session.Session
	h    *fastpath.Held
	pt   *procTemplate // its template, once forked
}

// liveSessions returns the running sessions of s, sorted by name.
func liveSessions(s *sb) ([]string, map[string]*session.Session) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var names []string
	sess := map[string]*session.Session{}
	for name, ss := range s.sessions {
		if ss.Alive() {
			names = append(names, name)
			sess[name] = ss
		}
	}
	sort.Strings(names)
	return names, sess
}

// holdSessions seizes every running session's process and checks, while it is stopped,
// that it can be checkpointed with its state. A session whose process the fast path's
// inspection refuses (children, threads, a socket...) is returned in refused instead,
// by host PID, where CRIU works (not with durable images off): its tree goes through
// CRIU (criutrees.go).
// On error every process already seized is let go untouched. Precondition: s.opMu
// held, no exec running.
// +checklocks:s.opMu
func (m *Manager) holdSessions(s *sb, res *OpResult) (out []*heldProc, refused map[int]*sessionRoot, err error) {
	if !m.fastPath(s) {
		return nil, nil, nil
	}
	names, sess := liveSessions(s)
	if len(names) == 0 {
		return nil, nil, nil
	}
	tr := m.tracer(s)
	for _, n := range names {
		host, err := m.hostPid(s, sess[n].Pid())
		if err == nil {
			var h *fastpath.Held
			if h, err = fastpath.Hold(tr, host); err == nil {
				out = append(out, &heldProc{name: n, what: "session " + n, sess: sess[n], h: h})
				addPhase(res, "hold_handoff", h.Times.Handoff)
				addPhase(res, "hold_seize", h.Times.Seize)
				addPhase(res, "hold_inspect", h.Times.Inspect)
				addPhase(res, "hold_probe", h.Times.Probe)
				continue
			}
		}
		var in *fastpath.Ineligible
		criuWhy := ""
		if errors.As(err, &in) && in.CRIU {
			ok, why := m.criuTreesUsable()
			if ok {
				if refused == nil {
					refused = map[int]*sessionRoot{}
				}
				refused[host] = &sessionRoot{name: n, sess: sess[n], why: fmt.Sprintf("session %s: %v", n, err)}
				continue
			}
			criuWhy = " (and CRIU cannot take it: " + why + ")"
		}
		aborted := m.abortHeld(out)
		if in != nil {
			return nil, nil, abortErr(fmt.Errorf("session %s: %w%s; end what makes it so, or end the session (deltabox session kill): %w", n, err, criuWhy, errdefs.ErrConflict), aborted)
		}
		return nil, nil, abortErr(fmt.Errorf("session %s: %w", n, err), aborted)
	}
	return out, refused, nil
}

// belowAny reports whether host PID h is one of roots or has one among its ancestors
// below the sandbox's init (initHost).
func belowAny(h int, roots map[int]*sessionRoot, initHost int) bool {
	for range 4096 {
		if roots[h] != nil {
			return true
		}
		p, err := procfs.PPid(h)
		if err != nil || p == initHost || p <= 1 {
			return false
		}
		h = p
	}
	return false
}

// holdOthers seizes, after the sessions' (held), every other process of the sandbox
// but init: background jobs an exec left behind, checkpointed with their state like
// the sessions' processes (the fast-path issue's "every process but its init"). Not
// taken: zombies, and what the daemon already traces (templates, memory holders).
// fastpath.Choose decides for each process: carried (held here), its tree to CRIU
// (returned in refused, host PID -> the fast path's refusal, for criutrees.go), or a
// 409 naming it; with endBackground, what would go to CRIU or refuse is left to the
// checkpoint's kill (step 3). On error the processes held here are let go untouched
// (the caller lets held go).
//
// settled reports that the sandbox's PID namespace held nothing but init, the processes
// in held and the sandbox's templates when it was read: all stopped but init, which
// spawns nothing while s.opMu is held, so no process can have appeared since, and the
// checkpoint's kill has nothing to do and need not read it again (a read of ~100 PIDs,
// templates included, took 80 us in the daemon). Any other process unsettles it, even one then
// seized: running until its seizure, it could have forked, cloned with CLONE_PARENT or
// double-forked, and what it made is not in the list. Precondition: s.opMu held, no
// exec running.
// +checklocks:s.opMu
func (m *Manager) holdOthers(s *sb, held []*heldProc, sessTrees map[int]*sessionRoot, endBackground bool, res *OpResult) (out []*heldProc, settled bool, refused map[int]error, err error) {
	if !m.fastPath(s) {
		return nil, false, nil, nil
	}
	t0 := time.Now()
	initHost := s.rt.InitPid()
	known := map[int]bool{initHost: true}
	knownSb := map[int]bool{1: true} // the same, as sandbox PIDs
	for _, l := range held {
		known[l.h.P.HostPid] = true
		knownSb[l.h.P.Pid] = true
	}
	for _, t := range m.sandboxTemplates(s) {
		known[t.HostPid] = true
		knownSb[t.SelfPid] = true
	}
	// Copies of templates waiting for their dump (durable.go); one being made meanwhile
	// is waited for (copyMu).
	phase(res, "others_templates", &t0)
	s.copyMu.Lock()
	phase(res, "others_copywait", &t0)
	hosts, selfs := m.sandboxCopies(s)
	for i := range hosts {
		known[hosts[i]], knownSb[selfs[i]] = true, true
	}
	// The sandbox's processes are its PID namespace's (sandbox.Procs), not its cgroup's:
	// a process can move out of a cgroup directory. Settled: nothing else.
	sbPids, err := s.rt.Procs()
	s.copyMu.Unlock()
	phase(res, "others_list", &t0)
	if err != nil {
		return nil, false, nil, err
	}
	var unknown []int
	for _, p := range sbPids {
		if !knownSb[p] {
			unknown = append(unknown, p)
		}
	}
	if len(unknown) == 0 {
		return nil, true, nil, nil
	}
	// Their host PIDs, from the cgroup (an index; each checked to be in the sandbox's
	// PID namespace, so that a process of another sandbox moved into this cgroup is
	// not taken for one of ours).
	cgPids, err := s.rt.Pids()
	if err != nil {
		return nil, false, nil, fmt.Errorf("list the sandbox's processes: %w", err)
	}
	hostOf := map[int]int{}
	for _, h := range cgPids {
		if !known[h] && fastpath.SamePidNS(h, initHost) {
			if p := fastpath.SandboxPid(h, initHost); p != 0 {
				hostOf[p] = h
			}
		}
	}
	var pids []int
	for _, p := range unknown {
		if h, ok := hostOf[p]; ok {
			pids = append(pids, h)
			continue
		}
		if st := s.rt.ProcState(p); st == 0 || st == 'Z' || st == 'X' {
			continue // gone, or a zombie
		}
		// In the PID namespace, not in the cgroup: it left it (a cgroup2 mount of its
		// own), or runs in a nested PID namespace. Not taken; the kill at step 3 (init's,
		// by PID namespace) ends it.
		if d := fastpath.Choose(fastpath.Candidate{Pid: p, OutsideCgroup: true}, endBackground, nil, nil, nil); d.Choice == fastpath.Refuse {
			return nil, false, nil, fmt.Errorf("%w (outside the sessions: end it, or checkpoint with end_background to end such processes): %w", d.Err, errdefs.ErrConflict)
		}
	}
	tr := m.tracer(s)
	// Not settled: a process found running could fork (or clone with CLONE_PARENT, or
	// double-fork) before its seizure, and what it made is not listed.
	settled = false
	refuse := func(host int, err error) error {
		aborted := m.abortHeld(out)
		return abortErr(fmt.Errorf("%w (%s, outside the sessions: end it, or checkpoint with end_background to end such processes): %w", err, fastpath.Comm(host), errdefs.ErrConflict), aborted) // +checklocksignore: an inline closure, under its caller's opMu (gVisor #11203)
	}
	// First what each unknown process is, and which of them trace others: a tracer
	// cannot be taken (fork does not copy a ptrace relationship), and its tracee's exit,
	// at the kill, would wait for the tracer to collect it.
	kind := map[int]int{}
	tracers := map[int]int{} // tracer -> a process it traces (host PIDs)
	for _, host := range pids {
		k, tracer := fastpath.Other(host)
		kind[host] = k
		if tracer != 0 {
			tracers[tracer] = host
		}
	}
	// Then each, in the order listed: carried by the fast path, its tree to CRIU, or a
	// refusal (fastpath.Choose).
	hold := func(host int) (*fastpath.Held, error) { return fastpath.Hold(tr, host) }
	carried := make([]fastpath.Carried, 0, len(held))
	for _, l := range held {
		carried = append(carried, fastpath.Carried{P: l.h.P, What: l.what})
	}
	for _, host := range pids {
		c := fastpath.Candidate{Host: host, Pid: fastpath.SandboxPid(host, initHost), Kind: kind[host],
			OwnPidNS:      !fastpath.SamePidNS(host, initHost),
			InSessionTree: len(sessTrees) > 0 && belowAny(host, sessTrees, initHost)}
		if tracee, ok := tracers[host]; ok {
			c.Traces = fastpath.SandboxPid(tracee, initHost)
		}
		switch d := fastpath.Choose(c, endBackground, hold, carried, fastpath.Exists); d.Choice {
		case fastpath.Carry:
			what := fmt.Sprintf("process %d (%s)", d.Held.P.Pid, fastpath.Comm(host))
			out = append(out, &heldProc{what: what, h: d.Held})
			carried = append(carried, fastpath.Carried{P: d.Held.P, What: what})
		case fastpath.ToCRIU:
			if refused == nil {
				refused = map[int]error{}
			}
			refused[host] = fmt.Errorf("%w (%s)", d.Err, fastpath.Comm(host))
		case fastpath.Refuse:
			return nil, false, nil, refuse(host, d.Err)
		}
	}
	return out, settled, refused, nil
}

// hostPid returns the host PID of the sandbox process pid: asked of the kernel on the
// sandbox's PID namespace (sandbox.HostPid); on a kernel without that, the cached one if
// it still is that process, else found among the sandbox's cgroup. Precondition: s.opMu
// held.
// +checklocks:s.opMu
func (m *Manager) hostPid(s *sb, pid int) (int, error) {
	if h, ok, err := s.rt.HostPid(pid); ok {
		if err != nil {
			return 0, err
		}
		s.hostPids[pid] = h
		return h, nil
	}
	if h, ok := s.hostPids[pid]; ok && fastpath.IsHostPid(h, pid, s.rt.InitPid()) {
		return h, nil
	}
	hostPids, err := s.rt.Pids()
	if err != nil {
		return 0, err
	}
	h, err := fastpath.HostPid(hostPids, pid)
	if err != nil {
		return 0, err
	}
	s.hostPids[pid] = h
	return h, nil
}

// endLive kills the live session processes of s for a restore, each after giving its
// address space to a holder (fastpath.EndLive: the exit is then quick, and the holder
// frees the memory after the answer). It returns the holders' sandbox PIDs (the
// restore's kill must spare them) and host PIDs (to kill them after the answer), and the
// sandbox and host PIDs of the processes it killed (init must reap them). Precondition:
// s.opMu held, step 4 of Restore.
// +checklocks:s.opMu
func (m *Manager) endLive(s *sb) (pids, hosts, killed, killedHosts []int) {
	if !m.fastPath(s) {
		return nil, nil, nil, nil
	}
	names, sess := liveSessions(s)
	var live, hostOf []int
	for _, n := range names {
		if host, err := m.hostPid(s, sess[n].Pid()); err == nil {
			live = append(live, sess[n].Pid())
			hostOf = append(hostOf, host)
		}
	}
	if len(live) == 0 {
		return nil, nil, nil, nil
	}
	for i, e := range fastpath.EndLive(m.tracer(s), hostOf) {
		if e.HolderErr != nil {
			m.log.Warn("restore: no memory holder for a session's process; its exit frees its memory on the critical path", "sandbox", s.rec.ID, "pid", live[i], "err", e.HolderErr)
		} else if e.HolderHost != 0 {
			pids = append(pids, e.HolderPid)
			hosts = append(hosts, e.HolderHost)
		}
		if e.Killed {
			killed = append(killed, live[i])
			killedHosts = append(killedHosts, e.HostPid)
		}
	}
	return pids, hosts, killed, killedHosts
}

// forkHeld forks every held process into its template (on the state it is on: nothing
// has moved), and pushes the template's kill onto undo as each is made.
func (m *Manager) forkHeld(held []*heldProc, sandbox string, undo *undoList) error {
	for _, l := range held {
		t, err := l.h.Fork()
		if err != nil {
			return fmt.Errorf("%s: %w", l.what, err)
		}
		undo.push(func() error { l.h.DropTemplate(); return nil })
		pt := &procTemplate{session: l.name, what: l.what, sandbox: sandbox, tmpl: t}
		l.pt = pt
		if l.sess == nil {
			continue // no terminal of its own
		}
		pt.kind, pt.argv, pt.term = l.sess.Kind(), l.sess.Info().Argv, l.sess.SaveTerm()
	}
	return nil
}

// moveHeld moves every held process onto the state whose namespace is ns, and pushes onto undo, as
// each has moved, its move back (fastpath.Held.MoveBack; one that cannot be put back
// exactly is killed, never left half-moved, and its session ends). afterFirst runs once
// the first has moved (the fault-injection point that proves a partial move is undone).
// A Move that fails moves its process back itself.
func (m *Manager) moveHeld(s *sb, held []*heldProc, ns int, afterFirst func() error, undo *undoList) error {
	for i, l := range held {
		if err := l.h.Move(ns); err != nil {
			return fmt.Errorf("%s: %w", l.what, err)
		}
		undo.push(func() error {
			if err := l.h.MoveBack(); err != nil {
				return fmt.Errorf("%s could not be put back and was killed: %w", l.what, err)
			}
			return nil
		})
		if i == 0 {
			if err := afterFirst(); err != nil {
				return err
			}
		}
	}
	if len(held) == 0 {
		return afterFirst()
	}
	return nil
}

// abortHeld lets go of processes seized by a checkpoint that failed before anything
// was pushed for them (holdSessions, holdOthers): each is put back and resumed.
func (m *Manager) abortHeld(held []*heldProc) []error {
	var errs []error
	for i := len(held) - 1; i >= 0; i-- {
		if err := held[i].h.Abort(); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", held[i].what, err))
		}
	}
	return errs
}

// releaseHeld lets every held process run on the state it is on (moved, or moved back).
func (m *Manager) releaseHeld(held []*heldProc) []error {
	var errs []error
	for _, l := range held {
		if l.h.Killed() {
			continue // MoveBack said so already
		}
		if err := l.h.Release(); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", l.what, err))
		}
	}
	return errs
}

// keepPids are the processes a kill must spare, as sandbox PIDs: the live sessions being
// checkpointed, their new templates, and every template of this sandbox (killAll adds
// the copies waiting for their images).
func (m *Manager) keepPids(s *sb, held []*heldProc) (keep []int) {
	for _, l := range held {
		keep = append(keep, l.h.P.Pid)
		if l.pt != nil {
			keep = append(keep, l.pt.tmpl.SelfPid)
		}
	}
	for _, t := range m.sandboxTemplates(s) {
		keep = append(keep, t.SelfPid)
	}
	return keep
}

// tracer returns the sandbox's ptrace owner thread. Precondition: s.opMu held.
// +checklocks:s.opMu
func (m *Manager) tracer(s *sb) *remote.Tracer {
	if s.tracer == nil {
		s.tracer = remote.NewTracer()
	}
	return s.tracer
}
