package state

import (
	"context"
	"fmt"
	"time"

	"deltabox/internal/errdefs"
)

// The nodes of checkpoints that answered early (checkpoint.go: "The early answer").
//
// A checkpoint reserves its node's id once its processes are seized (step 1), and the
// id is pending until the checkpoint ends: published (the node is in m.nodes), or
// failed. A pending id is never handed out again. Whatever names it waits for its end
// (awaitNode): a read of it (GET /v1/nodes/ID), a restore or fork of it, a pin, an
// eviction, an export, a removal; and a listing of the tree waits for every pending one
// (awaitPending), so that no read shows the node missing or half made. The sandbox's
// own next operation waits for it anyway: the checkpoint holds the sandbox's opMu (which
// GET /v1/sandboxes/ID takes too) until it ends.
//
// A checkpoint that fails after its early answer is undone as any failed checkpoint
// (every process running as before, every file as it was): its node is never made.
// The failure is reported three ways: the daemon's log; the node's id, which answers
// every later use with the failure (404: there is no such node) for as long as the
// daemon runs, or until maxFailedKept later failures; and the sandbox's next call or
// switch (an exec, a file operation, a checkpoint, a restore), which answers 409 with
// it instead of running, once (a restore of the failed node reports it instead).

// pendingNode is a node id between its checkpoint's answer and its end.
type pendingNode struct {
	id      string
	sandbox string
	done    chan struct{} // closed at the end; err is fixed before
	// Under Manager.mu: early, the checkpoint answered before its end; err, its failure
	// after that answer.
	early bool
	err   error
}

// maxFailedKept bounds the failed ids kept to answer with their failure.
const maxFailedKept = 1024

// pendingWait bounds a wait for a pending node: its checkpoint's remaining steps each
// have their own deadlines (injections, mounts), far shorter.
const pendingWait = 2 * time.Minute

// reserveNode takes a fresh node id for a checkpoint of s and marks it pending.
func (m *Manager) reserveNode(s *sb) *pendingNode {
	m.mu.Lock()
	defer m.mu.Unlock()
	p := &pendingNode{id: m.newNodeID(), sandbox: s.rec.ID, done: make(chan struct{})}
	m.pending[p.id] = p
	return p
}

// answeredEarly marks p as answered before its end.
func (m *Manager) answeredEarly(p *pendingNode) {
	m.mu.Lock()
	p.early = true
	m.mu.Unlock()
}

// settleNode ends p: published (err nil: the node is in m.nodes, and the id is no longer
// pending) or failed. A failed early one is kept to answer with its failure, and its
// sandbox's next call or switch reports it.
func (m *Manager) settleNode(s *sb, p *pendingNode, err error) {
	m.mu.Lock()
	early := p.early
	if err == nil || !early {
		delete(m.pending, p.id)
	} else {
		p.err = err
		m.failedOrder = append(m.failedOrder, p.id)
		if len(m.failedOrder) > maxFailedKept {
			delete(m.pending, m.failedOrder[0])
			m.failedOrder = m.failedOrder[1:]
		}
	}
	m.mu.Unlock()
	if err != nil && early {
		s.mu.Lock()
		s.lateFailure = p
		s.mu.Unlock()
	}
	close(p.done)
}

// failure is how a failed early checkpoint answers later uses of its node or sandbox.
func (p *pendingNode) failure() error {
	return fmt.Errorf("the checkpoint of sandbox %s that answered node %s failed after its answer, and was undone (the sandbox's files and processes are as they were before it; node %s does not exist): %v", p.sandbox, p.id, p.id, p.err)
}

// awaitNode waits while node id is pending, for pendingWait at most; it answers the
// failure of an early checkpoint that named id (404), and nothing for any other id
// (the caller looks it up). Held: no lock.
func (m *Manager) awaitNode(ctx context.Context, id string) error {
	m.mu.Lock()
	p := m.pending[id]
	m.mu.Unlock()
	if p == nil {
		return nil
	}
	t := time.NewTimer(pendingWait)
	defer t.Stop()
	select {
	case <-p.done:
	case <-ctx.Done():
		return fmt.Errorf("abandoned while waiting for the checkpoint that answered node %s to complete: %w", id, ctx.Err())
	case <-t.C:
		return fmt.Errorf("node %s: its checkpoint of sandbox %s answered %v ago and is still not complete: %w", id, p.sandbox, pendingWait, errdefs.ErrConflict)
	}
	if p.err == nil {
		return nil
	}
	// Reported here: its sandbox's next call need not report it again.
	if s, err := m.get(p.sandbox); err == nil {
		s.mu.Lock()
		if s.lateFailure == p {
			s.lateFailure = nil
		}
		s.mu.Unlock()
	}
	return fmt.Errorf("%w: %w", p.failure(), errdefs.ErrNotFound)
}

// awaitPending waits for the checkpoints that answered early and run now, so that a
// listing of the tree holds their nodes (each wait bounded as awaitNode's).
func (m *Manager) awaitPending() {
	m.mu.Lock()
	var ids []string
	for id, p := range m.pending {
		if p.early && p.err == nil {
			ids = append(ids, id)
		}
	}
	m.mu.Unlock()
	for _, id := range ids {
		_ = m.awaitNode(context.Background(), id) // a failed one is not listed: nothing to wait for
	}
}

// takeLateFailure is the unreported failure of s's last early checkpoint, as the error
// of the call or switch that reports it (409: it did not run), or nil; it is reported
// once.
func (m *Manager) takeLateFailure(s *sb) error {
	s.mu.Lock()
	p := s.lateFailure
	s.lateFailure = nil
	s.mu.Unlock()
	if p == nil {
		return nil
	}
	return fmt.Errorf("%w; this call did not run: run it again: %w", p.failure(), errdefs.ErrConflict)
}
