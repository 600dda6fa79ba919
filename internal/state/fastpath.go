package state

import (
	"fmt"
	"os"
	"sort"
	"strconv"

	"golang.org/x/sys/unix"

	"deltabox/internal/errdefs"
	"deltabox/internal/fastpath"
	"deltabox/internal/remote"
	"deltabox/internal/session"
)

// Process state (DeltaCR's fast path, package fastpath): at a checkpoint every bash or
// python session forks into a template kept stopped at the node; at a restore of that
// node in the same sandbox, the live session processes are killed and the templates fork
// again with the same PIDs. Templates live in the sandbox that made them (a fork cannot
// leave its PID namespace), so restoring a node into another sandbox, or after a daemon
// restart (which ends every process), carries its files only and ends the sessions.
// Processes not in a session (background jobs an exec left behind) are ended at a
// checkpoint, as before. DELTABOX_FASTPATH=0 turns the fast path off.

// procTemplate is one session's frozen process at a node.
type procTemplate struct {
	session string
	kind    session.Kind
	argv    []string
	sandbox string
	tmpl    *fastpath.Template
	termios *unix.Termios
	winsize *unix.Winsize
}

// liveSession is a session process about to be checkpointed.
type liveSession struct {
	name string
	sess *session.Session
	proc *fastpath.Proc
}

func fastPathOn() bool { return os.Getenv("DELTABOX_FASTPATH") != "0" }

// inspectSessions checks that every running session can be checkpointed with its state,
// before anything changes. Precondition: s.opMu held, no exec running.
func (m *Manager) inspectSessions(s *sb) ([]liveSession, error) {
	if !fastPathOn() {
		return nil, nil
	}
	s.mu.Lock()
	var names []string
	for name, sess := range s.sessions {
		if sess.Alive() {
			names = append(names, name)
		}
	}
	sess := map[string]*session.Session{}
	for _, n := range names {
		sess[n] = s.sessions[n]
	}
	s.mu.Unlock()
	if len(names) == 0 {
		return nil, nil
	}
	sort.Strings(names)
	hostPids, err := s.rt.Pids()
	if err != nil {
		return nil, err
	}
	var out []liveSession
	for _, n := range names {
		host, err := fastpath.HostPid(hostPids, sess[n].Pid())
		if err != nil {
			return nil, fmt.Errorf("session %s: %w", n, err)
		}
		p, err := fastpath.Inspect(host)
		if err != nil {
			return nil, fmt.Errorf("session %s: %v; end it (deltabox session kill) or wait for the durable path: %w", n, err, errdefs.ErrConflict)
		}
		out = append(out, liveSession{name: n, sess: sess[n], proc: p})
	}
	return out, nil
}

// keepPids are the sandbox PIDs a kill must spare: the live sessions being checkpointed
// and every template of this sandbox.
func (m *Manager) keepPids(s *sb, live []liveSession) []int {
	var keep []int
	for _, l := range live {
		keep = append(keep, l.proc.Pid)
	}
	m.mu.Lock()
	for _, ts := range m.templates {
		for _, t := range ts {
			if t.sandbox == s.rec.ID {
				keep = append(keep, t.tmpl.SelfPid)
			}
		}
	}
	m.mu.Unlock()
	return keep
}

// tracer returns the sandbox's ptrace owner thread.
func (m *Manager) tracer(s *sb) *remote.Tracer {
	if s.tracer == nil {
		s.tracer = remote.NewTracer()
	}
	return s.tracer
}

// holdState makes the sandbox's current state namespace reachable from inside it, for
// injected setns: init keeps an fd on it, at /proc/1/fd/N.
func (m *Manager) holdState(s *sb) (string, func(), error) {
	ns, err := s.rt.StateNS()
	if err != nil {
		return "", nil, err
	}
	defer unix.Close(ns)
	n, err := s.rt.HoldFD(ns)
	if err != nil {
		return "", nil, err
	}
	return "/proc/1/fd/" + strconv.Itoa(n), func() { s.rt.ReleaseFD(n) }, nil
}

// forkTemplates forks every live session into a template and moves it onto the
// sandbox's current state. On failure the templates made are killed and every session
// is ended (never left half-moved); the error says so. Precondition: s.opMu held, the
// new state installed.
func (m *Manager) forkTemplates(s *sb, live []liveSession) ([]*procTemplate, error) {
	if len(live) == 0 {
		return nil, nil
	}
	nsPath, release, err := m.holdState(s)
	if err != nil {
		return nil, err
	}
	defer release()
	tr := m.tracer(s)
	var out []*procTemplate
	for _, l := range live {
		t, err := fastpath.Checkpoint(tr, l.proc, nsPath)
		if err != nil {
			for _, o := range out {
				o.tmpl.Kill()
			}
			m.endSessions(s, "ended: its process could not be checkpointed: "+err.Error())
			return nil, fmt.Errorf("session %s: %w", l.name, err)
		}
		pt := &procTemplate{session: l.name, kind: l.sess.Kind(), argv: l.sess.Info().Argv, sandbox: s.rec.ID, tmpl: t}
		if tio, err := unix.IoctlGetTermios(int(l.sess.Master().Fd()), unix.TCGETS); err == nil {
			pt.termios = tio
		}
		if ws, err := unix.IoctlGetWinsize(int(l.sess.Master().Fd()), unix.TIOCGWINSZ); err == nil {
			pt.winsize = ws
		}
		out = append(out, pt)
	}
	return out, nil
}

// templatesFor returns node's templates usable in sandbox s, and an error if one of them
// is gone (its process state is lost: the restore must not pretend otherwise).
func (m *Manager) templatesFor(s *sb, node string) ([]*procTemplate, error) {
	if !fastPathOn() {
		return nil, nil
	}
	m.mu.Lock()
	var ts []*procTemplate
	for _, t := range m.templates[node] {
		if t.sandbox == s.rec.ID {
			ts = append(ts, t)
		}
	}
	m.mu.Unlock()
	for _, t := range ts {
		if !t.tmpl.Alive() {
			return nil, fmt.Errorf("the process template of session %s at node %s (pid %d) is gone (killed from inside the sandbox?): that node's process state is lost; restore another node, or remove this one: %w", t.session, node, t.tmpl.Pid, errdefs.ErrConflict)
		}
	}
	return ts, nil
}

// restoreTemplates forks every template into the session it belongs to, on the
// sandbox's current state. A session that cannot be restored is ended and named in the
// returned errors. Precondition: s.opMu held, the live processes killed and reaped.
func (m *Manager) restoreTemplates(s *sb, ts []*procTemplate) []string {
	if len(ts) == 0 {
		return nil
	}
	var errs []string
	nsPath, release, err := m.holdState(s)
	if err != nil {
		return []string{err.Error()}
	}
	defer release()
	tr := m.tracer(s)
	for _, t := range ts {
		s.mu.Lock()
		sess := s.sessions[t.session]
		s.mu.Unlock()
		if sess == nil {
			var err error
			if sess, err = session.NewDetached(s.rt, t.session, t.kind, t.argv); err != nil {
				errs = append(errs, fmt.Sprintf("session %s: %v", t.session, err))
				continue
			}
			s.mu.Lock()
			s.sessions[t.session] = sess
			delete(s.ended, t.session)
			s.mu.Unlock()
		}
		pts, err := sess.PtsPath()
		if err == nil {
			exit := s.rt.Watch(t.tmpl.Pid)
			if _, err = fastpath.Restore(tr, t.tmpl, nsPath, pts); err != nil {
				s.rt.Unwatch(t.tmpl.Pid)
			} else {
				master := int(sess.Master().Fd())
				if t.termios != nil {
					unix.IoctlSetTermios(master, unix.TCSETS, t.termios)
				}
				if t.winsize != nil {
					unix.IoctlSetWinsize(master, unix.TIOCSWINSZ, t.winsize)
				}
				sess.Rebind(t.tmpl.Pid, exit)
				continue
			}
		}
		errs = append(errs, fmt.Sprintf("session %s: %v", t.session, err))
		s.mu.Lock()
		delete(s.sessions, t.session)
		s.ended[t.session] = "ended: its process could not be restored: " + err.Error()
		s.mu.Unlock()
		sess.Release()
	}
	return errs
}

// dropTemplates kills the templates of nodes (removed nodes).
func (m *Manager) dropTemplatesLocked(nodes []string) {
	for _, n := range nodes {
		for _, t := range m.templates[n] {
			t.tmpl.Kill()
		}
		delete(m.templates, n)
	}
}

// dropSandboxTemplates forgets the templates a removed sandbox held (they died with it).
func (m *Manager) dropSandboxTemplates(id string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for n, ts := range m.templates {
		var keep []*procTemplate
		for _, t := range ts {
			if t.sandbox != id {
				keep = append(keep, t)
			}
		}
		if len(keep) == 0 {
			delete(m.templates, n)
		} else {
			m.templates[n] = keep
		}
	}
}
