// Package durable writes a sandbox's processes to disk as CRIU images and puts them
// back into the same sandbox: the durable half of a checkpoint, for when a template is
// evicted or lost (internal/state/durable.go drives it);
// docs/research/criu-sandbox/README.md has what it was measured to do and why it is
// built this way.
//
// The contract:
//
//	Dump(pid, dir)        the tree rooted at host PID pid -> CRIU images in dir, and
//	                      durable.json (Manifest) written last. The tree goes on as it
//	                      was: running, or stopped if it was in a group stop (a
//	                      template its tracer let go stays stopped, SIGSTOP queued).
//	PageStore.Ingest(dir) dir's pages-N.img -> pages-N.refs; each distinct page is kept
//	                      once in the store. The image is durable when it returns.
//	PageStore.Materialize(dir)
//	                      pages-N.img back from the refs (reflinks on XFS), for:
//	Restore(dir, sandbox) the tree back into the sandbox whose namespaces and terminals
//	                      it is given, with its PIDs (which must be free), as children
//	                      of the sandbox's init, running or stopped as dumped.
//
// What an image holds, and what it leaves to the sandbox: the sandbox's PID and network
// namespaces, every mount (files are named by path and opened again in the state the
// restore joins) and the terminals (each session's pty belongs to the daemon) are
// external; tmpfs mounts are not archived. So an image restores into the sandbox it
// came from, or into a new one whose PIDs were kept free for it (a fork's branch:
// internal/state/fork.go), onto a state whose files match the node's. Credentials are
// the tasks' own, inside their user namespace: they land on the target's host range.
//
// A restore, drawn (CRIU 4.1.1 with scripts/criu/0001, which keeps the root task out of
// namespaces it joins; see restore.go for each step's reason; the cgroup namespace is
// the one the sandbox's commands run in, sbinit.Client.CommandCgroupNS):
//
//	daemon thread                   criu swrk (via unshare --mount-proc)      root task
//	setns(sandbox pidns,
//	      sandbox cgroupns) --fork--> in the sandbox's PID and cgroup
//	setns(own ones), unlock           namespaces, a /proc of it, a
//	                                  private mount ns
//	CRIU's pid into the sandbox's
//	cgroup.procs (v1, v2)
//	RESTORE request over   ------>   reads images (symlink to dir)
//	SEQPACKET                        clone3(set_tid = image PID) ---------->  new time ns,
//	                                                                          setns net, ipc,
//	                                                                          uts, mnt, time,
//	                                                                          then user;
//	                                                                          files, pages,
//	                                                                          seccomp...
//	<------------------------------- answer (pid in the sandbox)
//	close socket                     exits: the task is reparented to the sandbox's init
//
// Every CRIU call has a deadline (DumpTimeout, RestoreTimeout) and runs as
// criu.Runner found out works here (CRIU_FAULT=130 where hardware breakpoints are not
// delivered).
package durable
