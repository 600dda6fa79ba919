package state

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"deltabox/internal/remote"
	"deltabox/internal/sandbox"
)

// A fork of a node whose templates a fast fork's family holder keeps: the first fork's
// node and every node its source made before it (moveSourceSteps moves their templates
// into the holder). The first fork left no live code in the holder's PID namespace, so
// N more members are made exactly as its branches were (startAndPlace: branch inits
// that the family init makes in sibling namespaces, the node's templates placed into
// each at their PIDs), and nothing moves. Before, such a fork took the durable path
// (a CRIU restore per branch: hundreds of ms each, no pages shared) because the node's
// sandbox is not the one to move; that is still the path of a node whose templates are
// in a member's own namespace (made after the fork: placing them would nest the branch
// under the member's live code) or gone.
//
// The order on disk is the first fork's (famrestart.go): each branch's record as it is
// made, not Made; the records Made in one transaction before the answer. A crash
// between leaves records not Made in a made family: the next start removes them and
// sweeps what they name (adoptFamilies), the family and its other members untouched.
// The placement moves the holder's templates' counters (as a spare's does), recorded
// and waited for before the records (recordTemplatesOf).

// familyOfNode returns the family whose holder keeps every template of node, with the
// templates, and a member to take the family's record and id range from (its source if
// it is still a member); nil if there is none. Precondition: m.mu held.
// +checklocks:m.mu
func (m *Manager) familyOfNodeLocked(node string) (*family, []*procTemplate, *sb) {
	tps := slices.Clone(m.templates[node])
	if len(tps) == 0 {
		return nil, nil, nil
	}
	var fam *family
	for _, f := range m.families {
		if f.id == tps[0].sandbox {
			fam = f
		}
	}
	if fam == nil || fam.rt == nil || fam.tracer == nil {
		return nil, nil, nil
	}
	for _, t := range tps {
		if t.sandbox != fam.id {
			return nil, nil, nil
		}
	}
	var mem *sb
	ids := make([]string, 0, len(fam.members))
	for id := range fam.members {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	for _, id := range ids {
		s := m.sandboxes[id]
		if s == nil || (s.rec.Family != nil && !s.rec.Family.Made) {
			continue // removed, or a branch of a fork being made
		}
		if mem == nil || id == fam.src {
			mem = s
		}
	}
	if mem == nil {
		return nil, nil, nil
	}
	return fam, tps, mem
}

// forkFamily is Fork's fast path for a node its family's holder keeps (see above). It
// returns nil and the reason when the fork cannot take it, having changed nothing.
// +checklocksignore: a member's opMu briefly (its record and id range), each new branch's in startAndPlace
func (m *Manager) forkFamily(ctx context.Context, node, maker string, ids []string, co CreateOptions, o ForkOptions) (*ForkResult, string, error) {
	t0 := time.Now()
	switch {
	case !m.cfg.ForkFast:
		return nil, "the fast path of a fork is off (Config.ForkFast)", nil
	case m.cfg.NoIsolation:
		return nil, "isolation is off: the fast path's branches are user namespaces of the sandbox's", nil
	}
	m.mu.Lock()
	fam, tps, mem := m.familyOfNodeLocked(node)
	var famRT *sandbox.Sandbox
	var tracer *remote.Tracer
	if fam != nil {
		famRT, tracer = fam.rt, fam.tracer // under m.mu, as buildSpare reads them
	}
	m.mu.Unlock()
	if fam == nil {
		return nil, "the node's processes are not in a fork family's holder: only a fork of a sandbox (POST /v1/sandboxes/ID/fork, its checkpoint and the fork in one request), or of a node whose processes a fork's family holds (that fork's node, and the nodes its source made before it), takes it; a fork of this node would have to move its sandbox back onto it", nil
	}
	if ts, err := m.criuTreesOf(node); err != nil || ts.count() > 0 {
		return nil, "the node holds processes that CRIU took, which the fast path does not place", nil
	}
	m.fastForks.Add(1) // the disk watcher's timed pass waits (diskDue)
	defer m.fastForks.Add(-1)
	mem.opMu.Lock()
	base := mem.rec
	iso, _, err := m.isolation(mem, false)
	mem.opMu.Unlock()
	if err != nil {
		return nil, "the family's id range: " + err.Error(), nil
	}
	if iso == nil || base.Family == nil {
		return nil, "the family's member " + base.ID + " has no user namespace of the family's", nil
	}
	// What a branch may restore later is node and its ancestors (pidsKept: ForkOf).
	floor := m.pidFloorFor("", node)
	for _, t := range tps {
		floor = max(floor, t.tmpl.Pid)
	}
	fref := *base.Family
	fref.Made = false
	res := &ForkResult{Node: node, Count: o.Count}
	outs, err := m.startAndPlace(ctx, famRT, tracer, fam, base, iso, floor, node, node, ids, co, o, tps, fref)
	// The placements moved the holder's templates' counters, those of a fork that failed
	// after some too: recorded and waited for before anything else, so that a crash
	// from here on does not cost the node its templates (a next daemon's Reattach kills a
	// template whose counters it does not find recorded: it ran). A crash during the
	// placements still can, as during a spare's (docs/design/spares.md).
	m.recordTemplatesOf(fam.id, &fam.mu, node, tps)
	_ = m.st.Index.WaitDurable(m.st.Index.Seq()) // an error is the index's, reported by its next durable op
	if err != nil {
		return nil, "", err
	}
	m.crashPointRecorded("forkfamily", 1) // DELTABOX_CRASH_AT=forkfamily:1, a test hook: the branches placed, their records not Made
	m.addMembers(fam, outs)
	reason := fmt.Sprintf("forked from the node's %d templates, which its fork family's holder keeps, into a namespace of its own, at their PIDs", len(tps))
	m.commitBranches(outs, res, maker, node, o, tps, reason)
	branches := make([]*sb, len(outs))
	var kw sync.WaitGroup
	for i, x := range outs {
		branches[i] = x.s
		kw.Add(1)
		go func() {
			defer kw.Done()
			m.keepSessions(x.s) // before the records say Made: as forkFast's
		}()
	}
	kw.Wait()
	m.recordFamily(nil, fam, fref, branches)
	m.crashPointRecorded("forkfamily", 2)
	res.DurationMS = ms(time.Since(t0))
	return res, "", nil
}
