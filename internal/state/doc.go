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
//	checkpoint.go  Checkpoint: its numbered steps, each with its undo; the early answer
//	answer.go      the node ids of checkpoints that answered early, until they end
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
//	family.go, forkfast.go   the fast fork: a family holder, branches in sibling
//	               namespaces, templates placed at their PIDs; famrestart.go: its records,
//	               adopted by the next daemon
//	spares.go      restores of a family member that swap in a spare made ahead
//	criutrees.go   processes the fast path refuses, taken by CRIU with their tree
//	durable.go, lazy.go   templates' durable images, restores from them (lazy: userfaultfd)
//	squash.go      long stacks squashed into one layer in the background
//	transfer.go    nodes exported and imported
//	stats.go       counters, memory and template figures the API shows
//	manager.go, config.go   the Manager, its start-up (New) and Close; its Config
//	ids.go, runas.go, network.go, signal.go, crashpoint*.go   host id ranges, a
//	               run-as user, the network, signals through init, crash hooks (tests)
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
//	                        (a checkpoint that answered early holds it, with treeMu shared,
//	                        on a goroutine of its own until its end: checkpoint.go)
//	  sb.keepMu             keepSessions (restart.go): kept; held across round trips to init
//	    sb.mu
//	  Manager.treeMu        node layers on disk: shared to mount a stack (checkpoint,
//	                        restore), exclusive to delete one (RemoveNode)
//	    sb.tmplMu           the seizure of the sandbox's templates: a restore, parking
//	                        (views.go), eviction (budget.go), a fast fork of it (family.go)
//	      family.mu         a fork family holder's templates (family.go): a member's
//	                        restore that forks from them (step 1 to its end), a spare's
//	                        placement (spares.go: buildSpare, under no sandbox lock),
//	                        their record (restart.go: recordTemplatesOf)
//	        sb.copyMu       a copy of a template being made for its image (durable.go:
//	                        copyForImage) against the lists of the sandbox's processes
//	                        (holdOthers, killAll): held across the copy's injected fork
//	                        and a round trip to init (KillAll, Procs), so not a leaf
//	          images.mu     the image queue (durable.go): nodes, trees, queue, copies,
//	                        dropped, collect
//	        sb.buildMu      one background build of a next or warm state (~1 ms of mounts)
//	          sb.prepMu     next, nextGen, warm, building, buildDone, warmClosed; briefly
//	            sb.limitMu  the kernel memory limit (budget.go: fitKernelLimit)
//	              Manager.mu   nodes, kids, pending, failedOrder, sandboxes, templates, famOf,
//	                           families, procRecs, idsTaken, nextLayer, sessionStarts; briefly,
//	                           never across a mount, fork or index wait
//	                images.mu  (restart.go: queueImage)
//	                sb.mu      execs, adm, removed, lateFailure, sessions, sessionOpts,
//	                           ended, warming, stats, oomSeen, disk, reclaiming, budget,
//	                           memRT, net; briefly
//
// Leaves, under which nothing is taken: sb.lazyMu (lazy.go: lazy; watchLazy's goroutine
// takes opMu only after its server ended, so nothing waits for it under opMu),
// sb.spareMu (spares.go: spares, spareMaking, spareClosed; a spare is made with it let
// go), background.mu, memCache's mutex (stats.go), session.Session's own.
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
// not annotated: guarded by opMu, read under Manager.mu for listings, its ID unlocked;
// nor family.members, another struct's lock's (Manager.mu), which checklocks cannot name.
//
// # Goroutines
//
// API handlers run operations on their own goroutines (a fork's, a few workers that it
// joins before it answers, as a fast fork joins its branches' starts: family.go). The
// manager starts these, each counted in Manager.wg, which Close waits for after it has
// stopped every sandbox: fillUppers, watchDisk and squashLoop (until Close), the image
// queue's worker (durable.go: startImages), the disk watcher's stops and reclaims
// (diskquota.go: stopWriters, reclaimDisk), the steps after a checkpoint's early answer
// (checkpoint.go), the work queued after an answer (background.go: next and warm state
// builds, parking, closing old namespaces, the measure of templates' memory, spares made
// ahead), the release of dropped states (prepare.go, warm.go) and spares (spares.go:
// dropSpares), the kill of memory holders after a restore (restore.go), the watch of
// each lazy restore's server (lazy.go, until it ends or Close), and the warm-up of
// restored processes (procwarm.go, stopped by stopProcWarm). The ptrace of a sandbox's
// processes is owned by its remote.Tracer's thread (processes.go).
package state
