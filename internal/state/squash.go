package state

import (
	"errors"
	"fmt"
	"runtime"
	"time"

	"golang.org/x/sys/unix"

	"deltabox/internal/overlay"
	"deltabox/internal/squash"
	"deltabox/internal/store"
)

// Squashing long stacks (internal/squash has the mechanism): once a new node's stack
// holds SquashDepth layers above the image, one goroutine writes, in the background
// and at idle CPU and I/O priority, a layer that shows the node's whole stack, and
// records it on the node (store.Node.Squash). From then on stack() stops at that
// layer, so that the node's restores, its descendants' and the sandbox's next
// checkpoint state mount at most SquashDepth+1 lowers: a restore at depth 1,000 costs
// about what one at depth SquashDepth does, and depth passes overlayfs's 500 lowers.
//
// What never changes: a squash layer is written into a fresh layer directory, frozen,
// and only then named by the node's record (the index syncs the store before it
// commits a record that names one), so a crash at any point leaves either no squash
// (the directory is swept at start) or a complete one. Mounts made before the squash
// keep their lowers, which stay (they are the ancestors' own layers). The layer belongs
// to the node and goes with it (RemoveNode); squash layers are store overhead, counted
// in no sandbox's disk quota.
//
// Goroutine ownership: squashLoop is the manager's (m.wg), ends at Close; it takes mu
// only to read the stack and to record the result.

// DefaultSquashDepth: a stack of 64 layers mounts in about 1.1x the time of one
// (a restore at depth 400 took 1.7x depth 1 before squashing), and a squash walks
// the node's whole tree once per 64 checkpoints of one line.
const DefaultSquashDepth = 64

// squashNow is the stack length at which a checkpoint squashes before it answers: the
// background fell that far behind (a machine too loaded for its idle thread), and the
// line's next checkpoints would meet overlayfs's 500 lowers.
const squashNow = overlay.MaxLowers - 100

// queueSquash asks for node id's stack to be squashed if it is long enough. It does not
// block (with the queue full the request is dropped, and the next checkpoint on the line
// asks again), but at squashNow layers, where it squashes at once.
func (m *Manager) queueSquash(id string, stackLen int) {
	if m.cfg.SquashDepth <= 0 || stackLen < m.cfg.SquashDepth {
		return
	}
	if stackLen >= squashNow {
		m.squashNode(id)
		return
	}
	select {
	case m.squashQ <- id:
	default:
	}
}

// squashLoop squashes queued nodes one at a time, until Close.
func (m *Manager) squashLoop() {
	defer m.wg.Done()
	for {
		select {
		case <-m.stop:
			return
		case id := <-m.squashQ:
			m.squashNode(id)
		}
	}
}

// squashNode writes and records a squash layer for node id, unless it has one, has
// gone, or its stack got short meanwhile (an ancestor was squashed).
func (m *Manager) squashNode(id string) {
	m.mu.Lock()
	n := m.nodes[id]
	if n == nil || n.removing || n.Squash != 0 {
		m.mu.Unlock()
		return
	}
	stack, image := m.stack(id), n.Image
	m.mu.Unlock()
	if len(stack) < m.cfg.SquashDepth {
		return
	}
	start := time.Now()
	layer, st, err := m.buildSquash(stack, image)
	if err != nil {
		m.log.Warn("squash a node's stack (restores to it mount every layer meanwhile)", "node", id, "layers", len(stack), "err", err)
		return
	}
	m.mu.Lock()
	n = m.nodes[id]
	if n == nil || n.removing || n.Squash != 0 {
		m.mu.Unlock()
		if err := store.RemoveAll(m.st.LayerDir(layer)); err != nil {
			m.log.Warn("remove the squash of a node removed meanwhile (the start-up sweep removes it)", "node", id, "err", err)
		}
		return
	}
	n.Squash = layer
	cp := n.Node
	n.seq = m.st.Index.Apply(store.Op{PutNode: &cp})
	m.mu.Unlock()
	m.log.Debug("squashed a node's stack", "node", id, "layers", len(stack), "layer", layer, "took", time.Since(start), "stats", st)
}

// buildSquash writes a frozen layer showing stack (top first) over image, on a thread
// of its own at idle CPU and I/O priority: it is never on an answer's path. The thread
// ends with it (its priorities are not handed to other goroutines).
func (m *Manager) buildSquash(stack []uint64, image string) (uint64, *squash.Stats, error) {
	type result struct {
		id  uint64
		st  *squash.Stats
		err error
	}
	done := make(chan result, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread exits with the goroutine
		squash.IdlePriority()
		id, st, err := m.buildSquashOnThread(stack, image)
		done <- result{id, st, err}
	}()
	r := <-done
	return r.id, r.st, r.err
}

func (m *Manager) buildSquashOnThread(stack []uint64, image string) (uint64, *squash.Stats, error) {
	var layers []string
	for _, l := range stack {
		layers = append(layers, m.st.LayerFrozen(l))
	}
	base := m.st.ImageRootfs(image)
	view, err := overlay.Mount(overlay.Spec{Lowers: append(append([]string{}, layers...), base)})
	if err != nil {
		return 0, nil, err
	}
	defer unix.Close(view)
	id, err := m.newLayer()
	if err != nil {
		return 0, nil, err
	}
	st, err := squash.Build(view, base, layers, m.st.LayerDiff(id))
	if err == nil {
		err = m.st.Freeze(id)
	}
	if err != nil {
		if rerr := store.RemoveAll(m.st.LayerDir(id)); rerr != nil {
			err = errors.Join(err, fmt.Errorf("remove the half-made layer %d (the start-up sweep removes it): %w", id, rerr))
		}
		return 0, nil, err
	}
	m.st.DropUpperDirs(id)
	return id, st, nil
}
