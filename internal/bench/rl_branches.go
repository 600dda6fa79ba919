package bench

import (
	"context"
	"fmt"
	"sync"
	"time"

	"deltabox/internal/apitypes"
)

// SysRLBranches: the RL step as agent stacks run it on DeltaBox: one sandbox builds the
// start state (workspace, python heap) and forks B branches of it with their processes
// (POST /v1/sandboxes/ID/fork, the fast path: pages shared copy-on-write); each step
// acts in every branch and resets it by restoring the fork's node, whose templates
// the family holds (docs/design/fork.md). Unlike SysRLDeltaBox the branches share one
// node and one heap's pages.
const SysRLBranches = "deltabox-branches"

// rlForked is a branch of a fork, reset to the fork's node; paths counts the paths its
// resets took (shared by the point's branches).
type rlForked struct {
	rlSandbox
	paths *rlPaths
}

func (b *rlForked) reset(ctx context.Context) error {
	res, err := b.c.Restore(ctx, b.id, b.node)
	if err == nil {
		b.paths.add(res)
	}
	return err
}

// rlPaths counts how a point's resets brought their processes back.
type rlPaths struct {
	mu sync.Mutex
	n  map[string]int
}

func (p *rlPaths) add(res *apitypes.OpResult) {
	path := "templates"
	switch {
	case res.FromImage:
		path = "image"
	case res.Processes == 0:
		path = "files-only"
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.n == nil {
		p.n = map[string]int{}
	}
	p.n[path]++
}

func (p *rlPaths) counts() map[string]int {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := map[string]int{}
	for k, v := range p.n {
		out[k] = v
	}
	return out
}

// setupBranches: the base sandbox builds the start state and forks b branches of it;
// cleanup removes the base (the fork's moved source) and the fork's node once the
// branches are closed.
func (r *rlRun) setupBranches(ctx context.Context, b int, paths *rlPaths) ([]rlBranch, []string, func(), error) {
	base := "bench-rl-fam-" + randHex(4)
	mem := int64(r.o.HeapMB)*3 + 256
	if _, err := r.c.Create(ctx, apitypes.CreateOptions{ID: base, Image: r.o.Image, Workdir: "/workspace", MemoryMB: mem}); err != nil {
		return nil, nil, nil, err
	}
	var node string
	cleanup := func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		r.c.Remove(ctx, base)
		if node != "" {
			r.c.RemoveNode(ctx, node)
		}
	}
	if err := r.genWorkspace(ctx, base); err != nil {
		return nil, nil, cleanup, err
	}
	if err := r.startHeap(ctx, base); err != nil {
		return nil, nil, cleanup, err
	}
	fr, err := r.c.ForkSandbox(ctx, base, apitypes.SandboxForkRequest{ForkRequest: apitypes.ForkRequest{Count: b,
		CreateOptions: apitypes.CreateOptions{ID: "bench-rl-br-" + randHex(3), MemoryMB: mem}, Processes: "require"}})
	if err != nil {
		return nil, nil, cleanup, err
	}
	node = fr.Node
	var out []rlBranch
	for _, br := range fr.Branches {
		out = append(out, &rlForked{rlSandbox: rlSandbox{c: r.c, id: br.Sandbox.ID, node: node}, paths: paths})
		if br.Path != "fast" {
			return out, nil, cleanup, fmt.Errorf("branch %d took the %s path, not the fast one: %s", br.Branch, br.Path, br.Reason)
		}
	}
	return out, []string{"POST /v1/sandboxes/BASE/fork {count: B} (untimed setup)", "POST /v1/sandboxes/ID/sessions/py/run (the action)",
		"POST /v1/sandboxes/ID/restore {node: the fork's node} (the reset)"}, cleanup, nil
}
