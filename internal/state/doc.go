// Package state is DeltaBox's state manager: it owns the snapshot tree, the sandboxes
// and their positions in the tree, and makes every checkpoint and restore one step
// that either completes or leaves the sandbox as it was.
//
// # The tree
//
// A node is an immutable checkpoint. Its filesystem is a stack of frozen layers: its
// own layer (the sandbox's upper at the time of the checkpoint, frozen) on top of its
// parent's stack, down to the image. A checkpoint with no changes reuses the parent's
// top layer. A sandbox stands on a node (its head) with a fresh writable upper on top of
// the node's stack. A node a sandbox stands on, or has descendants a sandbox stands on,
// cannot be removed. A node made while processes ran also holds their templates
// (templates.go), in the sandbox that made it.
//
// # Where things are
//
//	checkpoint.go  Checkpoint: its numbered steps, each with its undo
//	restore.go     Restore: its numbered steps, each with its undo
//	undo.go        the undo list both use (last in, first out)
//	op.go          what both share: the queue of calls and switches (admission: who
//	               waits for whom), beginOp, the answer (OpResult), the kill of the rest
//	processes.go   the processes a checkpoint seizes, forks and moves; EndLive at a restore
//	revive.go      the templates a restore seizes and forks back
//	kernelstate.go System V IPC and host names: refused or recorded at a checkpoint, reset at a restore
//	templates.go   the registry of templates per node
//	layers.go      layer ids, stacks, fresh uppers
//	tree.go        queries of the tree, node removal
//	prepare.go, warm.go   states mounted ahead of time (next checkpoint, warm restores)
//	views.go       templates parked on a read-only view of their node
//	procwarm.go    the warm-up of restored processes' memory
//	background.go  work after the answer, and the gate that keeps it out of operations
//	diskquota.go   the disk watcher: uppers measured by XFS project, disk_mb enforced
//	restart.go     sandboxes outliving the daemon: what init keeps, template records,
//	               adoption by the next daemon
//	budget.go      the template memory budget: the kernel limit, measures after answers,
//	               the admission of checkpoints (507), the eviction hook, pins
//	fork.go        Fork: N new sandboxes on a node, its processes restored from its
//	               durable image into each (pidfloor.go keeps their PIDs free)
//	sandboxes.go, sessions.go, files.go, images.go   the rest of the API's verbs
//
// # Locking
//
// The one lock order of the daemon (docs/DESIGN.md points here). Each lock may be taken
// while holding those above it on its branch, never one below; outermost first:
//
//	Manager.diskMu          one disk usage pass at a time (diskquota.go: inodeBytes,
//	                        passAt, passFreed); under no other
//	                        lock, and nothing under it but Manager.mu, images.mu and
//	                        sb.mu, each briefly: never a sandbox's opMu, which a
//	                        checkpoint holds across its CRIU dump (seconds); a pass
//	                        stops sandboxes after it lets go (stopWriters)
//	sb.opMu                 a sandbox's position (rec, seq), rt, err, kns, tracer, hostPids; serialises
//	                        its state changes: checkpoint, restore, rm, the start of an exec
//	  sb.keepMu             keepSessions (restart.go): kept; held across round trips to init
//	    sb.mu
//	  Manager.treeMu        node layers on disk: shared to mount a stack (checkpoint,
//	                        restore), exclusive to delete one (RemoveNode)
//	    sb.tmplMu           the seizure of the sandbox's templates: a restore, parking
//	                        (views.go), eviction (budget.go)
//	      sb.copyMu         a copy of a template being made for its image (durable.go:
//	                        copyForImage) against the lists of the sandbox's processes
//	                        (holdOthers, killAll): held across the copy's injected fork
//	                        and a round trip to init (KillAll, Procs), so not a leaf
//	        images.mu       the image queue (durable.go): nodes, queue, copies, collect
//	      sb.buildMu        one background build of a next or warm state (~1 ms of mounts)
//	        sb.prepMu       next, nextGen, warm, building, buildDone, warmClosed; briefly
//	          sb.limitMu    the kernel memory limit (budget.go: fitKernelLimit)
//	            Manager.mu     nodes, sandboxes, templates, procRecs, idsTaken, nextLayer,
//	                           sessionStarts; briefly, never across a mount, fork or index wait
//	              images.mu    (restart.go: queueImage)
//	              sb.mu        execs, adm, removed, sessions, sessionOpts, ended, warming,
//	                           stats, oomSeen, disk, budget, memRT; briefly
//
// Leaves, under which nothing is taken: sb.lazyMu (lazy.go: lazy; watchLazy's goroutine
// takes opMu only after its server ended, so nothing waits for it under opMu),
// background.mu, memCache's mutex (stats.go), session.Session's own.
//
// Each guarded field says so with a +checklocks annotation (gVisor's checklocks), and
// each function whose caller must hold a lock says which (+checklocks:s.opMu);
// scripts/test.sh runs the analyzer on this package as on the others. What it cannot
// follow is marked +checklocksignore with the reason, on the line where it can be: the
// uses of opMu by the callers of lockLive, enterCall and queueOp (which return holding it
// on success only) and beginOp (which hands it and treeMu over in a func), those
// functions themselves; start-up code that New runs before the manager is shared
// (restart.go's adoption whole); an undo step, a closure that undoList.run calls later,
// under opMu; and the return of a closure called inline under a lock, reported as
// returning with it held (gVisor issue 11203: the findings of implicit returns carry no
// position, and -wrappers=false drops them, as gVisor's own configuration does). rec is
// not annotated: guarded by opMu, read under Manager.mu for listings, its ID unlocked.
//
// # Goroutines
//
// API handlers run operations on their own goroutines (a fork's, a few workers that it
// joins before it answers). The manager starts these, each
// counted in Manager.wg, which Close waits for after it has stopped every sandbox:
// fillUppers and watchDisk (until Close), the disk watcher's stops and reclaims
// (diskquota.go: stopWriters, reclaimDisk), the work queued after an answer (background.go: next and
// warm state builds, parking, closing old namespaces, the measure of templates' memory), the release of dropped states
// (prepare.go, warm.go), the kill of memory holders after a restore (restore.go), and
// the warm-up of restored processes (procwarm.go, stopped by stopProcWarm). The
// ptrace of a sandbox's processes is owned by its remote.Tracer's thread (processes.go).
package state
