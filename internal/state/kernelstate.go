package state

import (
	"fmt"
	"strings"

	"golang.org/x/sys/unix"

	"deltabox/internal/errdefs"
	"deltabox/internal/sandbox"
	"deltabox/internal/sbinit"
	"deltabox/internal/store"
)

// The kernel state a sandbox's processes share besides files and processes, and what a
// checkpoint and a restore do with it (issue 14: a restore gives back exactly what the
// checkpoint held, or the operation refuses and changes nothing). A template is a fork,
// which shares all of it with the live process instead of copying it, so none of it
// came back by itself: a restored process saw semaphore values set after its
// checkpoint, objects made after it, a later hostname.
//
//   - System V IPC (message queues, semaphore sets, shared memory segments) lives in
//     the sandbox's IPC namespace. A checkpoint refuses (409, naming each object and how
//     to remove it) while the namespace holds any, and a restore removes every one, just
//     before the node's processes resume: a node is made with none, and gets none back.
//     Recording them was possible: /proc/sys/kernel/{msg,sem,shm}_next_id, which CRIU
//     uses, does give an object its old id in the sandbox's namespace (checked here on
//     Linux 6.18). It was not done because the rest cannot be given back: a process's
//     semaphore undo list (SEM_UNDO) is not copied by fork and cannot be read from
//     outside, so a restored process would never release at its exit what it holds;
//     timestamps and last PIDs (ipcs -t, -p) cannot be set; a segment's content would be
//     copied at every checkpoint (fork gives templates and live process the one
//     segment). Agents' programs rarely use System V IPC (Python's multiprocessing
//     uses POSIX semaphores in /dev/shm, which are files, and a process with System V
//     memory attached is refused by the fast path already).
//   - POSIX message queues (mq_open) live in the IPC namespace too, not in files: the
//     same refusal and removal. Their messages cannot even be read without taking them
//     off the queue.
//   - The host and domain names (the UTS namespace) are recorded with the node at the
//     checkpoint and set back at a restore by the sandbox that made the node (recorded
//     with the node's templates, so a daemon restart keeps them: restart.go). A restore
//     into another sandbox brings files only (as for processes): the sandbox then gets
//     the names it started with (its hostname, the daemon's domain name).
//   - Kernel keyrings belong to no namespace of the sandbox: its processes cannot use
//     them (sbinit's seccomp filter refuses the calls: seccomp.go says why).
//
// Both are read and changed from the daemon, on a thread that enters the sandbox's IPC
// and UTS namespaces for the call (sbinit.NS; sb.kns). On the critical path of every
// checkpoint (step 1) and restore (publish): 0.04-0.06 ms each, p50 of 50 interleaved
// pairs on a busy 2-core VM (the phases seize and publish, files only; a round trip to
// init costs 0.2-0.3 ms). Between a
// checkpoint's seizure and its answer, and between a restore's kill and its processes'
// resumption, no process of the sandbox runs (what a checkpoint's step 3 kills excepted,
// hence its second look), so what is read and set is what the node holds.

// openKernelNS opens rt's IPC and UTS namespaces (its init's).
func openKernelNS(rt *sandbox.Sandbox) (*sbinit.NS, error) {
	ns, err := sbinit.OpenNS(rt.InitPid())
	if err != nil {
		return nil, err
	}
	// init is the daemon's child: until it is reaped (Alive false after), its PID is
	// not reused, so the namespaces opened before are init's.
	if !rt.Alive() {
		ns.Close()
		return nil, fmt.Errorf("the sandbox's init is gone")
	}
	return ns, nil
}

// kernelState reads s's names, and refuses (409) while its IPC namespace holds System
// V objects or POSIX message queues. Precondition: s.opMu held, the sandbox's processes seized.
// +checklocks:s.opMu
func (m *Manager) kernelState(s *sb) (sbinit.UTS, error) {
	st, err := s.kns.State()
	if err != nil {
		return sbinit.UTS{}, fmt.Errorf("read the sandbox's IPC and UTS namespaces: %w", err)
	}
	if len(st.IPC) == 0 {
		return st.UTS, nil
	}
	var names []string
	for i, o := range st.IPC {
		if i == 8 {
			names = append(names, fmt.Sprintf("and %d more", len(st.IPC)-i))
			break
		}
		names = append(names, o.String())
	}
	return sbinit.UTS{}, fmt.Errorf("sandbox %s holds IPC objects, which a checkpoint does not keep (a restore could not give back their contents, nor the semaphores a process holds): %s; remove them first (ipcrm -a removes every System V object, ipcrm -q, -s or -m ID one; mq_unlink a POSIX message queue), or use shared memory and semaphores that are files (shm_open, sem_open: /dev/shm, which a checkpoint keeps): %w",
		s.rec.ID, strings.Join(names, ", "), errdefs.ErrConflict)
}

// resetKernelState gives s the kernel state of node: no IPC object, and the names
// the node recorded if s made it in this daemon's run, else the names s started with.
// Precondition: s.opMu held; no process of the sandbox runs (a restore's publish,
// before the revived processes resume). Nothing here fails the restore: an error is
// logged.
// +checklocks:s.opMu
func (m *Manager) resetKernelState(s *sb, node string) {
	m.resetKNS(s.kns, s.rec, node)
}

// resetKNS is resetKernelState of kns, the IPC and UTS namespaces of sandbox rec's
// runtime (its current one, or a spare's: spares.go).
func (m *Manager) resetKNS(kns *sbinit.NS, rec store.Sandbox, node string) {
	m.mu.Lock()
	var uts *sbinit.UTS
	if n := m.nodes[node]; n != nil && n.Sandbox == rec.ID {
		uts = n.uts
	}
	m.mu.Unlock()
	if uts == nil {
		var u unix.Utsname
		_ = unix.Uname(&u) // the daemon's: what a new sandbox's UTS namespace copies
		uts = &sbinit.UTS{Hostname: rec.Hostname, Domainname: unix.ByteSliceToString(u.Domainname[:])}
	}
	removed, err := kns.Reset(*uts)
	if err != nil {
		m.log.Error("restore: reset the sandbox's IPC and UTS namespaces", "sandbox", rec.ID, "node", node, "err", err)
	}
	if len(removed) > 0 {
		m.log.Info("restore: IPC objects made after the node removed", "sandbox", rec.ID, "node", node, "count", len(removed))
	}
}

// forgetKernelState drops the names recorded for the nodes sandbox id made (it is
// removed: a sandbox made later with its id is another one).
func (m *Manager) forgetKernelState(id string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, n := range m.nodes {
		if n.Sandbox == id {
			n.uts = nil
		}
	}
}
