package remote

import (
	"errors"
	"fmt"
	"runtime"
	"sync"

	"golang.org/x/sys/unix"

	_ "deltabox/internal/mainthread" // the main thread is never discarded (see there)
)

// Tracer owns one OS thread that makes every ptrace call for its tracees. Linux binds a
// ptrace relationship to the tracer *thread*: ptrace requests and the waits for stops of a
// tracee must come from the thread that seized it, and when that thread exits the kernel
// detaches (or, with PTRACE_O_EXITKILL, kills) its tracees. A goroutine may move between
// threads at any time, so all ptrace work for a tracee runs on one goroutine locked to its
// thread with runtime.LockOSThread for the tracee's whole traced life.
//
// The thread is never unlocked. It exits when Close returns (Go terminates a thread whose
// locked goroutine exits), after every tracee was detached or killed, so the kernel's
// implicit detach at thread exit never applies to a tracee this package still holds.
//
// One Tracer may own many tracees (the children of an injected clone3 are traced by the
// same thread, and must be). Work for different tracees of one Tracer is serialised;
// use several Tracers for parallelism.
type Tracer struct {
	tid  int           // the locked thread's id; immutable after NewTracer
	reqs chan request  // closures to run on the thread
	done chan struct{} // closed when the thread has exited

	mu sync.Mutex // protects closed, and is held while sending on reqs
	// +checklocks:mu
	closed bool
	// forgets counts the goroutines of ForgetLater, which Close waits for once
	// forgetsDone is set (both under forgetMu, not mu: ForgetLater may run on the
	// thread while another goroutine holds mu, waiting for the thread).
	forgetMu sync.Mutex
	forgets  sync.WaitGroup
	// +checklocks:forgetMu
	forgetsDone bool

	// tracees is touched only on the tracer's thread.
	tracees map[int]*Tracee
}

type request struct {
	fn  func() error
	res chan result
}

type result struct {
	err      error
	panicked bool
	pv       any
}

// NewTracer starts a Tracer's thread.
func NewTracer() *Tracer {
	tr := &Tracer{
		reqs:    make(chan request),
		done:    make(chan struct{}),
		tracees: make(map[int]*Tracee),
	}
	ready := make(chan int)
	go tr.loop(ready)
	tr.tid = <-ready
	return tr
}

func (tr *Tracer) loop(ready chan<- int) {
	runtime.LockOSThread() // never unlocked: the thread exits with this goroutine
	defer close(tr.done)
	ready <- unix.Gettid()
	for req := range tr.reqs {
		req.res <- tr.run(req.fn)
	}
}

// run calls fn, turning a panic into a result so that the panic is raised again on the
// caller's goroutine and the tracer's thread (and its other tracees) survive it.
func (tr *Tracer) run(fn func() error) (r result) {
	defer func() {
		if pv := recover(); pv != nil {
			r = result{panicked: true, pv: pv}
		}
	}()
	return result{err: fn()}
}

// Do runs fn on the Tracer's thread and returns its error. It may be called from any
// goroutine. Calls made from inside fn (to Do or to any Tracee method of this Tracer) run
// directly, so a sequence of injected syscalls in one Do costs one thread hand-off
// (a few microseconds) instead of one per call. A panic in fn is re-raised in the caller.
//
// fn must not block on other goroutines that themselves call Do on this Tracer.
func (tr *Tracer) Do(fn func() error) error {
	if unix.Gettid() == tr.tid {
		return fn()
	}
	res := make(chan result, 1)
	tr.mu.Lock()
	if tr.closed {
		tr.mu.Unlock()
		return ErrClosed
	}
	tr.reqs <- request{fn: fn, res: res}
	tr.mu.Unlock()
	r := <-res
	if r.panicked {
		panic(r.pv)
	}
	return r.err
}

// Attached returns the tracee pid if this Tracer holds it (seized, not yet detached or
// gone), else nil. Inside Do.
func (tr *Tracer) Attached(pid int) *Tracee { return tr.tracees[pid] }

// Forget kills pid if this Tracer holds it and waits until it is gone (a traced process
// that exits stays a zombie until its tracer has waited for it; its parent reaps it
// after that). A process the Tracer does not hold is left alone.
func (tr *Tracer) Forget(pid int) {
	tr.Do(func() error {
		if t := tr.tracees[pid]; t != nil {
			t.killNow()
		}
		return nil
	})
}

// ForgetLater is Forget on a goroutine of the Tracer's own, for a caller that must not
// wait (it may be on the thread, or hold what the thread's current work waits for).
// Close waits for it; after Close it does nothing (the thread's exit detached pid).
func (tr *Tracer) ForgetLater(pid int) {
	tr.forgetMu.Lock()
	defer tr.forgetMu.Unlock()
	if tr.forgetsDone {
		return
	}
	tr.forgets.Add(1)
	go func() {
		defer tr.forgets.Done()
		tr.Forget(pid)
	}()
}

// Close detaches every tracee still attached (restoring it first; one that cannot be
// restored is killed), then ends the thread. Calls after Close return ErrClosed. Close
// must not be called from inside Do.
func (tr *Tracer) Close() error {
	if unix.Gettid() == tr.tid {
		return errors.New("remote: Tracer.Close called from the tracer's own thread")
	}
	var err error
	tr.mu.Lock()
	if !tr.closed {
		tr.closed = true
		res := make(chan result, 1)
		tr.reqs <- request{fn: tr.detachAll, res: res}
		r := <-res
		err = r.err
		if r.panicked {
			err = fmt.Errorf("remote: detaching on close: panic: %v", r.pv)
		}
		close(tr.reqs)
	}
	tr.mu.Unlock()
	<-tr.done
	tr.forgetMu.Lock()
	tr.forgetsDone = true
	tr.forgetMu.Unlock()
	tr.forgets.Wait()
	return err
}

func (tr *Tracer) detachAll() error {
	var errs []error
	for _, t := range tr.tracees {
		if err := t.detach(false); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
