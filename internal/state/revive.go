package state

import (
	"errors"
	"fmt"
	"sort"

	"golang.org/x/sys/unix"

	"deltabox/internal/errdefs"
	"deltabox/internal/fastpath"
	"deltabox/internal/session"
)

// revival is one template being brought back into its session at a restore.
type revival struct {
	pt      *procTemplate
	sess    *session.Session
	old     *session.Session // a dead session of that name that sess replaces
	created bool             // sess was made for this restore (NewDetached)
	pts     string
	// peer holds the terminal's slave open from before the kill until the session is
	// rebound: when the last holder of a slave goes (the killed live process, if no
	// template holds that terminal), reads on the master fail with EIO and the session
	// stops reading it for good.
	peer int
	r    *fastpath.Revival
	exit <-chan unix.WaitStatus
}

// prepareRevivals does, before the live processes are killed, everything a restore of
// the templates ts can check or prepare: each template seized (present and stopped),
// its session found or made with a terminal. On error everything is let go as it was.
// Precondition: s.opMu held.
// +checklocks:s.opMu
func (m *Manager) prepareRevivals(s *sb, ts []*procTemplate, fam *family) ([]*revival, error) {
	if len(ts) == 0 {
		return nil, nil
	}
	tr := m.tracer(s)
	if fam != nil { // the family's holder's templates (family.go: familyTemplates)
		tr = fam.tracer
	}
	var out []*revival
	for _, t := range ts {
		rv := &revival{pt: t, peer: -1}
		var err error
		if t.session != "" { // outside the sessions there is no terminal to find
			err = m.prepareSession(s, rv)
		}
		if err == nil {
			rv.r, err = fastpath.SeizeTemplate(tr, t.tmpl)
		}
		if err != nil {
			out = append(out, rv)
			return nil, withUndo(fmt.Errorf("%s: %v: %w", t.what, err, errdefs.ErrConflict), m.abortRevivals(s, out))
		}
		out = append(out, rv)
	}
	return out, nil
}

// prepareSession finds or makes the session rv's template belongs to, and holds its
// terminal's slave open (revival.peer). On error what it made is in rv for
// abortRevivals. Precondition: s.opMu held.
// +checklocks:s.opMu
func (m *Manager) prepareSession(s *sb, rv *revival) error {
	t := rv.pt
	var err error
	rv.sess, rv.old, rv.created, err = sessionToRevive(s, t.session, t.kind, t.argv)
	if err == nil {
		rv.pts, err = rv.sess.PtsPath()
	}
	if err == nil {
		rv.peer, err = rv.sess.OpenPeer()
	}
	return err
}

// reviveAll forks every template into its session's PID on the state whose namespace is ns; the new
// processes stay stopped until commitRevivals. afterFirst runs once the first is made.
// tg, for the templates of a fast fork's holder, is s's branch, where each is placed
// (fastpath.Revival.ReviveInto); nil forks them in place. On error the caller aborts
// (abortRevivals).
// +checklocks:s.opMu
func (m *Manager) reviveAll(s *sb, rvs []*revival, ns int, tg *fastpath.Target, afterFirst func() error) error {
	for i, rv := range rvs {
		// A fast fork's branch: the revived process is the family init's child, whose
		// exit the family's init reports (sandbox.Sandbox.WatchPlaced), known by its
		// host PID once forked (it is stopped until the commit).
		branch := s.rt.IsBranch()
		if rv.sess != nil && !branch {
			rv.exit = s.rt.Watch(rv.pt.tmpl.Pid)
		}
		revive := rv.r.Revive
		if tg != nil {
			revive = func(ns int, pts string) error { return rv.r.ReviveInto(tg, ns, pts) }
		}
		if err := revive(ns, rv.pts); err != nil {
			return fmt.Errorf("%s: %w", rv.pt.what, err)
		}
		if rv.sess != nil && branch {
			rv.exit = s.rt.WatchPlaced(rv.pt.tmpl.Pid, rv.r.HostPid)
		}
		if i == 0 {
			if err := afterFirst(); err != nil {
				return err
			}
		}
	}
	if len(rvs) == 0 {
		return afterFirst()
	}
	return nil
}

// sessionToRevive finds the session name of s for a process a restore brings back, or
// makes it (created) with no process: a live one of that kind is kept (its terminal and
// reader), a dead one or one of another kind is replaced (old, released once the restore commits: its terminal's reader
// may be gone). Precondition: s.opMu held.
// +checklocks:s.opMu
func sessionToRevive(s *sb, name string, kind session.Kind, argv []string) (sess, old *session.Session, created bool, err error) {
	s.mu.Lock()
	sess = s.sessions[name]
	s.mu.Unlock()
	if sess != nil && (!sess.Alive() || sess.Kind() != kind) {
		// Dead, or another kind of session under that name now (its driver would not
		// speak the restored process's protocol): replaced.
		old, sess = sess, nil
	}
	if sess == nil {
		if sess, err = session.NewDetached(s.rt, name, kind, argv); err != nil {
			return nil, old, false, err
		}
		created = true
	}
	return sess, old, created, nil
}

// abortRevivals kills what reviveAll made, parks the templates as they were, and drops
// the sessions made for the restore. Its error names the templates it could not park
// as they were.
// +checklocks:s.opMu
func (m *Manager) abortRevivals(s *sb, rvs []*revival) error {
	var errs []error
	for i := len(rvs) - 1; i >= 0; i-- {
		rv := rvs[i]
		if rv.r != nil {
			if err := rv.r.Abort(); err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", rv.pt.what, err))
			}
		}
		if rv.exit != nil {
			s.rt.Unwatch(rv.pt.tmpl.Pid)
		}
		if rv.created {
			rv.sess.Release()
		}
		if rv.peer >= 0 {
			unix.Close(rv.peer)
		}
	}
	return errors.Join(errs...)
}

// commitRevivals lets the revived processes run and binds each session to its process,
// with the checkpoint's termios and window size. It returns the sessions brought back,
// those that could not be resumed (they are ended), and what went wrong for each process
// that could not be.
// +checklocks:s.opMu
func (m *Manager) commitRevivals(s *sb, rvs []*revival) (restored, ended, errs []string) {
	for _, rv := range rvs {
		t := rv.pt
		if rv.sess == nil { // outside the sessions: it only resumes
			if err := rv.r.Commit(); err != nil {
				errs = append(errs, fmt.Sprintf("%s: %v", t.what, err))
			}
			continue
		}
		if rv.old != nil {
			rv.old.Release()
		}
		// The terminal's settings and log as they were, before the process resumes.
		rv.sess.RestoreTerm(t.term)
		err := rv.r.Commit()
		if err == nil {
			rv.sess.Rebind(t.tmpl.Pid, rv.exit)
			s.hostPids[t.tmpl.Pid] = rv.r.HostPid
		}
		unix.Close(rv.peer) // the process holds the slave now (or is gone)
		rv.peer = -1
		if err != nil {
			errs = append(errs, fmt.Sprintf("%s: %v", t.what, err))
			ended = append(ended, t.session)
			s.mu.Lock()
			if s.sessions[t.session] == rv.sess {
				delete(s.sessions, t.session)
			}
			s.ended[t.session] = "ended: its restored process could not be resumed: " + err.Error()
			s.mu.Unlock()
			rv.sess.Release()
			continue
		}
		s.mu.Lock()
		s.sessions[t.session] = rv.sess
		delete(s.ended, t.session)
		s.mu.Unlock()
		restored = append(restored, t.session)
	}
	sort.Strings(restored)
	sort.Strings(ended)
	return restored, ended, errs
}
