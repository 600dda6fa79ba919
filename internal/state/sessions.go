package state

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"regexp"
	"sort"

	"deltabox/internal/apitypes"
	"deltabox/internal/errdefs"
	"deltabox/internal/sandbox"
	"deltabox/internal/session"
)

// DefaultSession is the bash session that exec --session uses when none is named
// explicitly; it is started on first use.
const DefaultSession = "main"

// SessionOptions describes a session to start. The wire form is defined once, in
// apitypes.
type SessionOptions = apitypes.SessionOptions

var sessionNameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$`)

// Sessions of a sandbox live in sb.sessions (guarded by sb.mu). A checkpoint keeps their
// processes (templates), and a restore brings back the ones its node holds; a session
// whose process a restore ended without bringing one back (the node had none for it), or
// that a failed restore ended, moves to sb.ended with the reason, and a bash or python
// session is started again, fresh, on its next call (the result says session_restarted).

// StartSession starts a named session.
func (m *Manager) StartSession(ctx context.Context, id string, o SessionOptions) (*session.Info, error) {
	if !sessionNameRE.MatchString(o.Name) {
		return nil, fmt.Errorf("session name %q: use 1-63 of A-Z a-z 0-9 . _ -: %w", o.Name, errdefs.ErrInvalid)
	}
	if o.Kind == "" {
		o.Kind = session.Bash
		if len(o.Argv) > 0 {
			o.Kind = session.Command
		}
	}
	s, err := m.get(id)
	if err != nil {
		return nil, err
	}
	s.opMu.Lock()
	defer s.opMu.Unlock()
	if err := m.checkLive(s); err != nil {
		return nil, err
	}
	s.mu.Lock()
	if old, ok := s.sessions[o.Name]; ok && old.Alive() {
		s.mu.Unlock()
		return nil, fmt.Errorf("session %s already runs in %s (kill it first): %w", o.Name, id, errdefs.ErrConflict)
	}
	s.mu.Unlock()
	sess, err := m.startSession(s, o)
	if err != nil {
		return nil, err
	}
	in := sess.Info()
	return &in, nil
}

// startSession starts o in s. Precondition: s.opMu held (no state switch meanwhile).
// +checklocks:s.opMu
func (m *Manager) startSession(s *sb, o SessionOptions) (*session.Session, error) {
	release, err := m.reserveSession(s, o.Name)
	if err != nil {
		return nil, err
	}
	defer release() // after the session is in s.sessions, where the caps count it
	dir := o.Dir
	if !filepath.IsAbs(dir) { // "" too: the workdir, as for exec
		dir = filepath.Join(s.rec.Workdir, dir)
	}
	sess, err := session.Start(s.rt, o.Name, o.Kind, o.Argv, dir, o.Env)
	if err != nil {
		return nil, fmt.Errorf("%v: %w", err, errdefs.ErrInvalid)
	}
	s.mu.Lock()
	if old := s.sessions[o.Name]; old != nil {
		old.Close()
	}
	s.sessions[o.Name] = sess
	s.sessionOpts[o.Name] = o
	delete(s.ended, o.Name)
	s.mu.Unlock()
	m.keepSessions(s)
	return sess, nil
}

// reserveSession takes a place for a session named name in s within the session caps
// (Config.MaxSessionsPerSandbox, MaxSessions), or refuses it: each session holds a
// terminal, a goroutine and up to 1 MiB of output in the daemon. A session that
// replaces one of the same name takes no new place. The caller releases the place once
// the session is in s.sessions (or failed to start). Precondition: s.opMu held, so
// that s's own count cannot change meanwhile; starts in other sandboxes count through
// sessionStarts.
func (m *Manager) reserveSession(s *sb, name string) (release func(), err error) {
	perSB, total := m.cfg.MaxSessionsPerSandbox, m.cfg.MaxSessions
	if perSB <= 0 {
		perSB = DefaultMaxSessionsPerSandbox
	}
	if total <= 0 {
		total = DefaultMaxSessions
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	own, all := 0, m.sessionStarts
	for _, o := range m.sandboxes {
		o.mu.Lock()
		n := len(o.sessions)
		if o == s {
			if _, ok := o.sessions[name]; ok {
				n--
			}
			own = n
		}
		o.mu.Unlock()
		all += n
	}
	if own >= perSB {
		return nil, fmt.Errorf("sandbox %s holds %d sessions, its limit (the daemon's DELTABOX_MAX_SESSIONS_PER_SANDBOX): kill the sessions it no longer needs (deltabox session kill %s NAME; DELETE /v1/sandboxes/%s/sessions/NAME): %w",
			s.rec.ID, own, s.rec.ID, s.rec.ID, errdefs.ErrConflict)
	}
	if all >= total {
		return nil, fmt.Errorf("the daemon holds %d sessions, its limit (DELTABOX_MAX_SESSIONS): kill the sessions no longer needed, in this sandbox or others (deltabox session kill SANDBOX NAME), or remove sandboxes no longer used: %w",
			all, errdefs.ErrConflict)
	}
	m.sessionStarts++
	return func() {
		m.mu.Lock()
		m.sessionStarts--
		m.mu.Unlock()
	}, nil
}

// Sessions lists a sandbox's sessions, live and ended.
func (m *Manager) Sessions(id string) ([]session.Info, error) {
	s, err := m.get(id)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []session.Info
	for _, sess := range s.sessions {
		out = append(out, sess.Info())
	}
	for name, why := range s.ended {
		o := s.sessionOpts[name]
		out = append(out, session.Info{Name: name, Kind: o.Kind, Argv: o.Argv, Exit: why})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// SessionLogs returns the output a session printed that no call consumed.
func (m *Manager) SessionLogs(id, name string) ([]byte, error) {
	s, err := m.get(id)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	sess := s.sessions[name]
	s.mu.Unlock()
	if sess == nil {
		return nil, fmt.Errorf("no session %q in %s: %w", name, id, errdefs.ErrNotFound)
	}
	return sess.Logs(), nil
}

// KillSession ends a session.
func (m *Manager) KillSession(id, name string) error {
	s, err := m.get(id)
	if err != nil {
		return err
	}
	// After any checkpoint or restore in progress: one may hold the session's terminal
	// for a process it is moving or bringing back (criutrees.go, revive.go).
	s.opMu.Lock()
	defer s.opMu.Unlock()
	s.mu.Lock()
	sess := s.sessions[name]
	_, ended := s.ended[name]
	delete(s.sessions, name)
	delete(s.ended, name)
	delete(s.sessionOpts, name)
	s.mu.Unlock()
	if sess == nil && !ended {
		return fmt.Errorf("no session %q in %s: %w", name, id, errdefs.ErrNotFound)
	}
	if sess != nil {
		sess.Close()
	}
	m.keepSessions(s)
	return nil
}

// endSessions closes every session after a checkpoint or restore ended their
// processes, and returns their names, sorted. Precondition: s.opMu held.
func (m *Manager) endSessions(s *sb, why string) []string {
	return m.endSessionsExcept(s, nil, nil, why)
}

// endSessionsExcept ends the sessions that have no template in ts (their processes were
// killed), and returns their names, sorted; the others wait to be rebound to their
// restored process. Precondition: s.opMu.
func (m *Manager) endSessionsExcept(s *sb, ts []*procTemplate, trees *criuTrees, why string) []string {
	var ended []string
	keep := map[string]bool{}
	for _, t := range ts {
		keep[t.session] = true
	}
	for _, n := range trees.sessions() {
		keep[n] = true
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for name, sess := range s.sessions {
		if keep[name] {
			continue
		}
		sess.Release()
		s.ended[name] = why
		delete(s.sessions, name)
		ended = append(ended, name)
	}
	sort.Strings(ended)
	return ended
}

// sessionFor returns the session a call goes to, starting the default session or
// restarting an ended bash/python one. Precondition: s.opMu held.
// +checklocks:s.opMu
func (m *Manager) sessionFor(s *sb, name string) (*session.Session, bool, error) {
	s.mu.Lock()
	sess := s.sessions[name]
	o, known := s.sessionOpts[name]
	_, ended := s.ended[name]
	s.mu.Unlock()
	if sess != nil && sess.Alive() {
		return sess, false, nil
	}
	switch {
	case sess == nil && !known && name == DefaultSession:
		o = SessionOptions{Name: name, Kind: session.Bash}
	case !known:
		return nil, false, fmt.Errorf("no session %q in %s (start it with deltabox session start, or use %q): %w", name, s.rec.ID, DefaultSession, errdefs.ErrNotFound)
	case o.Kind == session.Command:
		return nil, false, fmt.Errorf("session %s runs a command, which takes no calls: %w", name, errdefs.ErrInvalid)
	}
	sess, err := m.startSession(s, o)
	return sess, ended || known, err
}

// execSession runs a call in a session. Precondition: the exec is registered (execs++)
// and s.opMu is released; sess was obtained under it.
func (m *Manager) execSession(ctx context.Context, sess *session.Session, r sandbox.ExecRequest) (*sandbox.ExecResult, error) {
	code := r.Argv[0]
	if len(r.Argv) > 1 {
		code = shellJoin(r.Argv)
	}
	var onOut func([]byte)
	if r.OnOutput != nil {
		onOut = func(b []byte) { r.OnOutput("stdout", b) }
	}
	res, err := sess.Run(ctx, code, r.Timeout, r.OutputLimit, onOut)
	if err != nil {
		switch {
		case errors.Is(err, session.ErrBusy):
			return nil, fmt.Errorf("%v: wait for it, or use another session: %w", err, errdefs.ErrConflict)
		case errors.Is(err, session.ErrNotCallable):
			return nil, fmt.Errorf("%v: %w", err, errdefs.ErrInvalid)
		}
		return nil, err
	}
	out := &sandbox.ExecResult{
		ExitCode: res.ExitCode, Signal: res.Signal, Stdout: res.Output, StdoutTruncated: res.Truncated,
		TimedOut: res.TimedOut, Duration: res.Duration,
		DurationMS: float64(res.Duration.Microseconds()) / 1000,
	}
	return out, nil
}

// shellJoin quotes argv for bash (a call given as several words).
func shellJoin(argv []string) string {
	var b []byte
	for i, a := range argv {
		if i > 0 {
			b = append(b, ' ')
		}
		b = append(b, '\'')
		for _, c := range []byte(a) {
			if c == '\'' {
				b = append(b, `'\''`...)
			} else {
				b = append(b, c)
			}
		}
		b = append(b, '\'')
	}
	return string(b)
}
