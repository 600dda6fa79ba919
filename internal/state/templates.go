package state

import (
	"fmt"
	"time"

	"deltabox/internal/errdefs"
	"deltabox/internal/fastpath"
	"deltabox/internal/session"
)

// procTemplate is one frozen process at a node: a session's, or (session "") one outside
// the sessions.
type procTemplate struct {
	session string
	what    string // "session NAME" or "process PID (COMM)", for messages
	kind    session.Kind
	argv    []string
	sandbox string
	tmpl    *fastpath.Template
	term    session.TermState // its session's terminal at the checkpoint
	parked  bool              // on its node's read-only view (views.go); under the sandbox's tmplMu
	// rssAnon is its anonymous resident memory (RssAnon), read once (fitKernelLimit), or
	// for a lazily restored one the bytes of its image's pages, which it comes to hold: a
	// stopped process's never changes. Under the sandbox's limitMu.
	rssAnon int64
}

// sandboxTemplates returns every template s holds, at any node.
func (m *Manager) sandboxTemplates(s *sb) []*fastpath.Template {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []*fastpath.Template
	for _, ts := range m.templates {
		for _, t := range ts {
			if t.sandbox == s.rec.ID {
				out = append(out, t.tmpl)
			}
		}
	}
	return out
}

// templatesFor returns node's templates usable in sandbox s, and an error if one of them
// is gone (its process state is lost: the restore must not pretend otherwise).
func (m *Manager) templatesFor(s *sb, node string) ([]*procTemplate, error) {
	if !m.fastPath(s) {
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
		if !templateAlive(t.tmpl) {
			return nil, fmt.Errorf("the process template of %s at node %s (pid %d) is gone (killed from inside the sandbox?): that node's process state is lost; restore another node, or remove this one: %w", t.what, node, t.tmpl.Pid, errdefs.ErrConflict)
		}
	}
	return ts, nil
}

// templateAlive reports whether a template is there (fastpath.Template.WaitStopped: a
// template just let go is on its way back into its stop, not gone).
func templateAlive(t *fastpath.Template) bool { return t.WaitStopped(time.Second) }

// nodeHasTemplatesElsewhere reports whether node has templates in another sandbox than
// s (a restore into s then carries files only: a fork cannot cross PID namespaces).
func (m *Manager) nodeHasTemplatesElsewhere(s *sb, node string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, t := range m.templates[node] {
		if t.sandbox != s.rec.ID {
			return true
		}
	}
	return false
}

// hasTemplatesIn reports whether node has templates in s (alive or not: a dead one is
// found at the restore).
func (m *Manager) hasTemplatesIn(s *sb, node string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, t := range m.templates[node] {
		if t.sandbox == s.rec.ID {
			return true
		}
	}
	return false
}

// dropTemplatesLocked kills the templates of nodes (removed nodes). Precondition: m.mu.
// +checklocks:m.mu
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
	m.dropSandboxTemplatesLocked(id)
}

// dropSandboxTemplatesLocked is dropSandboxTemplates. Precondition: m.mu held.
// +checklocks:m.mu
func (m *Manager) dropSandboxTemplatesLocked(id string) {
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

// dropNodeTemplates kills and forgets node's templates in s (gone ones, before its
// durable image replaces them). Precondition: s.tmplMu held.
// +checklocks:s.tmplMu
func (m *Manager) dropNodeTemplates(s *sb, node string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	var keep []*procTemplate
	for _, t := range m.templates[node] {
		if t.sandbox == s.rec.ID {
			t.tmpl.Kill()
			continue
		}
		keep = append(keep, t)
	}
	if len(keep) == 0 {
		delete(m.templates, node)
	} else {
		m.templates[node] = keep
	}
}
