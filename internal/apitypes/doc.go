// Package apitypes is the wire form of the daemon's API (docs/API.md): every JSON
// request body and answer that crosses the unix socket, defined once, here.
//
// The daemon's packages (state, store, cgroup, sandbox, session, files, fastpath, api)
// name these types through aliases, and the Go client (internal/client) uses them
// directly, so a client imports this package and errdefs and nothing of the daemon.
// The package depends on the standard library only, and holds data, not behaviour:
// defaults, validation and everything that computes a value live in the daemon.
//
// Every JSON field name and omitempty is a contract: the Python client
// (clients/python) and docs/API.md rely on them. golden_test.go fixes them; a change
// there is a change of the API, to make in docs/API.md and the Python client too.
// Node, Sandbox and Image are also the records of the daemon's store (index.db,
// image.json): a change to them is a change of the on-disk format as well.
//
// Routes and the types they take and answer (all under /v1):
//
//	GET    /health                              Health
//	POST   /sandboxes                           CreateOptions -> SandboxInfo (201)
//	GET    /sandboxes                           SandboxList
//	GET    /sandboxes/{id}                      SandboxInfo
//	DELETE /sandboxes/{id}                      Removed
//	POST   /sandboxes/{id}/exec                 ExecRequest -> ExecResult, or StreamEvent lines
//	POST   /sandboxes/{id}/sessions             SessionOptions -> SessionInfo (201)
//	GET    /sandboxes/{id}/sessions             SessionList
//	GET    /sandboxes/{id}/sessions/{name}/logs raw bytes
//	DELETE /sandboxes/{id}/sessions/{name}      SessionKilled
//	POST   /sandboxes/{id}/checkpoint           CheckpointRequest -> OpResult (201)
//	POST   /sandboxes/{id}/restore              RestoreRequest -> OpResult
//	GET    /tree                                Tree
//	GET    /nodes/{id}                          NodeInfo
//	DELETE /nodes/{id}                          NodesRemoved
//	POST   /nodes/{id}/pin                      PinRequest -> NodeInfo
//	GET    /images                              ImageList
//	POST   /images                              ImportRequest -> Image (201), or ImportEvent lines
//	DELETE /images/{name}                       Removed
//	POST   /sync                                Synced
//	GET    /sandboxes/{id}/files                raw bytes (HeaderFileSize, HeaderFileMode), or FileContent
//	PUT    /sandboxes/{id}/files                raw bytes -> FileInfo
//	DELETE /sandboxes/{id}/files                Removed
//	GET    /sandboxes/{id}/files/list           FileListing
//	GET    /sandboxes/{id}/files/stat           FileInfo
//	POST   /sandboxes/{id}/files/mkdir          MkdirResult
//
// Every error is an ErrorBody, with the HTTP status of its code (errdefs.HTTPStatus).
package apitypes

// Version is the API version, the first element of every route's path.
const Version = "v1"
