package state

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"deltabox/internal/errdefs"
	"deltabox/internal/fastpath"
	"deltabox/internal/mountns"
	"deltabox/internal/overlay"
	"deltabox/internal/proctree"
	"deltabox/internal/sandbox"
	"deltabox/internal/sbinit"
	"deltabox/internal/store"

	"golang.org/x/sys/unix"
)

// CheckpointOptions are a checkpoint's options.
type CheckpointOptions struct {
	Label string
	// EndBackground ends the processes outside the sessions that cannot be checkpointed
	// with their state (a pipe, a socket, children...) instead of refusing the
	// checkpoint; the others are still checkpointed.
	EndBackground bool
	// Wait: queue behind the calls (execs, file operations) running or queued when the
	// checkpoint arrives, for this long at most, instead of refusing while one runs
	// (op.go: admission). 0: refuse at once.
	Wait time.Duration
	// Pin pins the new node (budget.go: its templates are never evicted).
	Pin bool
}

// Checkpoint is CheckpointWith the label and no other option.
func (m *Manager) Checkpoint(ctx context.Context, id, label string) (*OpResult, error) {
	return m.CheckpointWith(ctx, id, CheckpointOptions{Label: label})
}

// checkpointSteps are the steps of a checkpoint, in order; step k (failStep's number) is
// checkpointSteps[k-1]. Each pushes onto the operation's undo list what reverses it, once
// it has succeeded, so that a failure at step k undoes steps k-1..1 in that order.
//
//  1. seize: the sessions' processes, then every other process but init, each checked
//     while stopped (an ineligible one refuses the checkpoint with 409, nothing changed);
//     from here to step 8 they run none of their own code. Then the kernel state they
//     share (kernelstate.go): the host and domain names are read, and IPC objects
//     (System V, POSIX message queues) refuse the checkpoint (409). Undo: resume them.
//  2. fork: each into its template, on the current state (nothing has moved yet).
//     Undo: kill the templates.
//  3. kill: end what was not seized (with EndBackground, the processes outside the
//     sessions that could not be). Not undone: no node carries them, and every
//     checkpoint that gets this far ends them, whether it completes or not. Nothing to
//     do, and no second listing of the sandbox's PID namespace, when step 1 found there
//     nothing but init, the processes it seized, the sandbox's templates and their
//     copies awaiting a dump (holdOthers's settled; a zombie is listed, so it unsettles
//     it). Else what is not kept is killed (killAll, which lists the namespace again)
//     and the kernel state is read again: what was killed ran until now (an IPC object
//     it made refuses the checkpoint, as at step 1).
//  4. upper: take a fresh upper (the next state prepared ahead of time, if it fits: made
//     for this upper and these lowers, and sound for what the upper holds, see
//     prepare.go). Undo: give the prepared state back, or remove the fresh upper.
//  5. freeze: the old upper becomes the node's read-only layer (store.Freeze). Undo:
//     unfreeze it (and the prepared state, whose lower it was, is dropped).
//  6. mount: install the new stack (the prepared state, or a new mount). Undo: reinstall
//     the old namespace.
//  7. move: the live processes onto the current state (the injected failure comes after
//     the first has moved, so that a partial move is undone too). Undo: move each back
//     onto the old state with its own open file descriptions, namespace and cwd.
//  8. publish: the node and its templates are recorded, the processes resume, the undo
//     list is released.
//
// Steps 4-6 do nothing when the upper holds no change: the node shares its parent's top
// layer and the sandbox keeps its mount, which already shows exactly that state.
var checkpointSteps = []step[*checkpoint]{
	{"seize", (*checkpoint).seize, false},
	{"fork", (*checkpoint).fork, false},
	{"kill", (*checkpoint).kill, false},
	{"upper", (*checkpoint).upper, false},
	{"freeze", (*checkpoint).freeze, false},
	{"mount", (*checkpoint).mount, false},
	{"move", (*checkpoint).move, true},
	{"publish", (*checkpoint).publish, false},
}

// checkpoint is one checkpoint in progress: what its steps share. Only the goroutine
// running CheckpointWith touches it, with s.opMu and m.treeMu (shared) held.
type checkpoint struct {
	m    *Manager
	s    *sb
	o    CheckpointOptions
	res  *OpResult
	undo undoList
	// inject is the fault-injection point of a step that fails from inside (step 7).
	inject func() error
	// after is work for after the answer, queued when the checkpoint ends, whether it
	// completes or not (afterAnswer).
	after []func()

	held []*heldProc // step 1: seized, in the order they were
	// Step 1: the trees the fast path refused, and CRIU's images of them (criutrees.go).
	criuRoots []int
	criuWhy   map[int]string
	criu      *criuTrees
	settled   bool       // step 1 saw nothing step 3 must end
	uts       sbinit.UTS // step 1 (or 3): the names the node records
	refused   string     // why a refusal was one (counted)

	oldSpec   overlay.Spec
	root      *store.RootAttrs // step 4: "/"'s attributes, which the new upper gets
	n         store.Node
	unchanged bool          // the upper holds no change: steps 4-6 do nothing
	p         *prepared     // step 4: the next state prepared ahead of time, if it fit
	newUpper  uint64        // step 4: the upper the sandbox goes on with
	oldNS     sandbox.State // step 6: the namespace the sandbox leaves (closed after the answer)
}

// CheckpointWith makes a node of the sandbox's files and processes, as one atomic step:
// it either completes or leaves the sandbox exactly as it was, with no node made. The
// steps are checkpointSteps. The answer reports the sandbox's memory after it
// (reportMemory), outside the operation's locks.
func (m *Manager) CheckpointWith(ctx context.Context, id string, o CheckpointOptions) (*OpResult, error) {
	// Over its disk quota a sandbox is not checkpointed: the node would keep the
	// oversized layer.
	var admitted time.Duration
	if s, err := m.get(id); err != nil {
		return nil, err
	} else if err := m.diskRefusal(s); err != nil {
		return nil, err
	} else {
		// Over its template budget (or the daemon's total) a checkpoint waits for room
		// before it takes any lock (budget.go), and that wait counts against its wait_ms.
		waited, err := m.admitCheckpoint(ctx, s, o.Wait)
		if err != nil {
			why := ""
			if errors.Is(err, errdefs.ErrTemplateBudget) {
				why = "over_budget"
			}
			m.countFailed(s, "checkpoint", why)
			return nil, err
		}
		admitted = waited
		if o.Wait > 0 { // what is left, in whole ms (a 409 names it)
			o.Wait = max((o.Wait - waited).Round(time.Millisecond), time.Millisecond)
		}
		defer m.afterOpMeasure(s)
	}
	res, err := m.checkpointLocked(ctx, id, o)
	if err != nil {
		return nil, err
	}
	if res.PhasesUS != nil { // the admission, before the operation's own clock started
		res.PhasesUS["admit"] = admitted.Microseconds()
	}
	if o.Pin {
		if _, err := m.PinNode(res.Node.ID, true); err != nil { // removed meanwhile
			res.Warnings = append(res.Warnings, "not pinned: "+err.Error())
		} else {
			res.Node.Pinned = true
		}
	}
	m.reportMemory(res, id, res.Node.ID)
	if w := m.st.Warning(); w != "" {
		res.Warnings = append(res.Warnings, w)
	}
	return res, nil
}

func (m *Manager) checkpointLocked(ctx context.Context, id string, o CheckpointOptions) (_ *OpResult, err error) {
	t0 := time.Now()
	s, unlock, waited, err := m.beginOp(ctx, id, "checkpoint", o.Wait)
	if err != nil {
		return nil, err
	}
	defer unlock()
	// Nothing is taken of a process still missing pages (lazy.go); the wait is the
	// checkpoint's time.
	if err := m.waitLazy(s); err != nil { // +checklocksignore: opMu held since beginOp
		return nil, err
	}
	// Connections through the network proxy: requests in flight finish, idle ones are
	// reset (network.go).
	if err := m.quiesceNet(s, o.Wait); err != nil {
		return nil, err
	}
	t0 = t0.Add(waited)
	c := &checkpoint{m: m, s: s, o: o, res: &OpResult{Sandbox: id, WaitedMS: ms(waited)}}
	defer func() {
		if err != nil {
			m.countFailed(s, "checkpoint", c.refused)
		}
		for _, f := range c.after { // before unlock: the gate holds them until then
			m.afterAnswer(s, f)
		}
	}()
	// Whatever happens, the position's next state is prepared again: step 4 made
	// earlier builds stale. Pushed first, it runs last.
	c.undo.push(func() error { m.prepareNext(s); return nil }) // +checklocksignore: an undo step: undoList.run runs it under opMu
	if err := runSteps(m, "checkpoint", checkpointSteps, c, &c.inject, c.res, t0); err != nil {
		if uerr := c.undo.run(); uerr != nil {
			m.log.Error("checkpoint failed, and its undo could not put everything back", "sandbox", id, "err", err, "undo", uerr)
			err = withUndo(err, uerr)
		}
		return nil, err
	}
	c.res.Node = m.nodeInfo(c.n.ID)
	tl := time.Now()
	m.fitKernelLimit(s, true) // room for what the new templates may come to hold (budget.go)
	phase(c.res, "limit", &tl)
	c.res.DurationMS = ms(time.Since(t0))
	c.res.Memory = m.memoryNow(s) // +checklocksignore: opMu held since beginOp
	return c.res, nil
}

// seize is step 1. Each part pushes its undo once done: the held processes are resumed,
// and the trees CRIU took are put back and resumed before them (LIFO), so that no held
// process runs, and forks, while a tree's PIDs wait for CRIU.
// +checklocks:c.s.opMu
func (c *checkpoint) seize() (err error) {
	m, s := c.m, c.s
	defer func() {
		var in *fastpath.Ineligible
		if errors.As(err, &in) {
			c.refused = "ineligible"
		}
	}()
	held, sessTrees, err := m.holdSessions(s)
	if err != nil {
		return err
	}
	c.held = held
	c.undo.push(func() error {
		if errs := m.releaseHeld(c.held); len(errs) > 0 {
			return fmt.Errorf("resume the held processes: %w", errors.Join(errs...))
		}
		return nil
	})
	others, settled, refused, err := m.holdOthers(s, held, sessTrees, c.o.EndBackground)
	if err != nil {
		return err
	}
	c.held, c.settled = append(c.held, others...), settled
	if len(refused) > 0 {
		// Their trees go through CRIU (criutrees.go), with what the fast path held
		// below their roots (let go by criuRoots).
		roots, why, kept, err := m.criuRoots(s.rt.InitPid(), refused, held, others)
		if err != nil {
			return err
		}
		c.held = append(held[:len(held):len(held)], kept...)
		c.criuRoots, c.criuWhy = roots, why
	}
	if len(sessTrees) > 0 {
		// Sessions' trees, rooted at the sessions' processes (criutrees.go).
		if c.criuWhy == nil {
			c.criuWhy = map[int]string{}
		}
		for h, sr := range sessTrees {
			c.criuRoots = append(c.criuRoots, h)
			c.criuWhy[h] = sr.why
		}
		slices.Sort(c.criuRoots)
	}
	// Read once the processes are stopped: what they share must not change before
	// their templates are made.
	if c.uts, err = m.kernelState(s); err != nil {
		return err
	}
	if len(c.criuRoots) == 0 {
		return nil
	}
	tc := time.Now()
	ts, err := m.dumpCRIUTrees(s, c.criuRoots, c.criuWhy, sessTrees)
	if err != nil {
		var fastWhy []string
		for _, r := range c.criuRoots {
			fastWhy = append(fastWhy, c.criuWhy[r])
		}
		return criuRefusal(strings.Join(fastWhy, "; "), err.Error(), len(sessTrees) > 0)
	}
	c.criu = ts
	// Runs after every later step's undo: if step 7 ended the trees, the sandbox's old
	// state (files unfrozen, namespace back) is current again, and they come back onto
	// it from their images.
	c.undo.push(func() error {
		var undoErr error
		if ts.ended {
			// Each tree on its own: one that cannot come back does not take
			// the others with it.
			var errs []error
			lost := 0
			st, serr := currentState(s.rt) // +checklocksignore: an undo step: undoList.run runs it under opMu
			if serr != nil {
				errs = append(errs, serr)
			}
			for _, t := range ts.trees {
				err := serr
				if err == nil {
					if err = m.restoreCRIUTrees(s, &criuTrees{dir: ts.dir, trees: []*criuTree{t}}, st); err != nil { // +checklocksignore: an undo step: undoList.run runs it under opMu
						errs = append(errs, err)
					}
				}
				if err != nil {
					lost += len(t.Pids)
				}
			}
			if serr == nil {
				st.Close()
			}
			if len(errs) > 0 {
				undoErr = fmt.Errorf("%d of the %d processes CRIU took could not be put back (they are gone): %w", lost, ts.count(), errors.Join(errs...))
			}
			ts.ended = false
		}
		ts.resume()
		if err := store.RemoveAll(ts.dir); err != nil {
			undoErr = errors.Join(undoErr, fmt.Errorf("remove the trees' images: %w", err))
		}
		return undoErr
	})
	if err := m.afterTreeDump(s, c.held, ts, c.o.EndBackground); err != nil {
		return err
	}
	c.res.CRIUProcesses = ts.count()
	phase(c.res, "criu_dump", &tc)
	return nil
}

// fork is step 2.
// +checklocks:c.s.opMu
func (c *checkpoint) fork() error {
	return c.m.forkHeld(c.held, c.s.rec.ID, &c.undo)
}

// kill is step 3.
// +checklocks:c.s.opMu
func (c *checkpoint) kill() error {
	m, s := c.m, c.s
	if !c.settled {
		n, err := m.killAll(s, append(m.keepPids(s, c.held), c.criu.pids()...), false)
		if err != nil {
			return err
		}
		c.res.Killed = n
		if c.uts, err = m.kernelState(s); err != nil {
			return err
		}
	}
	if !m.fastPath(s) {
		_, why := m.filesOnlyPath(s)
		c.res.SessionsEnded = m.endSessions(s, "ended by a checkpoint ("+why+")")
	}
	return nil
}

// upper is step 4.
// +checklocks:c.s.opMu
func (c *checkpoint) upper() error {
	m, s := c.m, c.s
	var err error
	if c.oldSpec, err = m.spec(s.rec.Image, s.rec.Head, s.rec.Upper); err != nil {
		return err
	}
	c.n = store.Node{Parent: s.rec.Head, Image: s.rec.Image, Created: time.Now().UTC(), Label: c.o.Label, Sandbox: s.rec.ID}
	c.newUpper = s.rec.Upper
	u, err := store.ReadUpper(c.oldSpec.Upper, mountns.LookedUp...)
	if err != nil {
		return fmt.Errorf("checkpoint: %w", err)
	}
	c.root = u.Root
	if u.Empty && rootUnchanged(u.Root, c.oldSpec.Lowers[0]) {
		c.unchanged = true
		m.mu.Lock()
		if st := m.stack(s.rec.Head); len(st) > 0 {
			c.n.Layer = st[0]
		}
		m.mu.Unlock()
		return nil
	}
	c.n.Layer, c.n.Own, c.n.Bytes = s.rec.Upper, true, -1
	p := m.takeNext(s, c.oldSpec.Lowers)
	if p != nil && (u.Has || !p.root.SameModeOwner(u.Root)) {
		// The prepared overlay looked these names up (its mount points) while frozen/
		// was empty: it would show them without what this upper holds there, /dev/shm's
		// files. And it checks permissions on "/" with the mode and owner its upper's
		// root had when it was mounted. A new mount, made after the freeze, has neither
		// fault.
		m.discard(p, true)
		p = nil
	}
	if p != nil {
		c.p, c.newUpper, c.res.Prepared = p, p.newUpper, true
		c.undo.push(func() error {
			if c.p != nil { // else step 5's undo dropped it
				m.putNext(s, c.p)
			}
			return nil
		})
		return nil
	}
	if c.newUpper, err = m.freshUpperWith(u.Root); err != nil {
		return err
	}
	newUpper := c.newUpper
	c.undo.push(func() error { return store.RemoveAll(m.st.LayerDir(newUpper)) })
	return nil
}

// freeze is step 5.
// +checklocks:c.s.opMu
func (c *checkpoint) freeze() error {
	if c.unchanged {
		return nil
	}
	m := c.m
	if err := m.st.Freeze(c.n.Layer); err != nil {
		return err
	}
	c.undo.push(func() error {
		err := m.st.Unfreeze(c.n.Layer)
		if err != nil {
			err = fmt.Errorf("unfreeze layer %d: %w", c.n.Layer, err)
		}
		if c.p != nil {
			// Its lower, frozen/, is gone with the unfreeze: it cannot be given back.
			m.discard(c.p, false)
			c.p = nil
		}
		return err
	})
	return nil
}

// mount is step 6.
// +checklocks:c.s.opMu
func (c *checkpoint) mount() error {
	if c.unchanged {
		return nil
	}
	m, s := c.m, c.s
	// The old namespace keeps the old overlay, whose upper is now the empty diff/ (not
	// the frozen layer), until after the answer: see store.Freeze.
	c.oldNS = s.rt.TakeState()
	if c.p != nil {
		// "/"'s times and xattrs may have changed since the preparation (its mode and
		// owner not: step 4). overlayfs reads them from its upper's root each time.
		if !c.p.root.Equal(c.root) {
			if err := store.SetRootAttrs(m.st.LayerDiff(c.newUpper), c.root); err != nil {
				s.rt.PutState(c.oldNS)
				return fmt.Errorf("checkpoint: the attributes of / on the prepared state: %w", err)
			}
		}
		s.rt.PutState(c.p.state)
	} else if err := m.setState(s, c.res, overlay.Spec{
		Lowers: append([]string{m.st.LayerFrozen(c.n.Layer)}, c.oldSpec.Lowers...),
		Upper:  m.st.LayerDiff(c.newUpper),
		Work:   m.st.LayerWork(c.newUpper),
	}); err != nil {
		s.rt.PutState(c.oldNS)
		return fmt.Errorf("checkpoint: mount the new state: %w", err)
	}
	c.res.Mounted = true
	c.undo.push(func() error {
		cur := s.rt.TakeState() // +checklocksignore: an undo step: undoList.run runs it under opMu
		if c.p == nil {
			cur.Close() // the new stack goes before its lower is unfrozen
		} // else cur is the prepared state, which step 5's undo releases
		s.rt.PutState(c.oldNS) // +checklocksignore: an undo step: undoList.run runs it under opMu
		return nil
	})
	return nil
}

// move is step 7. The processes move onto the sandbox's current state: the new one, or
// the same one when nothing changed (they still reopen their files, to share no open
// file description with their templates).
// +checklocks:c.s.opMu
func (c *checkpoint) move() error {
	m, s := c.m, c.s
	if len(c.held) == 0 {
		if err := c.inject(); err != nil {
			return err
		}
		return c.moveCRIUTrees()
	}
	ns, err := s.rt.StateNS()
	if err != nil {
		return err
	}
	// Closed once the checkpoint is over, whatever happens: an undo moves processes
	// back, and the namespace must outlive every move (queued now, not closed here).
	c.after = append(c.after, func() { unix.Close(ns) })
	if err := m.moveHeld(s, c.held, ns, c.inject, &c.undo); err != nil {
		return err
	}
	return c.moveCRIUTrees()
}

// moveCRIUTrees moves step 1's CRIU trees onto the new state, by CRIU: ended, and
// restored from their images (criutrees.go says why). Nothing to do when the sandbox
// kept its state. Undo: end them again; step 1's undo, which runs once the old state is
// back (files unfrozen, namespace reinstalled), restores them onto it. Restored before
// then, they would reopen their files in a frozen layer.
// +checklocks:c.s.opMu
func (c *checkpoint) moveCRIUTrees() error {
	m, s, ts := c.m, c.s, c.criu
	if ts == nil || c.unchanged {
		return nil
	}
	tc := time.Now()
	// Nothing that outlives the move may hold a tree's PID as its session or group id
	// (proctree.IDsTaken): refused while the trees still run.
	var trees [][]int
	for _, t := range ts.trees {
		var hosts []int
		for _, h := range t.Host {
			hosts = append(hosts, int(h[0]))
		}
		trees = append(trees, hosts)
	}
	var staying []int
	for _, l := range c.held {
		staying = append(staying, l.h.P.HostPid)
	}
	if err := proctree.IDsTaken(trees, staying, s.rt.InitPid()); err != nil {
		return fmt.Errorf("%v: %w", err, errdefs.ErrConflict)
	}
	if err := m.endCRIUTrees(s, ts); err != nil {
		return err
	}
	st, err := currentState(s.rt)
	if err == nil {
		err = m.restoreCRIUTrees(s, ts, st)
		st.Close()
	}
	if err != nil {
		return fmt.Errorf("move the processes CRIU took onto the new state: %w", err)
	}
	c.undo.push(func() error {
		if err := m.endCRIUTrees(s, ts); err != nil { // +checklocksignore: an undo step: undoList.run runs it under opMu
			return fmt.Errorf("end the CRIU trees on the new state: %w", err)
		}
		return nil
	})
	phase(c.res, "criu_move", &tc)
	return nil
}

// publish is step 8: from here nothing fails.
// +checklocks:c.s.opMu
func (c *checkpoint) publish() error {
	m, s, res := c.m, c.s, c.res
	c.undo.release()
	var tps []*procTemplate
	for _, l := range c.held {
		tps = append(tps, l.pt)
		if l.name != "" {
			res.Sessions = append(res.Sessions, l.name)
		}
	}
	for _, e := range m.releaseHeld(c.held) {
		res.ProcessErrors = append(res.ProcessErrors, e.Error())
	}
	res.Processes = len(tps)
	m.mu.Lock()
	c.n.ID = m.newNodeID()
	if m.idsTaken == nil {
		m.idsTaken = map[string]bool{}
	}
	m.idsTaken[c.n.ID] = true // until the node is in m.nodes, below
	m.mu.Unlock()
	if c.criu != nil {
		// Before the node's record: a node the index has names its trees.
		if err := m.commitCRIUTrees(c.criu, c.n.ID); err != nil {
			res.ProcessErrors = append(res.ProcessErrors, fmt.Sprintf("the images of the processes CRIU took: %v; they run on, and the node has no process state for them", err))
			_ = store.RemoveAll(c.criu.dir) // what stays, the next start sweeps (cleanCRIUTrees)
			res.CRIUProcesses = 0
		} else {
			res.Sessions = append(res.Sessions, c.criu.sessions()...)
			slices.Sort(res.Sessions)
		}
		c.criu.resume()
	}
	m.mu.Lock()
	nd := &node{Node: c.n, uts: &c.uts}
	m.nodes[c.n.ID] = nd
	delete(m.idsTaken, c.n.ID)
	if len(tps) > 0 {
		m.templates[c.n.ID] = tps
	}
	s.rec.Head, s.rec.Upper = c.n.ID, c.newUpper
	seq := m.st.Index.Apply(store.Op{PutNode: &c.n}, store.Op{PutSandbox: &s.rec})
	nd.seq, s.seq = seq, seq
	depth := len(m.stack(c.n.ID))
	m.mu.Unlock()
	m.queueSquash(c.n.ID, depth)
	if c.n.Own {
		layer, oldNS, id := c.n.Layer, c.oldNS, c.n.ID
		m.afterAnswer(s, func() {
			oldNS.Close()
			m.st.Index.Apply(store.Op{After: func() { m.st.DropUpperDirs(layer) }})
		})
		m.afterAnswer(s, func() { m.measure(id, m.st.LayerFrozen(layer)) })
	}
	switch {
	case len(tps) > 0 || res.CRIUProcesses > 0:
		m.countPath(s, "checkpoint", pathProcess)
		if res.CRIUProcesses > 0 {
			s.mu.Lock()
			s.stats.CheckpointPaths.CRIU++
			s.mu.Unlock()
		}
	case !m.fastPath(s):
		p, _ := m.filesOnlyPath(s)
		m.countPath(s, "checkpoint", p)
	default:
		m.countPath(s, "checkpoint", pathNoSessions)
	}
	m.prepareNext(s)
	m.warmNode(s, c.n.ID)
	m.parkTemplates(s, c.n.ID, tps)
	if len(tps) == 0 {
		m.afterAnswer(s, func() { m.keepSessions(s) })
	}
	return nil
}
