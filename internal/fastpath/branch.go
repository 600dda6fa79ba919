package fastpath

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"deltabox/internal/remote"
)

// A fast fork's placement (docs/design/fork.md): a template, in the family's PID
// namespace P_S, forks into a branch's PID namespace P_i (a child of P_S) at its
// checkpoint PID, and its copy joins the branch's other namespaces.
//
//	template: setns(P_i, CLONE_NEWPID)        only its children's namespace changes
//	          clone3(CLONE_PARENT, set_tid=[X]) the copy is X in P_i (the holder-level
//	                                           PID is the kernel's choice), PPID 0 there:
//	                                           its parent is the family init, outside
//	          setns(P_S, CLONE_NEWPID)        back, for the next fork
//	copy:     moved into the branch's cgroups (Target.Place) while stopped, then
//	          setns U_i (first: the others are owned by it), net, IPC, UTS, cgroup,
//	          then Revive's move onto the branch's state (its mount namespace, made by
//	          the branch init, so owned by U_i), terminal, locks, timers, signals
//	          and last its capabilities as they were (below).
//
// Capabilities: setns(CLONE_NEWUSER) gives the caller a full set in the new namespace,
// bounding set included (the kernel's set_cred_user_ns: CAP_FULL_SET for permitted,
// effective and bounding, inheritable and ambient cleared). A copy would run with
// CAP_SYS_PTRACE, CAP_NET_ADMIN, CAP_MKNOD... in U_i that its process never had
// (sbinit's sandboxCaps). So the batch ends by dropping from the bounding set what the
// template's lacks and setting permitted, effective and inheritable back to the
// template's (read from its /proc status, the live process's at the fork), and the
// ambient set raised again as it was. Checked by TestForkFastPlacesCopies (CapBnd of a
// copy equals its source's).
//
// Namespace fds: the template's PID namespace and its own again one at a time
// (handFD); the copy's six (user, net, IPC, UTS, cgroup, the state's mount namespace)
// over one hand-over received in the move's batch (handFDs).

// Target is a branch a template's copy is placed into: the daemon's fds on the branch
// init's namespaces, and Home, on the template's own PID namespace (set back after the
// fork).
type Target struct {
	PID, User, Net, IPC, UTS, Cgroup int
	Home                             int
	// Place moves the copy (its host PID), still stopped, into the branch's cgroups.
	Place func(hostPid int) error
}

// Place places tmpls, templates of the family held by tr, into the branch tg: each is
// seized (SeizeTemplate) and forked by ReviveInto onto the branch state's mount namespace
// ns, with ptys[i] its terminal ("" outside a session), one after the other (tr
// serialises the injections anyway). It returns the copies, in tmpls' order, each stopped
// in its ptrace-stop until the caller commits or aborts it (Revival.Commit, Abort). On
// error placed holds the copies made before tmpls[len(placed)] failed, which are the
// caller's to abort; the failing one's copy, if any, is killed and its template is as it
// was. Precondition: no template of tmpls is being revived meanwhile (the caller holds
// the family's template lock).
func Place(tr *remote.Tracer, tg *Target, ns int, tmpls []*Template, ptys []string) (placed []*Revival, err error) {
	for i, t := range tmpls {
		r, err := SeizeTemplate(tr, t)
		if err != nil {
			return placed, err
		}
		if err := r.ReviveInto(tg, ns, ptys[i]); err != nil {
			if aerr := r.Abort(); aerr != nil {
				err = fmt.Errorf("%w; undoing it: %v", err, aerr)
			}
			return placed, err
		}
		placed = append(placed, r)
	}
	return placed, nil
}

// ReviveInto is Revive into the branch tg: the copy has the template's PID in tg's PID
// namespace and is on the state ns of the branch (a mount namespace the branch init
// made). Same undo as Revive: on error the copy is killed and the template is as it was.
func (r *Revival) ReviveInto(tg *Target, ns int, ptyPath string) error {
	caps, err := readCaps(r.Tmpl.HostPid)
	if err != nil {
		return fmt.Errorf("the template of %d: %w", r.Tmpl.Pid, err)
	}
	var child *remote.Tracee
	err = r.tr.Do(func() error {
		var err error
		child, err = r.forkInto(tg, caps, ns, ptyPath)
		if perr := r.tt.Restore(); err == nil && perr != nil {
			err = fmt.Errorf("put the template back: %w", perr)
		}
		return err
	})
	r.tt = nil
	if err != nil {
		if child != nil {
			_ = child.Kill()
		}
		return err
	}
	r.child, r.HostPid = child, child.Pid()
	return nil
}

// forkInto is ReviveInto's work on the tracer's thread. Precondition: inside Do.
func (r *Revival) forkInto(tg *Target, caps capSets, ns int, ptyPath string) (child *remote.Tracee, err error) {
	if err := setnsFD(r.tt, tg.PID, unix.CLONE_NEWPID, "the branch's PID namespace"); err != nil {
		return nil, fmt.Errorf("template of %d: %w", r.Tmpl.Pid, err)
	}
	defer func() {
		if berr := setnsFD(r.tt, tg.Home, unix.CLONE_NEWPID, "its own PID namespace again"); berr != nil {
			err = errors.Join(err, fmt.Errorf("template of %d: %w", r.Tmpl.Pid, berr))
		}
	}()
	child, err = cloneAt(r.tt, r.Tmpl.Pid)
	if err != nil {
		return nil, fmt.Errorf("fork the template with pid %d into the branch: %w", r.Tmpl.Pid, err)
	}
	if tg.Place != nil {
		if err := tg.Place(child.Pid()); err != nil {
			return child, fmt.Errorf("the branch's cgroups: %w", err)
		}
	}
	// The branch's namespaces and its state's mount namespace, over one hand-over and
	// in the move's own batch: the user namespace first (the others are owned by it).
	nss := []struct {
		fd   int
		kind uintptr
		name string
	}{
		{tg.User, unix.CLONE_NEWUSER, "the branch's user namespace"},
		{tg.Net, unix.CLONE_NEWNET, "the branch's network namespace"},
		{tg.IPC, unix.CLONE_NEWIPC, "the branch's IPC namespace"},
		{tg.UTS, unix.CLONE_NEWUTS, "the branch's UTS namespace"},
		{tg.Cgroup, unix.CLONE_NEWCGROUP, "the branch's cgroup namespace"},
	}
	fds := make([]int, 0, len(nss)+1)
	for _, n := range nss {
		fds = append(fds, n.fd)
	}
	h, err := handFDs(child, append(fds, ns))
	if err != nil {
		return child, fmt.Errorf("hand over the branch's namespaces: %w", err)
	}
	var b remote.Batch
	h.openCalls(&b)
	for _, n := range nss {
		h.recvNext(&b, n.name)
		b.Add("setns "+n.name, unix.SYS_SETNS, h.tx, n.kind)
		b.Add("close the namespace fd", unix.SYS_CLOSE, h.tx)
	}
	h.recvNext(&b, "the branch state's mount namespace")
	h.closeRx(&b)
	maps := moveCalls(&b, &r.Tmpl.Proc, h.tx)
	dumpable := r.Tmpl.Dumpable
	if dumpable != 1 {
		dumpable = 0
	}
	b.Add("dumpable as it was", unix.SYS_PRCTL, unix.PR_SET_DUMPABLE, dumpable, 0, 0, 0)
	b.Add("setsid", unix.SYS_SETSID)
	terminalCalls(&b, &r.Tmpl.Proc, ptyPath)
	lockCalls(&b, &r.Tmpl.Proc)
	caps.calls(&b)
	res, err := child.RunBatch(&b)
	if err != nil {
		h.cleanup(child)
		return child, err
	}
	if err := checkMaps(res, maps, r.Tmpl.Maps); err != nil {
		return child, err
	}
	return child, giveBack(child, r.Tmpl)
}

// setnsFD hands fd to t and makes t enter it (kind: CLONE_NEW*).
// Precondition: inside Do.
func setnsFD(t *remote.Tracee, fd int, kind uintptr, what string) error {
	h, err := handFD(t, fd)
	if err != nil {
		return fmt.Errorf("hand over %s: %w", what, err)
	}
	var b remote.Batch
	h.recvCalls(&b)
	b.Add("setns "+what, unix.SYS_SETNS, h.tx, kind)
	b.Add("close the namespace fd", unix.SYS_CLOSE, h.tx)
	if _, err := t.RunBatch(&b); err != nil {
		h.cleanup(t)
		return fmt.Errorf("enter %s: %w", what, err)
	}
	return nil
}

// capSets are a process's capability sets (/proc/PID/status), one bit per capability.
type capSets struct{ inh, prm, eff, bnd, amb uint64 }

func readCaps(hostPid int) (capSets, error) {
	var c capSets
	b, err := os.ReadFile("/proc/" + strconv.Itoa(hostPid) + "/status")
	if err != nil {
		return c, err
	}
	found := 0
	for _, l := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(l, ":")
		if !ok {
			continue
		}
		var dst *uint64
		switch k {
		case "CapInh":
			dst = &c.inh
		case "CapPrm":
			dst = &c.prm
		case "CapEff":
			dst = &c.eff
		case "CapBnd":
			dst = &c.bnd
		case "CapAmb":
			dst = &c.amb
		default:
			continue
		}
		if *dst, err = strconv.ParseUint(strings.TrimSpace(v), 16, 64); err != nil {
			return c, fmt.Errorf("status %s: %q", k, v)
		}
		found++
	}
	if found != 5 {
		return c, fmt.Errorf("status: %d of 5 capability sets", found)
	}
	return c, nil
}

// lastCap is the kernel's last capability (/proc/sys/kernel/cap_last_cap), read once:
// calls' loops asked for it at each step, 84 reads of the file per copy placed, half of
// the daemon's CPU in a placement (perf, 64 branches), which runs one branch after the
// other on a fork's critical path.
var lastCap = sync.OnceValue(func() int {
	b, err := os.ReadFile("/proc/sys/kernel/cap_last_cap")
	if err == nil {
		if n, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil {
			return n
		}
	}
	return unix.CAP_LAST_CAP
})

// calls appends the calls that bring a copy that has just entered a user namespace (a
// full set) back to c: the bounding set first (PR_CAPBSET_DROP needs CAP_SETPCAP, which
// the full set has), then capset, then the ambient set.
func (c capSets) calls(b *remote.Batch) {
	for n := 0; n <= lastCap(); n++ {
		if c.bnd&(1<<n) == 0 {
			b.Add(fmt.Sprintf("drop capability %d from the bounding set", n), unix.SYS_PRCTL, unix.PR_CAPBSET_DROP, n, 0, 0, 0)
		}
	}
	hdr := make([]byte, 8)
	binary.LittleEndian.PutUint32(hdr, unix.LINUX_CAPABILITY_VERSION_3)
	data := make([]byte, 24) // two struct __user_cap_data_struct {effective, permitted, inheritable}
	for i := 0; i < 2; i++ {
		binary.LittleEndian.PutUint32(data[12*i:], uint32(c.eff>>(32*i)))
		binary.LittleEndian.PutUint32(data[12*i+4:], uint32(c.prm>>(32*i)))
		binary.LittleEndian.PutUint32(data[12*i+8:], uint32(c.inh>>(32*i)))
	}
	b.Add("capabilities as they were", unix.SYS_CAPSET, hdr, data)
	for n := 0; n <= lastCap(); n++ {
		if c.amb&(1<<n) != 0 {
			b.Add(fmt.Sprintf("ambient capability %d", n), unix.SYS_PRCTL, unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_RAISE, n, 0, 0)
		}
	}
}
