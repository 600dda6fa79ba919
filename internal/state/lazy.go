package state

import (
	"fmt"
	"slices"

	"deltabox/internal/durable"
	"deltabox/internal/errdefs"
)

// Lazy restores from images (durable/lazy.go). A restore from a node's image can give the
// templates back before their memory: CRIU restores their anonymous memory empty,
// registered with a userfaultfd, and a `criu lazy-pages` server copies each page in when
// it is first touched and the rest in the background. The restore then forks the live
// processes from those templates at once (the fork is followed by the same server,
// UFFD_FEATURE_EVENT_FORK), so the first command answers before the whole image is read:
// worth it for large heaps, where an eager restore reads and maps every page first.
//
// The rule that keeps it exact: until the server reports that every page is in, the
// node's templates and every process forked from them may still miss pages, and a
// server that ends early (killed, its deadline) leaves those pages reading as zeros. So
//   - a checkpoint of the sandbox first waits for its lazy restores to finish (waitLazy):
//     no template, image copy or CRIU dump is ever taken of a process still missing
//     pages, and a failed server refuses the checkpoint;
//   - a server that fails ends what may have read zeros (watchLazy): the node's templates
//     (the node restores from its image again next time) and the sandbox's sessions and
//     processes (they restart at their next call), with an error in the daemon's log;
//   - the image's pages stay in its directory until the server is done.
// A restore into the same sandbox meanwhile (to this node or another) needs nothing
// more: the server follows the forks, and processes it kills are dropped by it.
//
// Lock order: s.lazyMu is a leaf. watchLazy's goroutine takes s.opMu (after the
// server ended), so nothing may wait for that goroutine under s.opMu: waitLazy waits
// on the servers themselves.

// lazyRestore is one lazy-pages server of a restore into s, with what it serves.
type lazyRestore struct {
	l    *durable.Lazy
	node string
	dir  string // the image whose pages it reads (dropped once it is done)
}

// lazyFor says whether a restore from an image whose pages hold pages bytes is lazy:
// choice ("always", "never") is the client's (RestoreOptions.LazyImage), else the
// daemon's.
func (m *Manager) lazyFor(s *sb, pages int64, choice string) bool {
	switch choice {
	case "always":
		return true
	case "never":
		return false
	}
	min := m.cfg.LazyRestoreMinBytes
	if min < 0 || m.templateBudget(s) <= 0 {
		// Without a template budget of their own, templates share memory_mb with the
		// live processes, and a lazy restore holds the heap twice (the template's pages
		// and the live process's are filled apart): eager, as before.
		return false
	}
	return pages >= min
}

// watchLazy registers a restore's servers and, for each, a goroutine that waits for it
// and then drops the image's pages, or on failure ends what it served (above).
func (m *Manager) watchLazy(s *sb, lrs []*lazyRestore) {
	if len(lrs) == 0 {
		return
	}
	s.lazyMu.Lock()
	s.lazy = append(s.lazy, lrs...)
	s.lazyMu.Unlock()
	for _, lr := range lrs {
		// In m.wg, until the server ends or the daemon stops (Close): a daemon that stops
		// leaves the server running (its own process group), and it finishes the
		// sandbox's pages for the next daemon.
		m.wg.Add(1)
		go func() {
			defer m.wg.Done()
			select {
			case <-lr.l.Done():
			case <-m.stop:
				return
			}
			err := lr.l.Err()
			if err != nil {
				m.log.Error("a lazy restore from an image failed: its node's templates and the sandbox's sessions end", "sandbox", s.rec.ID, "node", lr.node, "err", err)
				s.opMu.Lock()
				s.tmplMu.Lock()
				m.dropNodeTemplates(s, lr.node)
				s.tmplMu.Unlock()
				m.endSessions(s, fmt.Sprintf("ended: the lazy restore of node %s's processes from its image failed (%v), and they may have read missing memory as zeros", lr.node, err))
				if s.rt != nil {
					if _, kerr := m.killAll(s, m.keepPids(s, nil), true); kerr != nil {
						m.log.Error("a lazy restore failed, and its processes could not all be killed", "sandbox", s.rec.ID, "err", kerr)
					}
				}
				s.opMu.Unlock()
			}
			_ = durable.DropPages(lr.dir) // a copy its refs can make again: disk only
			s.lazyMu.Lock()
			s.lazy = slices.DeleteFunc(s.lazy, func(x *lazyRestore) bool { return x == lr })
			s.lazyMu.Unlock()
		}()
	}
}

// waitLazy waits until the lazy restores into s have put every page in (each bounded by
// its server's deadline, durable.LazyTimeout), and refuses if one failed.
// Precondition: s.opMu held.
// +checklocks:s.opMu
func (m *Manager) waitLazy(s *sb) error {
	s.lazyMu.Lock()
	lrs := slices.Clone(s.lazy)
	s.lazyMu.Unlock()
	for _, lr := range lrs {
		if err := lr.l.Wait(durable.LazyTimeout); err != nil {
			return fmt.Errorf("the sandbox's processes came from a lazy restore of node %s that did not complete: %w; they are being ended, and the next call starts its session afresh (%w)", lr.node, err, errdefs.ErrConflict)
		}
	}
	return nil
}
