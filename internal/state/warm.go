package state

import (
	"time"

	"deltabox/internal/overlay"
	"deltabox/internal/sandbox"
	"deltabox/internal/store"
)

// Warm restore states. A restore's cost is mostly mounting the node's stack: overlayfs
// spends about 12 us per layer (0.8 ms at depth 50, measured), and a node's stack never
// changes. So the manager keeps, per sandbox, mounted states ready for recent nodes
// (the node's stack + a fresh empty upper + its namespace): after a checkpoint for the
// new node, after a restore for the node restored to (tree search comes back to the same
// nodes). A restore that finds one installs it instead of mounting; the next one is made
// in the background. They are sound by construction: every lower is frozen, the upper is
// empty and unused until installed. Bounded by Config.WarmMax per sandbox (default
// 256; 0 turns them off), least recently made first out.
//
// Concurrency: warm states are guarded by sb.prepMu and built under sb.buildMu, like the
// prepared next state (prepare.go); lock order m.treeMu -> buildMu -> prepMu -> m.mu
// (never m.mu -> prepMu).

type warmState struct {
	node  string
	upper uint64
	stack string
	state sandbox.State
	made  time.Time
}

// warmNode makes a warm restore state for node in the background. Precondition: s.opMu
// held (it reads s.rt).
// +checklocks:s.opMu
func (m *Manager) warmNode(s *sb, node string) {
	max := m.cfg.WarmMax
	if s.rt == nil || max == 0 {
		return
	}
	rt := s.rt
	m.afterAnswer(s, func() {
		s.buildMu.Lock()
		defer s.buildMu.Unlock()
		s.prepMu.Lock()
		if s.warmClosed || s.warm[node] != nil {
			s.prepMu.Unlock()
			return
		}
		m.mu.Lock()
		n := m.nodes[node]
		removing := n == nil || n.removing
		var image string
		if n != nil {
			image = n.Image
		}
		m.mu.Unlock()
		if removing {
			s.prepMu.Unlock()
			return
		}
		done := make(chan struct{})
		s.building, s.buildDone = node, done
		s.prepMu.Unlock()
		w := m.buildWarm(rt, image, node)
		s.prepMu.Lock()
		defer s.prepMu.Unlock()
		defer close(done)
		s.building, s.buildDone = "", nil
		if w == nil {
			return
		}
		if s.warmClosed || s.warm[node] != nil {
			m.dropWarm(w)
			return
		}
		for len(s.warm) >= max {
			m.evictOldestLocked(s)
		}
		s.warm[node] = w
	})
}

// buildWarm mounts a warm state of node (nil if it cannot). Precondition: s.buildMu
// held, node marked neither removed nor removing when it was taken (dropWarmNodes waits
// for buildMu).
func (m *Manager) buildWarm(rt *sandbox.Sandbox, image, node string) *warmState {
	spec, err := m.spec(image, node, 0)
	if err != nil {
		return nil
	}
	upper, err := m.freshUpper(spec.Lowers[0])
	if err != nil {
		return nil
	}
	st, err := rt.BuildState(overlay.Spec{Lowers: spec.Lowers, Upper: m.st.LayerDiff(upper), Work: m.st.LayerWork(upper)})
	if err != nil {
		_ = store.RemoveAll(m.st.LayerDir(upper)) // an unused layer: the start-up sweep removes it
		return nil
	}
	return &warmState{node: node, upper: upper, stack: stackKey(spec.Lowers), state: st, made: time.Now()}
}

// buildWait bounds how long a restore waits for a warm state being built (about a
// millisecond of mounts, normally).
const buildWait = time.Second

// takeWarm returns node's warm state if it matches the stack about to be mounted.
func (m *Manager) takeWarm(s *sb, node string, lowers []string) *warmState {
	s.prepMu.Lock()
	if s.warm[node] == nil && s.building == node {
		// Being built: it is nearer done than a mount made here would be.
		done := s.buildDone
		s.prepMu.Unlock()
		select {
		case <-done:
		case <-time.After(buildWait):
			// A mount here is no slower than what is left: go without it.
			m.log.Warn("a warm state being built took too long; the restore mounts its own", "node", node, "waited", buildWait)
		}
		s.prepMu.Lock()
	}
	defer s.prepMu.Unlock()
	w := s.warm[node]
	if w == nil {
		m.log.Debug("no warm state", "node", node, "have", len(s.warm))
		return nil
	}
	delete(s.warm, node)
	if w.stack != stackKey(lowers) {
		m.log.Debug("warm state does not fit", "node", node)
		m.dropWarm(w)
		return nil
	}
	return w
}

// evictOldestLocked drops the oldest warm state. Precondition: prepMu held.
// +checklocks:s.prepMu
func (m *Manager) evictOldestLocked(s *sb) {
	var old *warmState
	for _, w := range s.warm {
		if old == nil || w.made.Before(old.made) {
			old = w
		}
	}
	if old != nil {
		delete(s.warm, old.node)
		m.dropWarm(old)
	}
}

// dropWarm releases a warm state in the background.
func (m *Manager) dropWarm(w *warmState) {
	dir := m.st.LayerDir(w.upper)
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		w.state.Close()
		_ = store.RemoveAll(dir) // an unused layer: the start-up sweep removes it
	}()
}

// closeWarm drops every warm state and the prepared next state of s, for good, and stops
// new ones being made (sandbox removed or daemon stopping).
func (m *Manager) closeWarm(s *sb) {
	s.buildMu.Lock() // a build in flight uses s.rt, which goes next
	defer s.buildMu.Unlock()
	s.prepMu.Lock()
	defer s.prepMu.Unlock()
	s.warmClosed = true
	m.discardLocked(s) // a prepared next state made after discardNext
	for n, w := range s.warm {
		delete(s.warm, n)
		m.dropWarm(w)
	}
}

// dropWarmNodes synchronously releases the warm states of nodes about to be removed (their
// layers are deleted next). Precondition: the nodes are marked removing; treeMu held.
// +checklocks:m.treeMu
func (m *Manager) dropWarmNodes(nodes []string) {
	for _, s := range m.allSandboxes() {
		s.buildMu.Lock() // a build in flight may be of one of these nodes
		s.prepMu.Lock()
		for _, n := range nodes {
			if w := s.warm[n]; w != nil {
				delete(s.warm, n)
				w.state.Close()
				_ = store.RemoveAll(m.st.LayerDir(w.upper)) // an unused layer: the start-up sweep removes it
			}
		}
		s.prepMu.Unlock()
		s.buildMu.Unlock()
	}
}

// warmCount is how many warm states s holds (for the API).
func (m *Manager) warmCount(s *sb) int {
	s.prepMu.Lock()
	defer s.prepMu.Unlock()
	return len(s.warm)
}
