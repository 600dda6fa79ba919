package state

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"deltabox/internal/errdefs"
	"deltabox/internal/fastpath"
	"deltabox/internal/mountns"
	"deltabox/internal/overlay"
	"deltabox/internal/procfs"
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
	// Answer: AnswerEarly or AnswerComplete; "" is Config.EarlyAnswer's choice (see
	// "The early answer").
	Answer string
}

// CheckpointOptions.Answer's values.
const (
	AnswerEarly    = "early"
	AnswerComplete = "complete"
)

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

	t0   time.Time    // when it started (after its wait in the queue)
	pend *pendingNode // the node's id, pending from step 1's end (answer.go)
	// heldRSS, heldAnon: the held processes' resident and anonymous resident memory,
	// which their templates will share (quietMemory, for an early answer).
	heldRSS, heldAnon int64

	oldSpec   overlay.Spec
	u         *store.Upper     // what step 4 read of the upper (readUpper)
	root      *store.RootAttrs // step 4: "/"'s attributes, which the new upper gets
	n         store.Node
	unchanged bool          // the upper holds no change: steps 4-6 do nothing
	p         *prepared     // step 4: the next state prepared ahead of time, if it fit
	newUpper  uint64        // step 4: the upper the sandbox goes on with
	info      *NodeInfo     // step 8: the node as published, for the complete answer
	oldNS     sandbox.State // step 6: the namespace the sandbox leaves (closed after the answer)
}

// CheckpointWith makes a node of the sandbox's files and processes, as one atomic step:
// it either completes or leaves the sandbox exactly as it was, with no node made. The
// steps are checkpointSteps; it may answer after step 1 and complete after the answer
// (see "The early answer"). The answer reports the sandbox's memory after it
// (reportMemory), outside the operation's locks.
func (m *Manager) CheckpointWith(ctx context.Context, id string, o CheckpointOptions) (*OpResult, error) {
	switch o.Answer {
	case "", AnswerEarly, AnswerComplete:
	default:
		return nil, fmt.Errorf("checkpoint answer %q: want %q (once the processes are seized), %q (once the node is complete) or \"\" (the daemon's choice): %w", o.Answer, AnswerEarly, AnswerComplete, errdefs.ErrInvalid)
	}
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
	if !res.Node.Pending {
		// (An early answer's memory is complete, and cannot warn: quietMemory. Measuring
		// the templates here would wait for the node's, which the fork makes now.)
		m.reportMemory(res, id, res.Node.ID)
	}
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
	// Held until the checkpoint ends: by this goroutine, or by the one that completes it
	// after an early answer, which takes it over (nil here then).
	defer func() {
		if unlock != nil {
			unlock()
		}
	}()
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
	c := &checkpoint{m: m, s: s, o: o, res: &OpResult{Sandbox: id, WaitedMS: ms(waited)}, t0: t0}
	// Whatever happens, the position's next state is prepared again: step 4 made
	// earlier builds stale. Pushed first, it runs last.
	c.undo.push(func() error { m.prepareNext(s); return nil }) // +checklocksignore: an undo step: undoList.run runs it under opMu
	tp := t0
	if err := runStepsRange(m, "checkpoint", checkpointSteps, 0, 1, c, &c.inject, c.res, &tp); err != nil {
		return nil, c.fail(err) // +checklocksignore: opMu held since beginOp
	}
	c.reserve()                 // +checklocksignore: opMu held since beginOp
	ans, err := c.answerEarly() // +checklocksignore: opMu held since beginOp
	if err != nil {
		return nil, c.fail(err) // +checklocksignore: opMu held since beginOp
	}
	if ans == nil {
		if err := c.complete(tp); err != nil { // +checklocksignore: opMu held since beginOp
			return nil, err
		}
		c.res.Node = c.info
		c.res.Node.CompleteMS = c.res.DurationMS // complete's, which the node records
		c.res.CompleteMS = c.res.DurationMS
		c.res.Memory = m.memoryNow(s) // +checklocksignore: opMu held since beginOp
		return c.res, nil
	}
	// Steps 2-8 after the answer, on the manager's wait group (Close waits for them).
	done := unlock
	unlock = nil
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		defer done()
		_ = c.complete(tp) // +checklocksignore: opMu held since beginOp, handed over; a failure is logged by complete and answered to the next call (answer.go)
	}()
	return ans, nil
}

// The early answer. A checkpoint answers once step 1 has seized the sandbox's
// processes, and its steps 2-8 (the fork of the templates, which is most of a
// checkpoint: 2.9 of its 4.7 ms p50 with a 63 MB python, bench latency; the new state;
// the move; the publication) run after the answer, while the agent thinks. From step 1
// on, the sandbox's files and processes cannot change until the checkpoint ends: every
// process stays stopped, and every call (an exec, a file operation) and switch waits
// for the sandbox's opMu, which the checkpoint holds until its end (the goroutine that
// completes it takes it over, on the manager's wait group: Close waits for it). So the
// node is exactly the sandbox at the answer, and the next operation sees exactly the
// node. The node's id is reserved before the answer and pending until the end
// (answer.go): a restore or fork of it from anywhere waits for it.
//
// A failure after the answer is undone as any failed checkpoint's (every process
// running as before, every file as it was) and reported by the node's id and the
// sandbox's next operation (answer.go). A daemon that dies meanwhile leaves what a
// checkpoint cut by a crash leaves (restart.go): the node is lost, the sandbox repaired.
//
// The early answer is taken when it is exact and worth it: step 1 held processes (there
// is a fork to hide), CRIU took no tree (its move restores it from its images: a
// failure there is likelier), step 3 will end nothing (nothingToKill: the answer's
// killed_processes and sessions_ended are 0), and the answer cannot carry a memory
// warning (quietMemory: near half the limit or budget, the complete answer measures
// the new templates). Its node is what step 4 will make: the upper is read before the
// answer (store.ReadUpper, no change), so the answer's node has its layer and depth;
// its memory is the sandbox's now, with the held processes' resident memory as the new
// templates' (they will share every page) and the kernel's limit grown for them. What
// only the end knows (mounted, prepared, process_errors) is not in it: the node's
// complete_ms says when it ended.

// early reports whether the checkpoint answers early (see above).
// +checklocks:c.s.opMu
func (c *checkpoint) early() bool {
	switch c.o.Answer {
	case AnswerComplete:
		return false
	case "":
		if !c.m.cfg.EarlyAnswer {
			return false
		}
	}
	return len(c.held) > 0 && c.criu == nil && c.nothingToKill() && c.quietMemory()
}

// quietMemory reports whether the answer cannot carry a memory warning (reportMemory),
// whatever the new templates come to hold, and reads what they will hold (heldRSS,
// heldAnon: their processes', every page shared at the fork). With a template budget:
// the sandbox's templates hold at most their bound (budget.go) plus the new ones' anon
// pages, under half the budget. Without one: the sandbox's anonymous memory, the
// templates' included, is under half its limit (the fork adds page tables, not pages).
// Past that, the complete answer measures the templates, the new ones included, and
// warns.
// +checklocks:c.s.opMu
func (c *checkpoint) quietMemory() bool {
	m, s := c.m, c.s
	c.heldRSS, c.heldAnon = 0, 0
	for _, l := range c.held {
		if st, err := procfs.ReadStatm(l.h.P.HostPid); err == nil {
			c.heldRSS += st.ResidentBytes()
			c.heldAnon += st.AnonBytes()
		}
	}
	if b := m.templateBudget(s); b > 0 {
		return s.bound(sandboxUsage(s))+c.heldAnon <= b/2
	}
	lim := s.rec.Limits.MemoryBytes
	return lim <= 0 || s.rt.MemoryAnon() <= lim/2
}

// nothingToKill reports whether step 3 will end nothing: step 1 saw nothing else
// (settled), or the sandbox's PID namespace holds nothing but what step 3 keeps now;
// nothing can start meanwhile, every process being stopped. (What a process gone since
// step 1 left in the kernel, step 3 still refuses: a failure after the answer.)
// +checklocks:c.s.opMu
func (c *checkpoint) nothingToKill() bool {
	m, s := c.m, c.s
	if c.settled {
		return true
	}
	s.copyMu.Lock()
	defer s.copyMu.Unlock()
	_, copies := m.sandboxCopies(s)
	return onlyKept(s, append(m.keepPids(s, c.held), copies...))
}

// reserve makes the node's record but its layer, with an id pending until the end
// (answer.go).
// +checklocks:c.s.opMu
func (c *checkpoint) reserve() {
	m, s := c.m, c.s
	c.pend = m.reserveNode(s)
	c.n = store.Node{ID: c.pend.id, Parent: s.rec.Head, Image: s.rec.Image, Created: time.Now().UTC(), Label: c.o.Label, Sandbox: s.rec.ID}
	m.mu.Lock()
	if m.idsTaken == nil {
		m.idsTaken = map[string]bool{}
	}
	m.idsTaken[c.n.ID] = true // until the node is in m.nodes (publish) or the checkpoint fails
	m.mu.Unlock()
}

// answerEarly is the early answer, or nil when the checkpoint answers at its end
// (early). It reads the upper for step 4.
// +checklocks:c.s.opMu
func (c *checkpoint) answerEarly() (*OpResult, error) {
	tu := time.Now()
	if !c.early() {
		return nil, nil
	}
	phase(c.res, "early", &tu) // whether it may: memory read, and the namespace unless settled
	m, s := c.m, c.s
	if err := c.readUpper(); err != nil {
		return nil, err
	}
	phase(c.res, "upper", &tu)
	n := c.n
	if c.unchanged {
		n.Layer = c.parentLayer()
	} else {
		n.Layer, n.Own, n.Bytes = s.rec.Upper, true, -1
	}
	m.mu.Lock()
	depth := len(m.stack(s.rec.Head))
	m.mu.Unlock()
	if !c.unchanged {
		depth++
	}
	info := NodeInfo{Node: apiNode(n), Depth: depth, Pinned: c.o.Pin, Pending: true}
	m.answeredEarly(c.pend)
	// The memory after the checkpoint, but for its fork: the new templates will hold
	// what their processes hold now (every page, shared), and the kernel's limit grows
	// for them (budget.go) after the answer, before the fork (complete; after a failure,
	// the next fit takes it down): nothing of the sandbox runs in between.
	ans := *c.res
	ans.Node = &info
	if ans.Memory = m.memoryNow(s); ans.Memory != nil {
		ans.Memory.NodeTemplatesRSS = c.heldRSS
		if ans.Memory.TemplateBudgetBytes > 0 {
			ans.Memory.KernelLimitBytes = m.kernelLimitAfter(s, true, c.heldAnon)
		}
	}
	ans.Processes = len(c.held)
	for _, l := range c.held {
		if l.name != "" {
			ans.Sessions = append(ans.Sessions, l.name)
		}
	}
	slices.Sort(ans.Sessions)
	ans.PhasesUS = maps.Clone(c.res.PhasesUS)
	phase(&ans, "answer", &tu) // the node's depth, the memory now
	ans.DurationMS = ms(time.Since(c.t0))
	return &ans, nil
}

// complete runs steps 2-8 and settles the node: published, or failed and undone.
// +checklocks:c.s.opMu
func (c *checkpoint) complete(tp time.Time) error {
	m, s := c.m, c.s
	if c.pend.early {
		m.fitKernelLimitPlus(s, true, c.heldAnon) // what the answer said (answerEarly)
	}
	if err := runStepsRange(m, "checkpoint", checkpointSteps, 1, len(checkpointSteps), c, &c.inject, c.res, &tp); err != nil {
		err = c.fail(err)
		if c.pend.early {
			m.log.Error("checkpoint failed after its early answer, and was undone", "sandbox", s.rec.ID, "node", c.n.ID, "err", err)
		}
		return err
	}
	tl := time.Now()
	m.fitKernelLimit(s, true) // room for what the new templates may come to hold (budget.go)
	phase(c.res, "limit", &tl)
	c.res.DurationMS = ms(time.Since(c.t0))
	m.mu.Lock()
	if nd := m.nodes[c.n.ID]; nd != nil {
		nd.completeMS = c.res.DurationMS
	}
	m.mu.Unlock()
	if c.pend.early && len(c.res.ProcessErrors) > 0 {
		m.log.Warn("checkpoint after its early answer: processes that could not resume", "sandbox", s.rec.ID, "node", c.n.ID, "errors", c.res.ProcessErrors)
	}
	c.end(nil)
	return nil
}

// fail undoes a checkpoint that failed with err, and returns err with what the undo
// could not put back.
// +checklocks:c.s.opMu
func (c *checkpoint) fail(err error) error {
	m, s := c.m, c.s
	if uerr := c.undo.run(); uerr != nil {
		m.log.Error("checkpoint failed, and its undo could not put everything back", "sandbox", s.rec.ID, "err", err, "undo", uerr)
		err = withUndo(err, uerr)
	}
	m.countFailed(s, "checkpoint", c.refused)
	c.end(err)
	return err
}

// end settles the node's id (answer.go) and queues the work left for after the
// checkpoint, before opMu is let go: the gate holds it until then.
// +checklocks:c.s.opMu
func (c *checkpoint) end(err error) {
	m, s := c.m, c.s
	if c.pend != nil {
		m.mu.Lock()
		delete(m.idsTaken, c.n.ID)
		m.mu.Unlock()
		m.settleNode(s, c.pend, err)
	}
	for _, f := range c.after {
		m.afterAnswer(s, f)
	}
	c.after = nil
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
	// Its parts are in phases_us too (seize_hold: the sessions' processes seized and
	// inspected; seize_others: the rest of the PID namespace; seize_kstate: the kernel
	// state), the answer's largest part (docs/design/early-answer.md).
	ts0 := time.Now()
	held, sessTrees, err := m.holdSessions(s, c.res)
	if err != nil {
		return err
	}
	phase(c.res, "seize_hold", &ts0)
	c.held = held
	c.undo.push(func() error {
		if errs := m.releaseHeld(c.held); len(errs) > 0 {
			return fmt.Errorf("resume the held processes: %w", errors.Join(errs...))
		}
		return nil
	})
	others, settled, refused, err := m.holdOthers(s, held, sessTrees, c.o.EndBackground, c.res)
	if err != nil {
		return err
	}
	c.held, c.settled = append(c.held, others...), settled
	phase(c.res, "seize_others", &ts0)
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
	phase(c.res, "seize_kstate", &ts0)
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
		undoErr = errors.Join(undoErr, ts.resume())
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
	if c.u == nil { // else read before an early answer
		if err := c.readUpper(); err != nil {
			return err
		}
	}
	u := c.u
	c.newUpper = s.rec.Upper
	if c.unchanged {
		c.n.Layer = c.parentLayer()
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
	var err error
	if c.newUpper, err = m.freshUpperWith(u.Root); err != nil {
		return err
	}
	newUpper := c.newUpper
	c.undo.push(func() error { return store.RemoveAll(m.st.LayerDir(newUpper)) })
	return nil
}

// readUpper reads what step 4 decides on: the old stack and upper, and whether the
// upper holds a change. Only reads: the sandbox cannot change from step 1 on.
// +checklocks:c.s.opMu
func (c *checkpoint) readUpper() error {
	m, s := c.m, c.s
	var err error
	if c.oldSpec, err = m.spec(s.rec.Image, s.rec.Head, s.rec.Upper); err != nil {
		return err
	}
	u, err := store.ReadUpper(c.oldSpec.Upper, mountns.LookedUp...)
	if err != nil {
		return fmt.Errorf("checkpoint: %w", err)
	}
	c.u, c.root = u, u.Root
	c.unchanged = u.Empty && rootUnchanged(u.Root, c.oldSpec.Lowers[0])
	return nil
}

// parentLayer is the top layer of the sandbox's head (0: the image alone), which a
// node with no change of its own shares.
// +checklocks:c.s.opMu
func (c *checkpoint) parentLayer() uint64 {
	c.m.mu.Lock()
	defer c.m.mu.Unlock()
	if st := c.m.stack(c.s.rec.Head); len(st) > 0 {
		return st[0]
	}
	return 0
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
		if err := c.criu.resume(); err != nil {
			res.ProcessErrors = append(res.ProcessErrors, err.Error())
		}
	}
	m.mu.Lock()
	nd := &node{Node: c.n, uts: &c.uts, pinned: c.o.Pin}
	m.addNodeLocked(nd)
	delete(m.idsTaken, c.n.ID)
	if len(tps) > 0 {
		m.templates[c.n.ID] = tps
	}
	s.rec.Head, s.rec.Upper = c.n.ID, c.newUpper
	seq := m.st.Index.Apply(store.Op{PutNode: &c.n}, store.Op{PutSandbox: &s.rec})
	nd.seq, s.seq = seq, seq
	// The answer's node as it is published: no child yet, and only s stands on it (no
	// other sandbox can name a node before its checkpoint ends: answer.go). nodeInfo
	// would find the same by a walk of every node and sandbox, under m.mu again.
	c.info = m.nodeInfoLocked(c.n.ID, nil, map[string][]string{c.n.ID: {s.rec.ID}})
	depth := c.info.Depth
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
