package state

import (
	"errors"
	"fmt"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/fastpath"
	"deltabox/internal/remote"
	"deltabox/internal/sandbox"
	"deltabox/internal/session"
	"deltabox/internal/store"
)

// The fast path of a fork (docs/design/fork.md), its mechanism: a branch is a sandbox
// whose init the source's init (the family init) made in sibling namespaces
// (sandbox.StartBranch), standing on the node's files on an upper of its own, and each
// of the node's templates is forked into it at its checkpoint PID (fastpath.Place: the
// seizures and injections; here, which branch, its undo and its records). Fork
// (family.go: forkFast) and the spares (spares.go) call startFastBranch and place per
// branch.

// fastBranch is a branch made by startFastBranch and place: its runtime, its upper and the copies
// placed in it, stopped until commit.
type fastBranch struct {
	rt     *sandbox.Sandbox
	upper  uint64
	copies []*fastCopy
	// sessions are the sessions made in the branch for its copies, by name.
	sessions map[string]*session.Session
	// failed says, for each copy that could not be resumed at commit, why.
	failed []string
	// target and pending are prepare's, until place (pending: the copies to make, in
	// the templates' order, their sessions made).
	target  *placeTarget
	pending []*fastCopy
	// init, state, place: how long its init, its state and its copies took to make.
	init, state, place time.Duration
}

// startFastBranch starts branch id of the family whose init is family's (src's
// runtime), on node's files (a fresh upper): its init and its state, no process yet.
// iso is src's, floor the highest PID a copy will take. Branches of one fork start at
// once (their inits' starts, ~30 ms each on a loaded 2-core VM, overlap: the family
// init only clones and execs, the rest of each start is the branch init's own). On error
// what it made is removed.
//
// topLower is the branch's identity layer ("" for none: sandbox.Sandbox.TopLower). name
// is its runtime's (its cgroups'): id for a sandbox's own, another for a spare, made
// while the sandbox's runtime still holds that name (spares.go). Its init logs in id's
// directory, which is removed on error only if made here. Its namespace builder is
// held (sandbox.StartBranch): nothing is prepared ahead for its later states until it
// checkpoints or restores. nice: sandbox.StartBranch's.
func (m *Manager) startFastBranch(family *sandbox.Sandbox, rec store.Sandbox, iso *sandbox.Isolation, node, id, name string, floor int, topLower string, nice int) (_ *fastBranch, err error) {
	m.mu.Lock()
	image := rec.Image
	if n := m.nodes[node]; n != nil {
		image = n.Image
	}
	m.mu.Unlock()
	spec, err := m.spec(image, node, 0)
	if err != nil {
		return nil, err
	}
	dir := m.st.SandboxDir(id)
	_, had := os.Stat(dir)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	b := &fastBranch{}
	defer func() {
		if err != nil {
			undo := b.remove(m)
			if had != nil {
				undo = errors.Join(undo, os.RemoveAll(dir))
			}
			err = withUndo(err, undo)
		}
	}()
	t0 := time.Now()
	hostname := rec.Hostname
	if hostname == "" {
		hostname = id
	}
	b.rt, err = sandbox.StartBranch(family, name, hostname, dir, rec.Limits, iso, floor, diskLimit(rec.DiskMB), nice)
	if err != nil {
		return nil, err
	}
	b.rt.TopLower = topLower
	b.init = time.Since(t0)
	t0 = time.Now()
	if b.upper, err = m.freshUpper(spec.Lowers[0]); err != nil {
		return nil, err
	}
	spec.Upper, spec.Work = m.st.LayerDiff(b.upper), m.st.LayerWork(b.upper)
	if err := b.rt.SetState(spec); err != nil {
		return nil, err
	}
	b.state = time.Since(t0)
	return b, nil
}

// fastFamily checks that src's node templates tps can be placed by the fast path, and
// returns src's isolation and the PID floor of the family's new namespaces: the highest
// PID of tps and of every node of src (pidFloor), whose templates' copies and CRIU trees
// the members' restores give back at their PIDs and TIDs later (with tps' alone, a
// command or a thread of the source's new init took a CRIU tree's: its restore failed,
// TestForkFloorCoversCRIUThreads).
// +checklocks:src.opMu
func (m *Manager) fastFamily(src *sb, tps []*procTemplate) (*sandbox.Isolation, int, error) {
	if src.rt == nil {
		return nil, 0, fmt.Errorf("sandbox %s is not running", src.rec.ID)
	}
	iso, _, err := m.isolation(src, false)
	if err != nil {
		return nil, 0, err
	}
	if iso == nil {
		return nil, 0, errors.New("the fast path of a fork needs the sandbox's user namespace (isolation is off)")
	}
	floor := m.pidFloor(src)
	for _, t := range tps {
		floor = max(floor, t.tmpl.Pid)
	}
	return iso, floor, nil
}

// place forks tps, templates in family's PID namespace held by tr, into b, each stopped
// at its checkpoint PID (fastpath.Place), and watches each copy's exit on the family
// init. On error the copies made are b's, killed by b.remove; the templates are as they
// were.
func (m *Manager) place(tr *remote.Tracer, family *sandbox.Sandbox, b *fastBranch, tps []*procTemplate) error {
	t0 := time.Now()
	if b.target == nil {
		if err := b.prepare(family, tps); err != nil {
			return err
		}
	}
	defer b.closeTarget()
	tmpls, ptys := make([]*fastpath.Template, len(tps)), make([]string, len(tps))
	for i, t := range tps {
		tmpls[i], ptys[i] = t.tmpl, b.pending[i].pts
	}
	placed, err := fastpath.Place(tr, b.target.tg, b.target.ns, tmpls, ptys)
	for i, r := range placed {
		c := b.pending[i]
		c.r = r
		c.exit = b.rt.WatchPlaced(tps[i].tmpl.Pid, r.HostPid)
		b.pending[i] = nil
		b.copies = append(b.copies, c)
	}
	if err != nil {
		return fmt.Errorf("%s: %w", tps[len(placed)].what, err)
	}
	b.pending = nil
	b.place = time.Since(t0)
	return nil
}

// placeTarget is what place needs of a branch besides the templates' tracer: its state's
// mount namespace and its namespaces' fds (sandbox.Sandbox.PlaceTarget).
type placeTarget struct {
	ns    int
	tg    *fastpath.Target
	close func()
}

// prepare opens b's place target and makes the sessions of tps in b, their terminals'
// slaves held open: the part of a placement that needs no template, so that a fork's
// branches do it at once, each as its init is ready (forkFast), and only the injection
// runs one branch after the other (the templates have one tracer). Measured at 64
// branches on a loaded 2-core VM: 18.5 ms per branch placed serially with it, against
// the injection alone (docs/design/fork.md). On error what it made is released by
// b.remove.
func (b *fastBranch) prepare(family *sandbox.Sandbox, tps []*procTemplate) error {
	ns, err := b.rt.StateNS()
	if err != nil {
		return err
	}
	tg, closeTarget, err := b.rt.PlaceTarget(family)
	if err != nil {
		unix.Close(ns)
		return err
	}
	b.target = &placeTarget{ns: ns, tg: tg, close: closeTarget}
	b.pending = make([]*fastCopy, len(tps))
	for i, t := range tps {
		c := &fastCopy{pt: t, peer: -1}
		b.pending[i] = c
		if t.session == "" {
			continue
		}
		c.sess, err = session.NewDetached(b.rt, t.session, t.kind, t.argv)
		if err != nil {
			return fmt.Errorf("%s: %w", t.what, err)
		}
		if b.sessions == nil {
			b.sessions = map[string]*session.Session{}
		}
		b.sessions[t.session] = c.sess
		if c.pts, err = c.sess.PtsPath(); err == nil {
			c.peer, err = c.sess.OpenPeer()
		}
		if err != nil {
			return fmt.Errorf("%s: %w", t.what, err)
		}
	}
	return nil
}

// closeTarget releases b's place target and the terminals' slaves of copies not placed.
func (b *fastBranch) closeTarget() {
	for _, c := range b.pending {
		if c != nil && c.peer >= 0 {
			unix.Close(c.peer)
			c.peer = -1
		}
	}
	b.pending = nil
	if b.target != nil {
		unix.Close(b.target.ns)
		b.target.close()
		b.target = nil
	}
}

// fastCopy is a copy placed in a branch, stopped until commit: its template, its
// session (nil outside the sessions) with the terminal's slave held open until then
// (revival.peer says why), and its exit, watched on the family init.
type fastCopy struct {
	pt   *procTemplate
	r    *fastpath.Revival
	sess *session.Session
	pts  string // the session's terminal in the branch ("" outside the sessions)
	peer int
	exit <-chan unix.WaitStatus
}

// commit lets the branch's copies run, each session bound to its copy with the
// checkpoint's terminal settings.
func (b *fastBranch) commit() error {
	var errs []error
	for _, c := range b.copies {
		if c.sess != nil {
			c.sess.RestoreTerm(c.pt.term)
		}
		err := c.r.Commit()
		if err != nil {
			b.failed = append(b.failed, fmt.Sprintf("%s: %v", c.pt.what, err))
		}
		if c.sess != nil {
			if err == nil {
				c.sess.Rebind(c.pt.tmpl.Pid, c.exit)
			}
			unix.Close(c.peer)
			c.peer = -1
		}
		errs = append(errs, err)
	}
	b.copies = nil
	return errors.Join(errs...)
}

// remove kills what the branch holds (its init ends its PID namespace, the copies in
// it) and removes its upper.
func (b *fastBranch) remove(m *Manager) error {
	var errs []error
	for _, c := range b.copies {
		errs = append(errs, c.r.Abort())
		if c.peer >= 0 {
			unix.Close(c.peer)
		}
	}
	b.copies = nil
	b.closeTarget()
	for _, sess := range b.sessions {
		sess.Release()
	}
	b.sessions = nil
	if b.rt != nil {
		errs = append(errs, b.rt.Destroy())
	}
	if b.upper != 0 {
		errs = append(errs, store.RemoveAll(m.st.LayerDir(b.upper)))
	}
	return errors.Join(errs...)
}
