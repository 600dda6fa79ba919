package state

import (
	"os"
	"path/filepath"

	"deltabox/internal/fastpath"
	"deltabox/internal/overlay"
	"deltabox/internal/remote"
	"deltabox/internal/sandbox"
)

// Templates parked on a read-only view. A template is forked on the state its process
// was on; after the checkpoint that state's read-write overlay has the now frozen
// layer's directory as its upper, and a template left there would keep that overlay
// mounted in its namespace for the node's lifetime. So once the checkpoint has answered,
// the node's templates are moved (fastpath.Park) onto a read-only view of the node's
// layers: an overlay of the node's lowers without an upper, in a mount namespace of its
// own, built once per node with the sandbox's namespace builder. The daemon closes its
// fds on the view as soon as the templates are in it: the templates' namespace keeps it
// alive, and it goes with the last of them.
//
// Parking runs in the background, without opMu (an exec need not wait for it); it takes
// s.tmplMu per template, which a restore holds while it forks from templates, so a
// template is never seized by both.

// parkTemplates parks node's templates tps of sandbox s, after the answer. Precondition:
// s.opMu held (it reads s.rt and the tracer).
// +checklocks:s.opMu
func (m *Manager) parkTemplates(s *sb, node string, tps []*procTemplate) {
	if len(tps) == 0 || s.rt == nil {
		return
	}
	rt, tr := s.rt, m.tracer(s)
	m.mu.Lock()
	n := m.nodes[node]
	var image string
	if n != nil {
		image = n.Image
	}
	m.mu.Unlock()
	if n == nil {
		return
	}
	m.afterAnswer(s, func() {
		if err := m.park(s, rt, tr, image, node, tps); err != nil {
			// An unparked template keeps the read-write overlay it was forked on alive.
			m.log.Warn("park templates", "sandbox", s.rec.ID, "node", node, "err", err)
		}
		// Recorded once parked: a template found by the next daemon is then where a
		// recorded one is (restart.go).
		m.recordTemplates(s, node, tps)
		m.keepSessions(s)
	})
}

func (m *Manager) park(s *sb, rt *sandbox.Sandbox, tr *remote.Tracer, image, node string, tps []*procTemplate) error {
	spec, err := m.spec(image, node, 0)
	if err != nil {
		return err
	}
	lowers := spec.Lowers
	if len(lowers) == 1 {
		// A node on its bare image (nothing changed before its checkpoint): overlayfs
		// wants two lowers without an upper, so an empty directory goes under the image.
		empty := filepath.Join(m.st.Root, "tmp", "empty-lower")
		if err := os.MkdirAll(empty, 0o755); err != nil {
			return err
		}
		lowers = append(lowers[:1:1], empty)
	}
	view, err := rt.BuildState(overlay.Spec{Lowers: lowers})
	if err != nil {
		return err
	}
	defer view.Close() // the parked templates keep the namespace
	var first error
	for _, t := range tps {
		s.tmplMu.Lock()
		if !t.parked && templateAlive(t.tmpl) {
			m.copyForImage(s, tr, node, t) // before the parking: durable.go says why
			err = fastpath.Park(tr, t.tmpl, view.NS)
			t.parked = err == nil
		}
		s.tmplMu.Unlock()
		if err != nil && first == nil {
			first = err
		}
	}
	return first
}
