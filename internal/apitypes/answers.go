package apitypes

// The answers that wrap a list in an object, or acknowledge a change.

// SandboxList is the answer of GET /v1/sandboxes.
type SandboxList struct {
	Sandboxes []*SandboxInfo `json:"sandboxes"`
}

// SessionList is the answer of GET /v1/sandboxes/{id}/sessions (ended sessions
// included: Running false, with Exit).
type SessionList struct {
	Sessions []SessionInfo `json:"sessions"`
}

// ImageList is the answer of GET /v1/images.
type ImageList struct {
	Images []Image `json:"images"`
}

// Removed is the answer of DELETE /v1/sandboxes/{id} (the id), DELETE
// /v1/images/{name} (the name) and DELETE /v1/sandboxes/{id}/files (the path).
type Removed struct {
	Removed string `json:"removed"`
}

// NodesRemoved is the answer of DELETE /v1/nodes/{id}: the node and its subtree.
type NodesRemoved struct {
	Removed []string `json:"removed"`
}

// SessionKilled is the answer of DELETE /v1/sandboxes/{id}/sessions/{name}.
type SessionKilled struct {
	Killed string `json:"killed"` // the session's name
}

// Synced is the answer of POST /v1/sync, sent once every change made before it is
// durable.
type Synced struct {
	Durable bool `json:"durable"` // always true
}

// Health is the answer of GET /v1/health.
type Health struct {
	API string `json:"api"` // Version
	OK  bool   `json:"ok"`
}
