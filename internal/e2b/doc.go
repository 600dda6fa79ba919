// Package e2b serves E2B's APIs from the daemon, so that E2B's SDKs (the npm `e2b`
// package, its Python twin) drive DeltaBox sandboxes unchanged, pointed here by their
// own settings: E2B_API_URL (the control plane), E2B_SANDBOX_URL (the sandbox's envd)
// and E2B_API_KEY (a key of package auth). Both APIs are served on the daemon's TCP
// listener (package gateway); nothing runs inside the sandbox for them, so nothing an
// SDK holds open (a stream, a connection) can end up inside a checkpoint.
//
//	SDK ──X-API-Key──▶ control plane (control.go) ──▶ state.Manager: Create, Remove,
//	                   /v2/sandboxes, pause, connect…     CheckpointWith, RestoreWith
//	SDK ──E2b-Sandbox-Id, X-Access-Token──▶ envd (process.go, filesystem.go, files.go)
//	                   process.Process  ──▶ Manager.Exec (bash -l -c, as the user)
//	                   filesystem.*, /files ──▶ Manager.FileOp (reads) / Exec (writes)
//	client ──Host PORT-ID.DOMAIN, e2b-traffic-access-token──▶ ports.go (getHost)
//	                   portproxy.Serve ──▶ Manager.DialPort (127.0.0.1:PORT in its netns)
//
// Envd's RPCs are E2B's published protobuf definitions (package spec, generated code),
// served by connectrpc.com/connect: the Connect protocol with JSON over HTTP/1.1, as the
// SDKs send it. A request names its sandbox in the E2b-Sandbox-Id header (the SDK sets
// it on every envd call) and proves access with X-Access-Token, the envdAccessToken
// the control plane answered for that sandbox: 128 random bits drawn when this package
// first sees the sandbox, kept with its E2B state (in memory) and dropped at its removal,
// so a sandbox made later under the same id has another. A token works while one of the
// API keys it was handed to is valid (a revoked key's tokens die with it). The E2B state
// is not persisted: a restart draws new tokens (Sandbox.connect gets the new one).
//
// How E2B's model maps onto DeltaBox's:
//   - Template "base" (the SDK's default) is the default image; any other template is
//     an image name or a node id (a snapshot: its files, in a new sandbox).
//   - E2B's default user `user` (home /home/user, uid 1000) is added to each sandbox at
//     create when its /etc/passwd lacks it; commands run as that user unless the
//     request names another (Authorization: Basic user:). The sandbox itself stays
//     root's (no CreateOptions.User), so that checkpoints keep its processes.
//   - A command (process.Start) is one DeltaBox exec whose client may go away: its
//     output is fanned out to every stream attached (Start, Connect), the first 1 MiB
//     of each stream live, its last 3 MiB kept and sent at exit (sandbox.capture).
//     Its pid is a handle of this package, not the process's pid in the sandbox.
//   - Pause is a checkpoint; the sandbox then refuses envd traffic (502, as E2B answers
//     for a sandbox that is not running) until connect restores that checkpoint, so the
//     sandbox continues from exactly the state it paused in. Between the two, its
//     processes are not frozen: whatever they do is undone by the restore.
//   - A sandbox's timeout kills it (or pauses it, autoPause) when it expires; timers
//     live in the daemon's memory and do not survive a restart.
package e2b
