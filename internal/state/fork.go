package state

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/errdefs"
)

// A fork makes N new sandboxes on one node, each with the node's files and, where a
// path can carry them, its processes at their PIDs (docs/design/fork.md). Each branch
// is a sandbox like any other: its own upper, namespaces, cgroup, limits, sessions,
// terminals and host uid range.
//
// The path built is the durable one: each branch is created (its boot keeps the PIDs of
// the node and its ancestors free: pidFloor, the record's ForkOf) and restored to the node, the
// restore bringing the node's templates into the branch from the node's durable CRIU
// image (restoreImage, allowed by pidsKept) and forking the live processes from them as
// any restore does, and restoring the node's CRIU trees (criutrees.go). It works from a
// node whose sandbox is running, restored elsewhere or gone; the branch's later
// restores of the node or of an ancestor take the same way when their templates are not
// in the branch. What makes an image restorable into a sandbox other than its maker's:
//
//   - PIDs: the image's root PID and the live PIDs its template record names must be
//     free in the branch; a fresh sandbox counts its PIDs from 2 (its init's threads take
//     some), so the branch's init raises its next PID above the node's (pidFloor).
//   - uids: CRIU records a task's credentials as the task sees them (its parasite's
//     getresuid, inside the sandbox's user namespace) and sets them again after the
//     root task joined the target's user namespace: they land on the branch's own host
//     range. Files are named by path and opened in the branch's state, whose layers the
//     branch sees through its own idmapped mount.
//   - terminals: each is external in the image; the branch opens fresh ones (its own
//     devpts) and the revive gives each process its session's.
//
// The fast path (templates forked into sibling PID namespaces of a family holder,
// fork.md) is family.go's: taken by a fork of a sandbox (ForkSandbox) when
// Config.ForkFast is on and nothing ran between its checkpoint and the fork; every
// other fork says "durable" or "files" per branch, with why, and why not "fast".
//
// Failure: a branch that cannot be made or restored removes every branch made so far,
// and the error says which branch failed and why; the node and the source sandbox are
// never touched (nothing of the fork runs in them).

// maxForkCount bounds a fork's branches (each is a sandbox with its own namespaces and
// cgroup; the largest fan-out is 64).
const maxForkCount = 256

// defaultForkImageWait bounds the wait for a node's durable image still being written
// (a 50 MB python's dump takes a few hundred ms; a queue of nodes ahead of it more).
const defaultForkImageWait = 2 * time.Minute

// Fork paths, the answer's path per branch.
const (
	forkFastPath = "fast"
	forkDurable  = "durable"
	forkFiles    = "files"
)

type (
	// ForkOptions is the body of POST /v1/nodes/{id}/fork.
	ForkOptions = apitypes.ForkRequest
	// ForkResult is its answer.
	ForkResult = apitypes.ForkResult
)

// Fork makes o.Count sandboxes on node (see above).
func (m *Manager) Fork(ctx context.Context, node string, o ForkOptions) (*ForkResult, error) {
	return m.fork(ctx, node, o, -1)
}

// fork is Fork; execs, when >= 0, is the count of the node's sandbox's commands
// (stats.Execs) read before the checkpoint that made node (ForkSandbox): the fast path,
// which moves the sandbox back onto node, is taken only if none ran since.
func (m *Manager) fork(ctx context.Context, node string, o ForkOptions, execs int64) (*ForkResult, error) {
	t0 := time.Now()
	if o.Count < 1 || o.Count > maxForkCount {
		return nil, fmt.Errorf("fork count %d: want 1 to %d branches: %w", o.Count, maxForkCount, errdefs.ErrInvalid)
	}
	switch o.Processes {
	case "":
		o.Processes = "auto"
	case "auto", "require", "never":
	default:
		return nil, fmt.Errorf("fork processes %q: want \"auto\", \"require\" or \"never\": %w", o.Processes, errdefs.ErrInvalid)
	}
	if o.ImageWaitMS < 0 {
		return nil, fmt.Errorf("image_wait_ms %d: want >= 0 (0: %v): %w", o.ImageWaitMS, defaultForkImageWait, errdefs.ErrInvalid)
	}
	if err := m.awaitNode(ctx, node); err != nil { // a node answered early (answer.go)
		return nil, err
	}
	m.mu.Lock()
	n := m.nodes[node]
	var image, maker, workdir string
	if n != nil {
		image, maker = n.Image, n.Sandbox
		if src := m.sandboxes[maker]; src != nil {
			workdir = src.rec.Workdir
		}
	}
	m.mu.Unlock()
	if n == nil {
		return nil, fmt.Errorf("no node %q (deltabox tree lists them): %w", node, errdefs.ErrNotFound)
	}
	co := o.CreateOptions
	if co.Image == "" {
		co.Image = image
	} else if co.Image != image {
		return nil, fmt.Errorf("image %q: node %s stands on image %q, and a fork's branches stand on the node: leave image out: %w", co.Image, node, image, errdefs.ErrInvalid)
	}
	if co.Workdir == "" {
		co.Workdir = workdir
	}
	ids := forkIDs(co.ID, o.Count)
	fastWhy := "processes \"never\" was asked"
	switch {
	case o.Processes == "never":
	case execs < 0:
		fr, why, err := m.forkFamily(ctx, node, maker, ids, co, o)
		if err != nil || fr != nil {
			return fr, err
		}
		fastWhy = why
	default:
		fr, why, err := m.forkFast(ctx, node, maker, ids, co, o, execs)
		if err != nil || fr != nil {
			return fr, err
		}
		fastWhy = why
	}
	res := &ForkResult{Node: node, Count: o.Count}
	path, reason, waited := m.forkPath(ctx, node, o)
	reason += " (not the fast path: " + fastWhy + ")"
	res.ImageWaitMS = ms(waited)
	if path == forkFiles && o.Processes == "require" {
		return nil, fmt.Errorf("fork of %s cannot carry its processes: %s (processes \"auto\" forks its files only): %w", node, reason, errdefs.ErrConflict)
	}
	var made []string
	fail := func(i int, err error) (*ForkResult, error) {
		var undo []error
		for _, id := range made {
			if rerr := m.Remove(id); rerr != nil && !errors.Is(rerr, errdefs.ErrNotFound) {
				m.log.Error("fork failed, and a branch it made could not be removed", "node", node, "sandbox", id, "err", rerr)
				undo = append(undo, fmt.Errorf("remove branch %s: %w", id, rerr))
			}
		}
		err = fmt.Errorf("fork of %s: branch %d of %d: %w (the %d branches made were removed)", node, i, o.Count, err, len(made))
		if len(undo) > 0 {
			err = withUndo(err, errors.Join(undo...))
		}
		return nil, err
	}
	// The branches are made by forkWorkers goroutines, each creating a branch and
	// restoring it to the node, then the next: a create is mostly waits on init and
	// mounts, a restore from an image mostly CRIU's CPU, and each restore reads a copy
	// of the image of its own (durable.go: privateImage). After a failure no branch is
	// started; those running finish, and every branch made is removed.
	type out struct {
		b   apitypes.ForkBranch
		id  string // the branch's sandbox, once created
		err error
	}
	outs := make([]out, len(ids))
	next := make(chan int)
	var failed atomic.Bool
	var wg sync.WaitGroup
	for w := 0; w < min(len(ids), forkWorkers()); w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				b, id, err := m.forkBranch(ctx, node, maker, path, reason, i, ids[i], co, o)
				outs[i] = out{b, id, err}
				if err != nil {
					failed.Store(true)
				}
			}
		}()
	}
	for i := range ids {
		if failed.Load() {
			break
		}
		next <- i
	}
	close(next)
	wg.Wait()
	first := -1
	for i, x := range outs {
		if x.id != "" {
			made = append(made, x.id)
		}
		if x.err != nil && first < 0 {
			first = i
		}
	}
	if first >= 0 {
		return fail(first, outs[first].err)
	}
	for _, x := range outs {
		res.Branches = append(res.Branches, x.b)
	}
	res.DurationMS = ms(time.Since(t0))
	return res, nil
}

// ForkSandbox checkpoints sandbox id (co) and forks the node it made (o): sb.fork in
// one request. A fork that fails leaves the checkpoint's node, which its error names.
func (m *Manager) ForkSandbox(ctx context.Context, id string, co CheckpointOptions, o ForkOptions) (*ForkResult, error) {
	var execs int64
	if s, err := m.get(id); err == nil {
		s.mu.Lock()
		execs = int64(s.stats.Execs)
		s.mu.Unlock()
	}
	cp, err := m.CheckpointWith(ctx, id, co)
	if err != nil {
		return nil, err
	}
	res, err := m.fork(ctx, cp.Node.ID, o, execs)
	if err != nil {
		return nil, fmt.Errorf("%w (the checkpoint made node %s, which stays)", err, cp.Node.ID)
	}
	res.Checkpoint = cp
	return res, nil
}

// forkWorkers is how many branches a fork makes at once: one per CPU (a restore from an
// image is mostly CRIU's CPU).
func forkWorkers() int { return max(1, runtime.NumCPU()) }

// forkBranch makes branch i of a fork of node: creates sandbox id (o's options, co) and
// restores it to the node. It returns the branch, and the sandbox's id once created
// (also on a later failure: the caller removes it).
func (m *Manager) forkBranch(ctx context.Context, node, maker, path, reason string, i int, id string, co CreateOptions, o ForkOptions) (apitypes.ForkBranch, string, error) {
	tb := time.Now()
	co.ID = id
	ident := &apitypes.ForkIdentity{Branch: i, Count: o.Count, ParentNode: node}
	forkOf := ""
	if path == forkDurable {
		forkOf = node
	}
	info, err := m.create(ctx, co, ident, forkOf)
	if err != nil {
		return apitypes.ForkBranch{}, "", err
	}
	r, err := m.RestoreWith(ctx, info.ID, RestoreOptions{Node: node})
	if err != nil {
		return apitypes.ForkBranch{}, info.ID, err
	}
	b := apitypes.ForkBranch{Branch: i, Path: path, Reason: reason, Restore: r, Identity: ident}
	if path == forkDurable && r.Processes == 0 && r.CRIUProcesses == 0 {
		// The image held nothing this branch could run: say so, never silently.
		b.Path, b.Reason = forkFiles, "the restore from the node's durable image brought no process back"
		if why := append(r.ProcessErrors, r.Warnings...); len(why) > 0 {
			b.Reason += ": " + strings.Join(why, "; ")
		}
		if o.Processes == "require" {
			return b, info.ID, fmt.Errorf("%s: %w", b.Reason, errdefs.ErrConflict)
		}
	}
	m.countFork(maker, info.ID, &apitypes.ForkOrigin{Node: node, Branch: i, Count: o.Count, Path: b.Path, Reason: b.Reason})
	if in, err := m.Get(info.ID); err == nil {
		info = in
	}
	b.Sandbox = *info
	b.DurationMS = ms(time.Since(tb))
	return b, info.ID, nil
}

// countFork records a branch in the stats: its origin in its own, its path in those of
// the sandbox that made the node (maker), if it is there.
func (m *Manager) countFork(maker, branch string, o *apitypes.ForkOrigin) {
	if s, err := m.get(branch); err == nil {
		s.mu.Lock()
		s.stats.Fork = o
		s.mu.Unlock()
	}
	if s, err := m.get(maker); err == nil {
		s.mu.Lock()
		if s.stats.ForkPaths == nil {
			s.stats.ForkPaths = map[string]int{}
		}
		s.stats.ForkPaths[o.Path]++
		s.mu.Unlock()
	}
}

// forkIDs are the branches' sandbox ids: ID-0, ID-1, ... (ID alone for one branch), or
// "" (a random one each) when no ID is given.
func forkIDs(id string, count int) []string {
	ids := make([]string, count)
	for i := range ids {
		switch {
		case id == "":
		case count == 1:
			ids[i] = id
		default:
			ids[i] = fmt.Sprintf("%s-%d", id, i)
		}
	}
	return ids
}

// forkPath decides how a fork of node carries its processes, and why: "durable" when
// every kind of process state the node holds can be restored into a new sandbox (its
// templates' durable image, complete, waited for o.ImageWaitMS at most while it is
// written; its CRIU trees, which CRIU can restore here), else "files" with the reason.
// All or nothing: a branch never runs some of the node's processes without the rest.
func (m *Manager) forkPath(ctx context.Context, node string, o ForkOptions) (path, reason string, waited time.Duration) {
	if o.Processes == "never" {
		return forkFiles, "processes \"never\" was asked", 0
	}
	m.mu.Lock()
	tmpls := len(m.templates[node]) > 0
	if pr := m.procRecs[node]; pr != nil && len(pr.Templates) > 0 {
		tmpls = true
	}
	m.mu.Unlock()
	if !tmpls && m.imageInfo(node) != nil {
		tmpls = true // templates gone (evicted, daemon restarted), their image known
	}
	_, imported := m.processImageDir(node) // a node an import brought, with its image
	tmpls = tmpls || imported
	ts, err := m.criuTreesOf(node)
	if err != nil {
		return forkFiles, "the node's CRIU trees cannot be read: " + err.Error(), 0
	}
	trees := ts.count() > 0
	if !tmpls && !trees {
		return forkFiles, "the node holds no process (it was made without processes, or its sandbox ran without the fast path)", 0
	}
	if !m.cfg.FastPath {
		return forkFiles, "the daemon runs without the fast path: process state is not kept", 0
	}
	if why := m.noImages(ctx); why != "" {
		return forkFiles, "the daemon writes no durable images, which a fork's processes come from: " + why, 0
	}
	var how []string
	if trees {
		if ok, why := m.criuTreesUsable(); !ok {
			return forkFiles, "the node's processes that CRIU took cannot be restored: " + why, 0
		}
		how = append(how, fmt.Sprintf("its %d processes that CRIU took from their CRIU images", ts.count()))
	}
	switch {
	case imported:
		how = append([]string{"its processes from the durable CRIU image its import brought"}, how...)
	case tmpls:
		p, why, w := m.waitImage(ctx, node, o)
		if p != forkDurable {
			return p, why, w
		}
		how = append([]string{"its templates' processes from the node's durable CRIU image"}, how...)
		waited = w
	}
	return forkDurable, "restored " + strings.Join(how, " and "), waited
}

// noImages says why the daemon writes no durable images ("" when it does), once its
// probe of CRIU is done (a few seconds after its start).
func (m *Manager) noImages(ctx context.Context) string {
	if m.img == nil {
		return "durable images are off"
	}
	select {
	case <-m.img.ready:
	case <-ctx.Done():
		return "the request ended while the daemon probed CRIU: " + ctx.Err().Error()
	}
	m.img.mu.Lock()
	defer m.img.mu.Unlock()
	if m.img.runner == nil || !m.img.runner.Usable() {
		if m.img.runner != nil {
			return m.img.runner.Reason
		}
		return "CRIU is unusable here"
	}
	return ""
}

// waitImage waits, o.ImageWaitMS at most, for node's durable image to be complete:
// "durable" once it is, "files" with the reason when it failed or did not come.
func (m *Manager) waitImage(ctx context.Context, node string, o ForkOptions) (path, reason string, waited time.Duration) {
	wait := defaultForkImageWait
	if o.ImageWaitMS > 0 {
		wait = time.Duration(o.ImageWaitMS) * time.Millisecond
	}
	t0 := time.Now()
	deadline := t0.Add(wait)
	m.imageFirst(node)
	for {
		in := m.imageInfo(node)
		switch {
		case in != nil && in.State == "complete":
			return forkDurable, "", time.Since(t0)
		case in != nil && in.State == "failed":
			return forkFiles, "the node's durable image failed: " + in.Error, time.Since(t0)
		}
		if time.Now().After(deadline) {
			st := "not queued"
			if in != nil {
				st = in.State
			}
			return forkFiles, fmt.Sprintf("the node's durable image is not complete after %v (%s)", wait, st), time.Since(t0)
		}
		select {
		case <-ctx.Done():
			return forkFiles, "the request ended while the fork waited for the node's durable image: " + ctx.Err().Error(), time.Since(t0)
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// The identity of a branch: /run/deltabox/identity (apitypes.ForkIdentity's JSON, 0444)
// in a layer of its own, SandboxDir/identity, which the sandbox stacks over the lowers
// of every state it mounts (sandbox.Sandbox.TopLower): every state of the branch shows
// it, and a restore, which changes the lowers and the upper only, never rolls it back,
// even to a node made before the fork. It is a lower, not a mount: the sandbox's root
// may change it (in its upper, as any file of a lower), which changes only what its own
// processes read. Written before the sandbox's first process runs. Branches read it to
// reseed their random generators; DeltaBox never writes process memory.
const identityPath = "run/deltabox/identity"

// identityLayer is the identity layer of sandbox id, "" if it has none.
func (m *Manager) identityLayer(id string) string {
	dir := filepath.Join(m.st.SandboxDir(id), "identity")
	if _, err := os.Stat(filepath.Join(dir, identityPath)); err != nil {
		return ""
	}
	return dir
}

// writeIdentity writes s's identity layer. Its files are the daemon's (uid 0 on disk,
// as every layer's): through the sandbox's idmapped view of the store they are its
// root's. Precondition: s not yet booted.
func (m *Manager) writeIdentity(s *sb, ident apitypes.ForkIdentity) error {
	dir := filepath.Join(m.st.SandboxDir(s.rec.ID), "identity")
	b, err := json.Marshal(ident)
	if err != nil {
		return err
	}
	f := filepath.Join(dir, identityPath)
	if err := os.MkdirAll(filepath.Dir(f), 0o755); err != nil {
		return fmt.Errorf("the branch's identity layer: %w", err)
	}
	if err := os.WriteFile(f+".tmp", append(b, '\n'), 0o444); err != nil {
		return fmt.Errorf("the branch's identity: %w", err)
	}
	if err := os.Rename(f+".tmp", f); err != nil {
		return fmt.Errorf("the branch's identity: %w", err)
	}
	return nil
}
