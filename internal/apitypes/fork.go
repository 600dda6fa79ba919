package apitypes

// ForkRequest is the body of POST /v1/nodes/{id}/fork: Count new sandboxes on the node,
// each made with the create options given (CreateOptions's fields, inline). Image and
// Workdir default to the node's image and the workdir of the sandbox that made it; ID,
// when given, names the branches ID-0, ID-1, ... (ID itself when Count is 1).
type ForkRequest struct {
	Count int `json:"count"`
	CreateOptions
	// Processes: "auto" (default) carries the node's processes where a path can, else
	// files only with the reason; "require" fails the fork (409) rather than fall back;
	// "never" carries files only.
	Processes string `json:"processes,omitempty"`
	// ImageWaitMS bounds the wait for the node's durable image, when it is still being
	// written (0: 120000). Past it the fork falls back as Processes says.
	ImageWaitMS int64 `json:"image_wait_ms,omitempty"`
}

// SandboxForkRequest is the body of POST /v1/sandboxes/{id}/fork: a checkpoint of the
// sandbox (Checkpoint: its label, wait_ms, pin...), then a fork of the node it made
// (ForkRequest's fields, inline).
type SandboxForkRequest struct {
	ForkRequest
	Checkpoint CheckpointRequest `json:"checkpoint"`
}

// ForkResult is the answer of a fork: the sandboxes made, in branch order.
type ForkResult struct {
	Node       string       `json:"node"`
	Count      int          `json:"count"`
	Branches   []ForkBranch `json:"branches"`
	DurationMS float64      `json:"duration_ms"`
	// ImageWaitMS: how long the fork waited for the node's durable image.
	ImageWaitMS float64 `json:"image_wait_ms,omitempty"`
	// Checkpoint: the checkpoint that made the node (POST /v1/sandboxes/{id}/fork).
	Checkpoint *OpResult `json:"checkpoint,omitempty"`
}

// ForkBranch is one sandbox of a fork: its info, the path that put the node's state in
// it, and why that path.
type ForkBranch struct {
	Branch  int         `json:"branch"`
	Sandbox SandboxInfo `json:"sandbox"`
	// Path: "durable" (the node's processes restored from its durable CRIU image, at
	// their PIDs), "fast" (forked from its templates into sibling namespaces: state/family.go), or "files" (the
	// node's files only: its sessions start afresh); Reason says why this path.
	Path   string `json:"path"`
	Reason string `json:"reason"`
	// Restore is the restore that put the branch on the node.
	Restore *OpResult `json:"restore"`
	// DurationMS: the branch's time in the daemon, its create and its restore
	// (branches are made a few at once: one per CPU).
	DurationMS float64 `json:"duration_ms"`
	// Identity is what /run/deltabox/identity says in the branch.
	Identity *ForkIdentity `json:"identity,omitempty"`
}

// ForkIdentity is a branch's identity, the JSON of /run/deltabox/identity inside it:
// agent code reseeds its random generators from it (DeltaBox never writes process
// memory).
type ForkIdentity struct {
	Sandbox    string `json:"sandbox"`
	Branch     int    `json:"branch"`
	Count      int    `json:"count"`
	ParentNode string `json:"parent_node"`
}
