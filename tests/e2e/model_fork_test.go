package e2e

// The model (model_test.go) through a fast fork and restores from spares
// (docs/design/spares.md). A spare exists for a pair (member s of a fast fork's family,
// node F made before the fork): F's templates forked ahead into a sibling namespace,
// stopped; a restore of F in s swaps it in instead of forking. The model forks its
// sandbox once, by the fast path, and carries on in every member, each its own model
// (files, names, processes) sharing the nodes made before the fork; members restore
// a few of those nodes again and again, so that spares are made (after each such
// restore, or by POST /v1/nodes/{id}/prepare) and then used. After every restore, from a
// spare or not, the member is compared with its model as in TestModelFilesystem: its
// files, /, /dev/shm, its names, its CRIU holders, and its ticker, whose memory shows
// that the spare's copy never ran before its restore (modelTickerPy).
//
// What the daemon holds of spares is modelled too: a member holding templates of its
// own (a node it made since the fork, with processes) uses no spare and gets none made
// (prepare answers 409); once it removes those nodes it does again. A node holding
// processes that CRIU took has no spare (they come back through CRIU alone), and in a
// branch, whose PIDs they may not find free, they do not come back at all. Before each
// restore the model's spares of the member must be the daemon's (GET /v1/nodes/{id}),
// and the restore is from a spare exactly when the member holds one and may use it.
//
// Environment: DELTABOX_MODEL_SEED as TestModelFilesystem, DELTABOX_MODEL_FORK_OPS
// (default 48: about a minute on a loaded 2-core machine) operations, about a third of
// them before the fork.

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/apitypes"
	"deltabox/internal/testutil"
)

// modelMaxSpares is how many spares a sandbox holds (state.maxSpares): the oldest goes.
const modelMaxSpares = 2

// modelFamily is the model of a fast fork's family.
type modelFamily struct {
	node    string          // the fork's node
	at      *modelMember    // the member the model works in now
	pre     map[string]bool // the nodes made before the fork: their templates are the family holder's
	hot     []string        // pre-fork nodes the members restore again and again (the fork's first)
	members []*modelMember  // the source first, then the branches
}

// modelMember is one member of the family: its model, and what it holds.
type modelMember struct {
	*model
	f      *modelFamily
	own    []string // nodes it made since the fork, not removed
	spares []string // pre-fork nodes it holds a spare of, oldest first
}

// TestModelForkSpares runs the model through a fast fork (count 2 or 3) and restores
// from spares in its members (see above).
func TestModelForkSpares(t *testing.T) {
	seed := modelEnvInt(t, "DELTABOX_MODEL_SEED", uint64(time.Now().UnixNano()))
	ops := int(modelEnvInt(t, "DELTABOX_MODEL_FORK_OPS", 48))
	t.Logf("seed %d, %d operations (rerun with DELTABOX_MODEL_SEED=%d)", seed, ops, seed)

	d := testutil.StartDaemon(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	m := newModel(t, ctx, d, seed, "modelf")
	t0 := time.Now()
	pre := ops/4 + m.rng.IntN(ops/4+1)
	for done := 0; done < pre; {
		if m.randomStep() {
			done++
		}
	}
	f := m.fork(2 + m.rng.IntN(2))
	f.firstSpare()
	for done := pre; done < ops; {
		if f.randomStep() {
			done++
		}
	}
	for _, x := range f.members {
		x.finish()
	}
	m.report(ops, t0)
	if m.counts["restore from a spare"] == 0 {
		t.Fatalf("no restore was from a spare: the model did not test what it is for (rerun: DELTABOX_MODEL_SEED=%d)", seed)
	}
}

// endProcesses ends the writers and the CRIU holders (SIGKILL through the daemon): the
// fork's fast path takes a node whose processes the fast path took, in a sandbox that
// wrote no file since (docs/design/fork.md); the ticker writes nothing.
func (m *model) endProcesses() {
	m.t.Helper()
	pids := slices.Clone(m.writerPids)
	for _, h := range m.holders {
		pids = append(pids, h.pid)
	}
	for _, pid := range pids {
		if _, err := m.d.C.Signal(m.ctx, m.sb, pid, int(unix.SIGKILL)); err != nil {
			m.fatalf("kill process %d: %v", pid, err)
		}
	}
	m.step(fmt.Sprintf("killed writers %v and holders %v", m.writerPids, m.holders))
	for _, pid := range pids {
		m.exec([]string{"bash", "-c", `for i in $(seq 1000); do [ -e /proc/$1 ] || exit 0; sleep 0.01; done; echo "process $1 still there 10 s after its SIGKILL" >&2; exit 1`,
			"sh", fmt.Sprint(pid)}, nil)
	}
	m.writerPids, m.holders = nil, nil
}

// fork forks the sandbox into count branches by the fast path and returns the family,
// every member checked against its model.
func (m *model) fork(count int) *modelFamily {
	m.t.Helper()
	m.endProcesses()
	// Names of the node's own: the source's restores of it give them back, the branches
	// keep theirs.
	m.apply(&modelOp{K: "names", kind: "names", tree: "names", P: "forked", Q: "dom-forked"})
	info, err := m.d.C.Get(m.ctx, m.sb)
	if err != nil {
		m.fatalf("get sandbox: %v", err)
	}
	t0 := time.Now()
	res, err := m.d.C.ForkSandbox(m.ctx, m.sb, apitypes.SandboxForkRequest{
		ForkRequest: apitypes.ForkRequest{Count: count, CreateOptions: apitypes.CreateOptions{ID: m.sb + "b"}},
	})
	if err != nil {
		m.fatalf("fork into %d: %v", count, err)
	}
	t1 := time.Now()
	m.timed("fork calls", t0)
	m.step(fmt.Sprintf("fork into %d -> node %s, %.0f ms", count, res.Node, res.DurationMS))
	if len(res.Branches) != count || res.Checkpoint == nil || res.Checkpoint.Node == nil || res.Checkpoint.Node.ID != res.Node {
		m.fatalf("fork into %d answered %d branches, checkpoint %+v, node %s", count, len(res.Branches), res.Checkpoint, res.Node)
	}
	for _, b := range res.Branches {
		if b.Path != "fast" {
			m.fatalf("fork: branch %d (%s) took the %s path, want the fast path: %s", b.Branch, b.Sandbox.ID, b.Path, b.Reason)
		}
	}
	f := &modelFamily{node: res.Node, pre: map[string]bool{}}
	// The source is on its node, as after a checkpoint (noteNode checks it).
	m.noteNode(res.Checkpoint, info.Upper, t0, t1)
	for _, n := range m.nodes {
		f.pre[n] = true
	}
	f.hot = []string{res.Node}
	if len(m.nodes) > 1 {
		f.hot = append(f.hot, m.pick(m.nodes[:len(m.nodes)-1]))
	}
	f.members = append(f.members, &modelMember{model: m, f: f})
	for _, b := range res.Branches {
		x := &modelMember{model: m.member(b.Sandbox), f: f}
		f.members = append(f.members, x)
		// A branch is on the node, another sandbox's: its files and processes, its own
		// names.
		x.checkTicks(res.Node, t1)
		x.checkMounts("fork")
		x.compare(fmt.Sprintf("fork: branch %d", b.Branch))
	}
	if n, err := m.d.C.Node(m.ctx, res.Node); err != nil || len(n.Spares) != 0 {
		m.fatalf("node %s after its fork: spares %v (%v), want none", res.Node, n.Spares, err)
	}
	m.counts["fork"]++
	return f
}

// member is the model of branch b of m's fork, made when m stood on the fork's node:
// m's model, with a mirror of its own, sharing the nodes and the checks' bookkeeping.
func (m *model) member(b apitypes.SandboxInfo) *model {
	m.t.Helper()
	c := *m
	c.sb = b.ID
	c.mirror = filepath.Join(m.dir, "mirror-"+b.ID)
	c.shm = filepath.Join(m.dir, "shm-"+b.ID)
	for _, p := range [][2]string{{m.mirror, c.mirror}, {m.shm, c.shm}} {
		if err := modelCopyTree(p[0], p[1]); err != nil {
			m.fatalf("%v", err)
		}
	}
	c.root = m.root.clone()
	c.nodes = slices.Clone(m.nodes)
	c.holders, c.writerPids = slices.Clone(m.holders), slices.Clone(m.writerPids)
	c.ownUTS = [2]string{b.Hostname, m.ownUTS[1]}
	c.uts = c.ownUTS
	return &c
}

// firstSpare makes sure the run restores from spares: the source (whose node it is:
// its names come back) and a random branch (its own names) each prepare the fork's
// node, change a few things, and restore it.
func (f *modelFamily) firstSpare() {
	for _, x := range []*modelMember{f.members[0], f.members[1+f.members[0].rng.IntN(len(f.members)-1)]} {
		x.prepare(f.node)
		for done := 0; done < 3; {
			if o := x.nextOp(); o != nil {
				x.apply(o)
				x.fixBig(o)
				done++
			}
		}
		if res := x.restore(f.node); !res.FromSpare {
			x.fatalf("the restore of %s right after its prepare in %s was not from its spare: %s", f.node, x.sb, x.lastOp)
		}
	}
}

// randomStep applies one random operation in a member (the one of the last step, or
// another one time in four, as an agent works in a branch for a while; false: none was
// possible), then at random starts a writer or a holder there, checkpoints, restores (a
// hot node mostly), prepares a hot node, or removes the nodes the member made.
func (f *modelFamily) randomStep() bool {
	rng := f.members[0].rng
	if f.at == nil || rng.IntN(4) == 0 {
		f.at = f.members[rng.IntN(len(f.members))]
	}
	x := f.at
	o := x.nextOp()
	if o == nil {
		return false
	}
	x.apply(o)
	x.fixBig(o)
	x.checkFrozen(o.String(), false)
	x.checkMounts(o.kind)
	if x.rng.IntN(25) == 0 {
		x.startWriter()
	}
	if x.rng.IntN(15) == 0 && len(x.holders) < 3 {
		x.startHolder()
	}
	switch r := x.rng.IntN(100); {
	case r < 6:
		x.checkpoint()
		x.own = append(x.own, x.head)
		x.checkFrozen("checkpoint", false)
	case r < 36:
		id := x.pick(f.hot)
		if x.rng.IntN(4) == 0 {
			id = x.pick(x.nodes)
		}
		x.restore(id)
		x.checkFrozen("restore", false)
	case r < 41:
		x.prepare(x.pick(f.hot))
	case r < 45:
		x.prune()
		x.checkFrozen("node removal", false)
	}
	return true
}

// spareable reports whether node may have spares: its templates are the family
// holder's (a node made before the fork, with processes), and it has no process that
// CRIU took (a spare carries none: state.spareRefusal).
func (x *modelMember) spareable(node string) bool {
	return x.f.pre[node] && x.tmpls[node] > 0 && x.criuAt[node] == 0
}

// ownTemplates reports whether x holds templates of its own, which live in its
// namespace: it then takes no spare and gets none made (state.spareRefusal).
func (x *modelMember) ownTemplates() bool {
	return slices.ContainsFunc(x.own, func(n string) bool { return x.tmpls[n] > 0 })
}

// listed reports whether the daemon lists x among node's spares.
func (x *modelMember) listed(node string) bool {
	n, err := x.d.C.Node(x.ctx, node)
	if err != nil {
		x.fatalf("node %s: %v", node, err)
	}
	return slices.Contains(n.Spares, x.sb)
}

// addSpare records a spare of node made for x (the oldest goes past modelMaxSpares).
func (x *modelMember) addSpare(node string) {
	x.spares = append(slices.DeleteFunc(x.spares, func(n string) bool { return n == node }), node)
	if len(x.spares) > modelMaxSpares {
		x.spares = x.spares[len(x.spares)-modelMaxSpares:]
	}
}

// restore restores x to node: from a spare exactly when x holds one of node and may
// use it; then, for a node of the family's holder, the next spare is made (waited for).
func (x *modelMember) restore(node string) *apitypes.OpResult {
	x.t.Helper()
	has := slices.Contains(x.spares, node)
	if got := x.listed(node); got != has {
		x.fatalf("before the restore of %s: the daemon lists a spare of it in %s: %v; the model: %v (spares %v, own templates %v)", node, x.sb, got, has, x.spares, x.ownTemplates())
	}
	use := has && !x.ownTemplates()
	res := x.model.restore(node)
	if res.FromSpare != use {
		x.fatalf("the restore of %s in %s: from a spare %v, want %v (spares %v, own templates %v): %s", node, x.sb, res.FromSpare, use, x.spares, x.ownTemplates(), x.lastOp)
	}
	if x.spareable(node) && !x.ownTemplates() {
		x.spares = slices.DeleteFunc(x.spares, func(n string) bool { return n == node })
		x.addSpare(node)
		x.waitSpare(node)
	}
	return res
}

// waitSpare waits until x holds a spare of node, made in the background after a restore.
func (x *modelMember) waitSpare(node string) {
	x.t.Helper()
	defer x.timed("waits for spares", time.Now())
	deadline := time.Now().Add(60 * time.Second)
	for !x.listed(node) {
		if time.Now().After(deadline) {
			x.fatalf("no spare of %s in %s 60 s after its restore; daemon log:\n%s", node, x.sb, dbxTail(x.d.Log(), 3000))
		}
		time.Sleep(20 * time.Millisecond)
	}
	x.checks["spares made after a restore"]++
}

// prepare asks for a spare of node in x: made, or refused while x holds templates of
// its own.
func (x *modelMember) prepare(node string) {
	x.t.Helper()
	t0 := time.Now()
	n, err := x.d.C.PrepareNode(x.ctx, node, x.sb)
	x.timed("prepare calls", t0)
	x.step(fmt.Sprintf("prepare %s: %v", node, err))
	switch {
	case !x.f.pre[node] || x.tmpls[node] == 0:
		x.fatalf("the model prepares %s, not a node of the family's holder", node)
	case x.ownTemplates():
		if err == nil || !strings.Contains(err.Error(), "templates of its own") {
			x.fatalf("prepare %s in %s, which holds templates of its own (nodes %v): %v, want a refusal saying so", node, x.sb, x.own, err)
		}
		x.counts["prepare (refused: templates of its own)"]++
	case x.criuAt[node] > 0:
		if err == nil || !strings.Contains(err.Error(), "processes that CRIU took") {
			x.fatalf("prepare %s in %s, a node with %d processes that CRIU took: %v, want a refusal saying so", node, x.sb, x.criuAt[node], err)
		}
		x.counts["prepare (refused: processes that CRIU took)"]++
	case err != nil:
		x.fatalf("prepare %s in %s: %v", node, x.sb, err)
	case !slices.Contains(n.Spares, x.sb):
		x.fatalf("prepare %s in %s answered spares %v", node, x.sb, n.Spares)
	default:
		x.addSpare(node)
		x.counts["prepare"]++
	}
}

// prune removes the nodes x made since the fork (after a restore to a hot node: a
// node a sandbox stands on cannot be removed), so that it may use spares again, and
// prepares that hot node.
func (x *modelMember) prune() {
	x.t.Helper()
	if len(x.own) == 0 {
		return
	}
	p := x.pick(x.f.hot)
	x.restore(p)
	own := map[string]bool{}
	for _, n := range x.own {
		own[n] = true
	}
	for _, n := range x.own {
		if own[x.parent[n]] || !slices.Contains(x.nodes, n) {
			continue // removed with its parent
		}
		removed, err := x.d.C.RemoveNode(x.ctx, n)
		if err != nil {
			x.fatalf("remove node %s of %s: %v", n, x.sb, err)
		}
		var want []string
		for _, c := range x.own {
			for a := c; a != ""; a = x.parent[a] {
				if a == n {
					want = append(want, c)
					break
				}
			}
		}
		sort.Strings(removed)
		sort.Strings(want)
		if !slices.Equal(removed, want) {
			x.fatalf("remove node %s: removed %v, want it and its descendants %v", n, removed, want)
		}
		x.step(fmt.Sprintf("removed %v", removed))
		for _, r := range removed {
			x.forget(r)
		}
	}
	x.own = nil
	x.counts["node removal"]++
	// A spare made meanwhile by the background work of an earlier restore (which may find
	// the member's own templates gone) is the daemon's to list: the model follows it.
	x.spares = slices.DeleteFunc(x.spares, func(n string) bool { return !x.listed(n) })
	for n := range x.f.pre {
		if !slices.Contains(x.spares, n) && x.listed(n) {
			x.spares = append([]string{n}, x.spares...)
		}
	}
	if len(x.spares) > modelMaxSpares {
		x.fatalf("%s holds spares of %v, more than %d", x.sb, x.spares, modelMaxSpares)
	}
	x.prepare(p)
}

// forget drops removed node r from the model: its layer is no longer frozen (it goes),
// its saved trees go.
func (x *modelMember) forget(r string) {
	x.nodes = slices.DeleteFunc(x.nodes, func(n string) bool { return n == r })
	if l, ok := x.layerOf[r]; ok {
		delete(x.frozen, l)
		delete(x.lowers, l)
	}
	for _, p := range []string{x.saved[r], x.shmAt[r]} {
		if err := os.RemoveAll(p); err != nil {
			x.fatalf("%v", err)
		}
	}
	delete(x.saved, r)
	delete(x.shmAt, r)
}
