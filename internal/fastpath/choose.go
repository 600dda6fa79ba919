package fastpath

import (
	"errors"
	"fmt"
)

// What a checkpoint does with each process of the sandbox outside its sessions: the
// fast path carries it (a template forked from it), CRIU takes its tree, or the
// checkpoint refuses. Choose decides it, one process at a time, from what the
// checkpoint read of the process (Candidate) and what the fast path's inspection finds
// while it is seized (Hold). The caller orchestrates: it lists the candidates, keeps what
// is carried, hands the trees to CRIU, and turns a refusal into its answer.

// Choice is what a checkpoint does with a process outside the sessions.
type Choice int

const (
	// Leave: not the checkpoint's to take (gone, a zombie, a process the daemon traces,
	// one a session's CRIU tree carries), or, with end_background, what the checkpoint's
	// kill ends.
	Leave Choice = iota
	// Carry: the fast path takes it; Decision.Held is the process, seized.
	Carry
	// ToCRIU: the fast path's inspection refused it, and its tree goes to CRIU.
	ToCRIU
	// Refuse: neither path takes it (it traces another process, runs in a PID namespace
	// of its own or outside the sandbox's cgroup, holds a session's terminal or a
	// locked description another carried process shares): the checkpoint refuses.
	Refuse
)

func (c Choice) String() string {
	return [...]string{"leave", "carry", "criu", "refuse"}[c]
}

// Candidate is a process outside the sessions as a checkpoint found it, before any is
// seized.
type Candidate struct {
	Host int // host PID (0 when OutsideCgroup)
	Pid  int // PID in the sandbox
	// Kind is Other's answer (Takeable, Zombie, Traced).
	Kind int
	// Traces is the sandbox PID of a process it traces, or 0: fork does not carry a
	// ptrace relationship, and the tracee's exit at the kill would wait for its tracer.
	Traces int
	// OwnPidNS: it runs in a PID namespace below the sandbox's; inspect records its
	// innermost PID, which a restore could not give back.
	OwnPidNS bool
	// OutsideCgroup: in the sandbox's PID namespace but not in its cgroup (it moved
	// out, or runs in a nested PID namespace): its host PID is not known.
	OutsideCgroup bool
	// InSessionTree: below a session's process that goes to CRIU, whose tree carries it.
	InSessionTree bool
}

// Carried is a process the checkpoint carries already, and its name for messages.
type Carried struct {
	P    *Proc
	What string // "session NAME" or "process PID (COMM)"
}

// Decision is Choose's answer.
type Decision struct {
	Choice Choice
	Held   *Held // Carry: the process, seized and inspected
	// Err is why the fast path cannot take it (ToCRIU, Refuse): an *Ineligible.
	Err error
	// Why says, for Leave, why the checkpoint leaves it.
	Why string
}

// Choose decides what a checkpoint does with c. hold seizes and inspects a host PID
// (Hold, on the sandbox's tracer); a process seized and then refused is let go
// untouched (Abort). carried are the processes already carried. exists says whether a
// host PID still runs: one that ended once seen is left. With endBackground what would
// refuse or go to CRIU is left instead, for the checkpoint's kill to end.
func Choose(c Candidate, endBackground bool, hold func(host int) (*Held, error), carried []Carried, exists func(host int) bool) Decision {
	if c.OutsideCgroup {
		err := &Ineligible{Pid: c.Pid, Reason: "it is not in the sandbox's cgroup (it moved out of it) or runs in a PID namespace of its own"}
		return refuse(err, false, endBackground)
	}
	switch {
	case c.Kind == Zombie:
		return Decision{Choice: Leave, Why: "gone, or a zombie"}
	case c.Kind == Traced:
		return Decision{Choice: Leave, Why: "the daemon traces it (a memory holder)"}
	case c.InSessionTree:
		return Decision{Choice: Leave, Why: "a session's CRIU tree carries it"}
	}
	var h *Held
	var err error
	inspected := false // refused by the fast path's inspection: CRIU may take it
	switch {
	case c.Traces != 0:
		err = &Ineligible{Pid: c.Pid, Reason: fmt.Sprintf("it traces process %d (a debugger?), which a fork does not carry", c.Traces)}
	case c.OwnPidNS:
		err = &Ineligible{Pid: c.Pid, Reason: "it runs in a PID namespace of its own (unshare --pid?)"}
	default:
		if h, err = hold(c.Host); err != nil {
			inspected = true
			break
		}
		if why := notCarried(h, carried); why != "" {
			err = &Ineligible{Pid: h.P.Pid, Reason: why}
			if aerr := h.Abort(); aerr != nil {
				err = errors.Join(err, fmt.Errorf("let it go: %w", aerr))
			}
		}
	}
	if err == nil {
		return Decision{Choice: Carry, Held: h}
	}
	if !exists(c.Host) {
		return Decision{Choice: Leave, Why: "it ended meanwhile"}
	}
	var in *Ineligible
	if !errors.As(err, &in) {
		// Not seizable (traced by a debugger inside the sandbox...): as ineligible.
		err = &Ineligible{Pid: c.Pid, Reason: "it cannot be seized: " + err.Error()}
		inspected = false
	}
	return refuse(err, inspected, endBackground)
}

// notCarried says why a seized process h, which the fast path's inspection took, still
// cannot be carried beside carried, or "".
func notCarried(h *Held, carried []Carried) string {
	if h.HasTerminal() {
		// Restored, it could not be given the session's terminal without taking the
		// session's controlling terminal and foreground group.
		return "it holds a session's terminal (started from a session with setsid or nohup?)"
	}
	// A locked description it shares with a process carried before it: each would take
	// the lock again on its own copy, and the second would be refused.
	for _, o := range carried {
		if fd, ofd, ok := SharedLock(o.P, h.P); ok {
			return fmt.Sprintf("its fd %d is the open file description of %s's fd %d, which holds a lock (inherited across a fork?)", fd, o.What, ofd)
		}
	}
	return ""
}

// refuse is the decision for a process the fast path cannot take (err).
func refuse(err error, inspected, endBackground bool) Decision {
	switch {
	case endBackground:
		return Decision{Choice: Leave, Why: "the checkpoint's kill ends it (end_background)", Err: err}
	case inspected:
		return Decision{Choice: ToCRIU, Err: err}
	}
	return Decision{Choice: Refuse, Err: err}
}
