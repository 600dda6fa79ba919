package state

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"deltabox/internal/fastpath"
	"deltabox/internal/sandbox"
	"deltabox/internal/store"
)

// The fast path of a fork (docs/design/fork.md), its mechanism: a branch is a sandbox
// whose init the source's init (the family init) made in sibling namespaces
// (sandbox.StartBranch), standing on the node's files on an upper of its own, and each
// of the node's templates is forked into it at its checkpoint PID
// (fastpath.Revival.ReviveInto). Fork does not take this path yet (fork.md says what is
// missing); forkBranchFast is what it will call per branch.

// fastBranch is a branch made by forkBranchFast: its runtime, its upper and the copies
// placed in it, stopped until commit.
type fastBranch struct {
	rt     *sandbox.Sandbox
	upper  uint64
	copies []*fastpath.Revival
}

// forkBranchFast starts branch id of src's family on node (a fresh upper) and places
// tps, node's templates in src, into it, each stopped at its checkpoint PID. Only
// templates outside the sessions: a session's terminal is the branch's to make. On error
// what it made is removed; src is never touched (its templates are parked as they were).
// +checklocks:src.opMu
func (m *Manager) forkBranchFast(src *sb, node, id string, tps []*procTemplate) (_ *fastBranch, err error) {
	if src.rt == nil {
		return nil, fmt.Errorf("sandbox %s is not running", src.rec.ID)
	}
	iso, _, err := m.isolation(src, false)
	if err != nil {
		return nil, err
	}
	if iso == nil {
		return nil, errors.New("the fast path of a fork needs the sandbox's user namespace (isolation is off)")
	}
	floor := 0
	for _, t := range tps {
		if t.session != "" {
			return nil, fmt.Errorf("%s: a session's process is not placed by the fast path of a fork yet", t.what)
		}
		floor = max(floor, t.tmpl.Pid)
	}
	m.mu.Lock()
	image := src.rec.Image
	if n := m.nodes[node]; n != nil {
		image = n.Image
	}
	m.mu.Unlock()
	spec, err := m.spec(image, node, 0)
	if err != nil {
		return nil, err
	}
	dir := m.st.SandboxDir(id)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	b := &fastBranch{}
	defer func() {
		if err != nil {
			err = withUndo(err, b.remove(m))
			_ = os.RemoveAll(dir)
		}
	}()
	b.rt, err = sandbox.StartBranch(src.rt, id, id, dir, src.rec.Limits, iso, floor, diskLimit(src.rec.DiskMB))
	if err != nil {
		return nil, err
	}
	if b.upper, err = m.freshUpper(spec.Lowers[0]); err != nil {
		return nil, err
	}
	spec.Upper, spec.Work = m.st.LayerDiff(b.upper), m.st.LayerWork(b.upper)
	if err := b.rt.SetState(spec); err != nil {
		return nil, err
	}
	ns, err := b.rt.StateNS()
	if err != nil {
		return nil, err
	}
	defer unix.Close(ns)
	tg, closeTarget, err := b.rt.PlaceTarget(src.rt)
	if err != nil {
		return nil, err
	}
	defer closeTarget()
	tr := m.tracer(src)
	for _, t := range tps {
		r, err := fastpath.SeizeTemplate(tr, t.tmpl)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", t.what, err)
		}
		if err := r.ReviveInto(tg, ns, ""); err != nil {
			return nil, withUndo(fmt.Errorf("%s: %w", t.what, err), r.Abort())
		}
		b.copies = append(b.copies, r)
	}
	return b, nil
}

// commit lets the branch's copies run.
func (b *fastBranch) commit() error {
	var errs []error
	for _, r := range b.copies {
		errs = append(errs, r.Commit())
	}
	b.copies = nil
	return errors.Join(errs...)
}

// remove kills what the branch holds (its init ends its PID namespace, the copies in
// it) and removes its upper.
func (b *fastBranch) remove(m *Manager) error {
	var errs []error
	for _, r := range b.copies {
		errs = append(errs, r.Abort())
	}
	b.copies = nil
	if b.rt != nil {
		errs = append(errs, b.rt.Destroy())
	}
	if b.upper != 0 {
		errs = append(errs, store.RemoveAll(m.st.LayerDir(b.upper)))
	}
	return errors.Join(errs...)
}
