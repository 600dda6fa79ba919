package state

import (
	"context"
	"fmt"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/apitypes"
	"deltabox/internal/errdefs"
)

// OpResult reports one checkpoint or restore. The wire form is defined once, in
// apitypes.
type OpResult = apitypes.OpResult

// ms is d in milliseconds, to the microsecond (the answers' *_ms).
func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// addPhase adds d to r's phase name (a part timed elsewhere, in us).
func addPhase(r *OpResult, name string, d time.Duration) {
	if r.PhasesUS == nil {
		r.PhasesUS = map[string]int64{}
	}
	r.PhasesUS[name] += d.Microseconds()
}

// phase records the time since *t in r.PhasesUS under name and resets *t.
func phase(r *OpResult, name string, t *time.Time) {
	now := time.Now()
	if r.PhasesUS == nil {
		r.PhasesUS = map[string]int64{}
	}
	r.PhasesUS[name] += now.Sub(*t).Microseconds()
	*t = now
}

// ---- admission: calls and state switches ----
//
// A sandbox runs calls (execs and file operations, any number at once) or one state
// switch (a checkpoint or a restore), never both: a switch replaces the filesystem and
// the processes a call works on. Who goes first is decided by arrival, with this policy:
//
//   - A switch without a wait (wait_ms 0, the default) is refused at once (409, naming
//     the calls) while a call runs. It queues behind nothing and no call waits for it
//     but for the milliseconds it runs (opMu).
//   - A switch with a wait queues: it starts once every call that arrived before it has
//     ended (those running and those queued), or gives up when its wait is over (409,
//     naming the calls it waited for, and for how long each has run).
//   - A call that arrives while a switch is queued waits behind it until that switch has
//     run or given up; so a stream of calls cannot starve a switch.
//   - A switch waits at most its own wait, so it cannot starve the calls either: a call
//     waits at most the waits of the switches that arrived before it, plus their run
//     times. Calls run together; switches run one at a time (opMu).
//
// The queue is kept in arrival order (tickets) under sb.mu; waiters sleep on a channel
// closed at every change (admission.changed), so that a wait can also end on its
// deadline or on its caller's cancellation.

// maxWait bounds a switch's wait: the calls queued behind it wait as long.
const maxWait = 10 * time.Minute

// admission is a sandbox's queue of calls and state switches (sb.adm, under sb.mu).
type admission struct {
	next    uint64
	entries map[uint64]*arrival
	changed chan struct{} // closed, and replaced, when an entry starts or leaves
}

// arrival is a call or a switch in the queue.
type arrival struct {
	op      bool   // a switch (else a call)
	what    string // "exec `make test`", "files write /workspace/x", "checkpoint"
	since   time.Time
	started time.Time // zero while it waits
}

func (a *admission) arrive(op bool, what string) uint64 {
	if a.entries == nil {
		a.entries = map[uint64]*arrival{}
	}
	a.next++
	a.entries[a.next] = &arrival{op: op, what: what, since: time.Now()}
	return a.next
}

func (a *admission) wake() {
	if a.changed != nil {
		close(a.changed)
		a.changed = nil
	}
}

// waitCh is closed at the next change.
func (a *admission) waitCh() <-chan struct{} {
	if a.changed == nil {
		a.changed = make(chan struct{})
	}
	return a.changed
}

func (a *admission) start(t uint64) {
	if e := a.entries[t]; e != nil {
		e.started = time.Now()
	}
	a.wake()
}

func (a *admission) leave(t uint64) {
	delete(a.entries, t)
	a.wake()
}

// before lists the arrivals of the other kind than t's that came before t, oldest first.
func (a *admission) before(t uint64) []uint64 {
	op := a.entries[t].op
	var out []uint64
	for u, e := range a.entries {
		if u < t && e.op != op {
			out = append(out, u)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

// describe names the arrivals ts and how long each has run or waited.
func (a *admission) describe(ts []uint64) string {
	now := time.Now()
	var parts []string
	for _, t := range ts {
		e := a.entries[t]
		if e.started.IsZero() {
			parts = append(parts, fmt.Sprintf("%s (queued %s ago behind another checkpoint or restore)", e.what, roundDur(now.Sub(e.since))))
		} else {
			parts = append(parts, fmt.Sprintf("%s (running for %s)", e.what, roundDur(now.Sub(e.started))))
		}
	}
	return strings.Join(parts, ", ")
}

// running lists the calls that run now, oldest first.
func (a *admission) running() []uint64 {
	var out []uint64
	for u, e := range a.entries {
		if !e.op && !e.started.IsZero() {
			out = append(out, u)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

func roundDur(d time.Duration) time.Duration {
	if d < time.Second {
		return d.Round(time.Millisecond)
	}
	return d.Round(100 * time.Millisecond)
}

// call is a call admitted to a sandbox (enterCall).
type call struct {
	s *sb
	t uint64
}

// enterCall queues a call (an exec, a file operation; what names it in a switch's 409)
// behind the switches that arrived before it (see admission), then locks s.opMu and
// checks that s is live (lockLive). On success the caller holds s.opMu: it marks the
// call running with c.start() before it releases opMu, and ends it with c.end() (also
// when it never started).
// +checklocksignore: as lockLive, it returns holding opMu on success only
func (m *Manager) enterCall(ctx context.Context, s *sb, what string) (*call, error) {
	s.mu.Lock()
	t := s.adm.arrive(false, what)
	c := &call{s, t}
	for len(s.adm.before(t)) > 0 {
		ch := s.adm.waitCh()
		s.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			c.end()
			return nil, fmt.Errorf("abandoned while queued behind a checkpoint or restore of %s: %w", s.rec.ID, ctx.Err())
		}
		s.mu.Lock()
	}
	s.mu.Unlock()
	if err := m.lockLive(s); err != nil {
		c.end()
		return nil, err
	}
	if err := m.takeLateFailure(s); err != nil { // answer.go
		s.opMu.Unlock()
		c.end()
		return nil, err
	}
	return c, nil
}

// start marks the call running: from now on a switch waits for its end. Precondition:
// s.opMu held (enterCall), so that no switch runs.
func (c *call) start() {
	c.s.mu.Lock()
	c.s.execs++
	c.s.adm.start(c.t)
	c.s.mu.Unlock()
}

// end takes the call out of the queue; switches waiting for it may go.
func (c *call) end() {
	c.s.mu.Lock()
	if e := c.s.adm.entries[c.t]; e != nil && !e.started.IsZero() {
		c.s.execs--
	}
	c.s.adm.leave(c.t)
	c.s.mu.Unlock()
}

// beginOp locks s for a checkpoint or restore (what). With no wait it refuses (409)
// while a call runs; with one it queues behind the calls that arrived before it, for
// wait at most (see admission). On success the caller holds s.opMu and treeMu (shared)
// and must call the returned func; waited is the time it spent in the queue.
// +checklocksignore: it hands opMu and treeMu to its caller through the returned func,
// which the analyzer cannot follow; its callers exempt the lines that need them
func (m *Manager) beginOp(ctx context.Context, id, what string, wait time.Duration) (_ *sb, _ func(), waited time.Duration, _ error) {
	s, err := m.get(id)
	if err != nil {
		return nil, nil, 0, err
	}
	if wait > maxWait {
		return nil, nil, 0, fmt.Errorf("a %s waits at most %v (wait_ms %d), not %v: %w", what, maxWait, maxWait.Milliseconds(), wait, errdefs.ErrInvalid)
	}
	var t uint64 // the switch's ticket when it queues
	leave := func() {}
	if wait > 0 {
		t0 := time.Now()
		if t, err = m.queueOp(ctx, s, what, wait); err != nil {
			return nil, nil, 0, err
		}
		waited = time.Since(t0)
		leave = func() {
			s.mu.Lock()
			s.adm.leave(t)
			s.mu.Unlock()
		}
	} else if err := m.lockLive(s); err != nil {
		return nil, nil, 0, err
	}
	// Held: s.opMu.
	if err := m.takeLateFailure(s); err != nil { // answer.go
		s.opMu.Unlock()
		leave()
		return nil, nil, 0, err
	}
	s.mu.Lock()
	busy := s.adm.running()
	desc := s.adm.describe(busy)
	s.mu.Unlock()
	if len(busy) > 0 { // (never after a wait: calls that came later wait for this switch)
		s.opMu.Unlock()
		leave()
		return nil, nil, 0, fmt.Errorf("sandbox %s is running %d call(s): %s; %s after they finish, or give it a wait (wait_ms; deltabox %s --wait) to queue behind them: %w", id, len(busy), desc, what, what, errdefs.ErrConflict)
	}
	// A warm-up of restored processes (procwarm.go) lets go of its process first.
	if err := m.stopProcWarm(s); err != nil {
		s.opMu.Unlock()
		leave()
		return nil, nil, 0, err
	}
	end := s.bg.begin()
	m.treeMu.RLock()
	return s, func() { m.treeMu.RUnlock(); s.opMu.Unlock(); end(); leave() }, waited, nil
}

// queueOp queues a switch of s behind the calls that arrived before it and returns its
// ticket once they have ended, with s.opMu held (lockLive); or refuses it with 409
// naming them when wait is over. The caller takes the ticket out of the queue
// (admission.leave) when the switch is done.
// +checklocksignore: as lockLive, it returns holding opMu on success only
func (m *Manager) queueOp(ctx context.Context, s *sb, what string, wait time.Duration) (uint64, error) {
	timer := time.NewTimer(wait)
	defer timer.Stop()
	s.mu.Lock()
	t := s.adm.arrive(true, what)
	for {
		ahead := s.adm.before(t)
		if len(ahead) == 0 {
			break
		}
		ch := s.adm.waitCh()
		s.mu.Unlock()
		select {
		case <-ch:
			s.mu.Lock()
			continue
		case <-timer.C:
		case <-ctx.Done():
		}
		s.mu.Lock()
		ahead = s.adm.before(t)
		if len(ahead) == 0 && ctx.Err() == nil {
			break // the last one ended as the wait did
		}
		desc := s.adm.describe(ahead)
		s.adm.leave(t)
		s.mu.Unlock()
		if ctx.Err() != nil {
			return 0, fmt.Errorf("%s of %s abandoned while it waited for %s: %w", what, s.rec.ID, desc, ctx.Err())
		}
		return 0, fmt.Errorf("%s of %s waited %v for the calls that came before it, which still run: %s; wait longer (wait_ms), or end them: %w", what, s.rec.ID, wait, desc, errdefs.ErrConflict)
	}
	s.mu.Unlock()
	if err := m.lockLive(s); err != nil {
		s.mu.Lock()
		s.adm.leave(t)
		s.mu.Unlock()
		return 0, err
	}
	return t, nil
}

// fail is the fault-injection point of step k of op (Manager.failStep; tests only).
func (m *Manager) fail(op string, k int) error {
	m.crashPoint(op, k)
	if m.failStep != nil {
		return m.failStep(op, k)
	}
	return nil
}

// killAll ends every process but init, keep (sandbox PIDs: live sessions being
// checkpointed, templates) and the copies of templates waiting for their images
// (durable.go); it skips the round trip to init (and init's walk of /proc) when the
// sandbox's PID namespace holds only init and those, unless always. (Counting is not
// enough: keep may name templates that died.) The copies are listed under copyMu, held
// until init has killed: parking runs beside operations (views.go), and a copy made
// between the list and the kill would be killed, and its node left without an image.
// +checklocks:s.opMu
func (m *Manager) killAll(s *sb, keep []int, always bool) (int, error) {
	s.copyMu.Lock()
	defer s.copyMu.Unlock()
	_, copies := m.sandboxCopies(s)
	keep = append(keep[:len(keep):len(keep)], copies...)
	if !always && onlyKept(s, keep) {
		return 0, nil
	}
	n, err := s.rt.KillAll(keep...)
	if err != nil {
		return 0, fmt.Errorf("end the sandbox's processes: %w", err)
	}
	return n, nil
}

// onlyKept reports whether every process in s's PID namespace (not its cgroup, which a
// process can leave: sandbox.Procs) is init or in keep (sandbox PIDs).
// +checklocks:s.opMu
func onlyKept(s *sb, keep []int) bool {
	pids, err := s.rt.Procs()
	if err != nil {
		return false
	}
	for _, p := range pids {
		if p != 1 && !slices.Contains(keep, p) {
			return false
		}
	}
	return true
}

// step is one numbered step of an operation (checkpointSteps, restoreSteps).
type step[T any] struct {
	phase string // its name in OpResult.PhasesUS (a step may record parts of itself too)
	run   func(T) error
	// injectInside: the step calls the operation's fault-injection point itself (after
	// its first process, so that a partial step is undone too), instead of before it.
	injectInside bool
}

// runSteps runs steps in order on op, each after its fault-injection point (failStep's
// number k is steps[k-1]; for a step that injects inside, *inject is set to its point),
// and records each one's time in res from t0 on. It stops at the first error; the
// caller runs op's undo list.
func runSteps[T any](m *Manager, name string, steps []step[T], op T, inject *func() error, res *OpResult, t0 time.Time) error {
	return runStepsRange(m, name, steps, 0, len(steps), op, inject, res, &t0)
}

// runStepsRange is runSteps of steps[from:to] (their numbers stay k = index+1), timed
// from *tp on, which it moves to the end of the last one run.
func runStepsRange[T any](m *Manager, name string, steps []step[T], from, to int, op T, inject *func() error, res *OpResult, tp *time.Time) error {
	for i := from; i < to; i++ {
		st := steps[i]
		k := i + 1
		point := func() error { return m.fail(name, k) }
		if st.injectInside {
			*inject = point
		} else if err := point(); err != nil {
			return err
		}
		if err := st.run(op); err != nil {
			return err
		}
		phase(res, st.phase, tp)
	}
	if to == len(steps) {
		// After the last step, before the answer and the index commit (a crash hook only).
		m.crashPoint(name, len(steps)+1)
	}
	return nil
}

// crashPoint is DELTABOX_CRASH_AT's hook (crashpoint_testhooks.go): the daemon dies
// here as under kill -9. A daemon built without -tags testhooks has none (crashAt "").
func (m *Manager) crashPoint(op string, k int) {
	if m.crashAt != "" && m.crashAt == op+":"+strconv.Itoa(k) {
		m.log.Warn("DELTABOX_CRASH_AT: the daemon kills itself", "op", op, "step", k)
		_ = unix.Kill(os.Getpid(), unix.SIGKILL) // cannot fail on itself
		select {}
	}
}
