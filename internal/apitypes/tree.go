package apitypes

import "time"

// Node is one checkpoint: an immutable point of the snapshot tree, as the API shows
// it; NodeInfo embeds it. The index keeps its own record (store.Node; state/tree.go:
// apiNode converts).
type Node struct {
	ID      string    `json:"id"`
	Parent  string    `json:"parent,omitempty"` // empty: the node sits directly on its image
	Image   string    `json:"image"`
	Created time.Time `json:"created"`
	Label   string    `json:"label,omitempty"`
	Sandbox string    `json:"sandbox,omitempty"` // the sandbox it was taken from
	// Layer is the top layer of the node's stack: its own (Own) frozen from the
	// sandbox's upper, or its parent's when nothing changed (0: the image alone).
	Layer uint64 `json:"layer"`
	Own   bool   `json:"own_layer"`
	Bytes int64  `json:"layer_bytes"` // apparent size of its own layer, -1 until measured
	// SquashLayer is the layer the daemon wrote to stand for the node's whole stack
	// (docs/design/squash.md): its restores and its descendants' mount it instead of
	// the layers under it. 0: none (yet).
	SquashLayer uint64 `json:"squash_layer,omitempty"`
}

// NodeInfo is what the API shows of a node: the answer of GET /v1/nodes/{id}, each of
// Tree's nodes, and OpResult's node.
type NodeInfo struct {
	Node
	Durable   bool     `json:"durable"`             // its index record is on disk
	Children  []string `json:"children,omitempty"`  // sorted by creation
	Sandboxes []string `json:"sandboxes,omitempty"` // sandboxes standing on it
	Depth     int      `json:"depth"`               // layers a restore of it mounts (image excluded)
	// Templates: the node's process templates and their memory (GET /v1/tree and
	// /v1/nodes/ID only; not in checkpoint and restore answers).
	Templates *TemplateInfo `json:"templates,omitempty"`
	// Pinned: a hint that the client will restore it again, so its templates are never
	// evicted over the template budget (CheckpointRequest.Pin, POST /v1/nodes/ID/pin).
	Pinned bool `json:"pinned,omitempty"`
	// LastRestored: its last restore (eviction goes least recently restored first).
	LastRestored *time.Time `json:"last_restored,omitempty"`
	// ProcessImage: the node's durable process image (absent: none asked for, as for a
	// node without templates, or images are off).
	ProcessImage *ImageInfo `json:"process_image,omitempty"`
	// Pending: in a checkpoint's early answer only: its templates are still being made;
	// whatever names the node (a read, a restore, a fork) waits for them (docs/API.md,
	// "Checkpoints that answer early").
	Pending bool `json:"pending,omitempty"`
	// CompleteMS: how long its checkpoint took until the node was complete (its
	// answer's duration_ms is the time until the answer); for nodes made since the
	// daemon started.
	CompleteMS float64 `json:"complete_ms,omitempty"`
	// Spares: the sandboxes holding a spare of it, ready (GET /v1/nodes/{id} only): a
	// restore of it there swaps the spare in instead of forking (POST
	// /v1/nodes/{id}/prepare; docs/design/spares.md).
	Spares []string `json:"spares,omitempty"`
}

// PrepareRequest is the body of POST /v1/nodes/{id}/prepare (optional): the sandbox
// that gets a spare of the node ("": the node's own).
type PrepareRequest struct {
	Sandbox string `json:"sandbox,omitempty"`
}

// ImageInfo is a node's durable process image (NodeInfo's "process_image"): written in the
// background after its checkpoint (state/durable.go).
type ImageInfo struct {
	// State: pending (queued or being written), complete (its processes can come back
	// from it: the node's templates may be evicted), failed (see Error).
	State string `json:"state"`
	Error string `json:"error,omitempty"`
	// StoredBytes is what the image added to the store (new pages, CRIU's other
	// files); FullBytes what its full CRIU images were (what a plain dump stores).
	StoredBytes int64 `json:"stored_bytes,omitempty"`
	FullBytes   int64 `json:"full_bytes,omitempty"`
	// LagMS: how long it has been waiting (pending), or how long after its queueing it
	// was complete.
	LagMS int64 `json:"lag_ms"`
	// DumpMS: the time its dump and storing took.
	DumpMS int64 `json:"dump_ms,omitempty"`
}

// PinRequest is the body of POST /v1/nodes/{id}/pin: pin (true) or unpin a node.
type PinRequest struct {
	Pinned bool `json:"pinned"`
}

// Tree is the whole snapshot tree: the answer of GET /v1/tree.
type Tree struct {
	Nodes []*NodeInfo `json:"nodes"` // sorted by creation time
	// Roots are nodes directly on an image; OnImage lists sandboxes that stand on
	// their image with no node yet, per image.
	Roots   []string            `json:"roots"`
	OnImage map[string][]string `json:"on_image,omitempty"`
	// Templates totals every process template of the daemon and its memory.
	Templates *TemplateInfo `json:"templates"`
}

// CheckpointRequest is the body of POST /v1/sandboxes/{id}/checkpoint (optional).
type CheckpointRequest struct {
	Label string `json:"label,omitempty"`
	// EndBackground: end the processes outside the sessions that cannot be checkpointed
	// with their state, instead of refusing the checkpoint (409).
	EndBackground bool `json:"end_background,omitempty"`
	// WaitMS: while calls (execs, file operations) run, queue behind them for this
	// many milliseconds at most instead of refusing at once (409); calls that arrive
	// meanwhile wait behind the checkpoint. 0 (the default): refuse at once. At most
	// 600000 (docs/API.md: "Checkpoints that wait").
	WaitMS int64 `json:"wait_ms,omitempty"`
	// Pin the new node (NodeInfo.Pinned).
	Pin bool `json:"pin,omitempty"`
	// Answer: "early" answers once the processes are seized, and the node's templates
	// are made after the answer (the node is pending until then; the sandbox's next
	// operation waits for them); "complete" answers once the node is complete; "" is
	// the daemon's choice (early unless DELTABOX_EARLY_ANSWER=0). docs/API.md,
	// "Checkpoints that answer early".
	Answer string `json:"answer,omitempty"`
}

// RestoreRequest is the body of POST /v1/sandboxes/{id}/restore.
type RestoreRequest struct {
	Node string `json:"node"`
	// WaitMS: as CheckpointRequest's.
	WaitMS int64 `json:"wait_ms,omitempty"`
	// LazyImage chooses, when the node's templates are gone and come back from its
	// durable image, whether that restore is lazy (its memory copied in on demand and
	// in the background: faster to the first command for a large heap, the next
	// checkpoint waits for the rest): "always", "never", or "" for the daemon's choice
	// (lazy from 64 MiB of pages; DELTABOX_LAZY_RESTORE).
	LazyImage string `json:"lazy_image,omitempty"`
}

// OpResult reports one checkpoint or restore: the answer of POST
// /v1/sandboxes/{id}/checkpoint and POST /v1/sandboxes/{id}/restore.
type OpResult struct {
	Node       *NodeInfo `json:"node"`
	Sandbox    string    `json:"sandbox"`
	Killed     int       `json:"killed_processes"` // processes ended: not carried (see Processes)
	Mounted    bool      `json:"mounted"`          // false: nothing changed, no new mount
	DurationMS float64   `json:"duration_ms"`      // time inside the daemon, until the answer
	// CompleteMS: the time until the node was complete, when it was before the answer
	// (a checkpoint that answered early has none: its node's complete_ms says it).
	CompleteMS float64 `json:"complete_ms,omitempty"`
	// Processes is how many processes (sessions' and others') were checkpointed
	// (templates forked) or restored from templates; ProcessErrors says which could not
	// be (they were ended).
	Processes     int      `json:"processes"`
	ProcessErrors []string `json:"process_errors,omitempty"`
	// CRIUProcesses is how many processes outside the sessions, which the fast path
	// cannot take (several threads, live children, a pipe, a socket), the checkpoint
	// dumped through CRIU, or the restore restored from those images (not counted in
	// Processes).
	CRIUProcesses int `json:"criu_processes,omitempty"`
	// Sessions names the sessions whose processes the checkpoint kept at the node, or
	// that the restore brought back from it (same PIDs, same state); SessionsEnded the
	// sessions the operation ended (a restore to a node without their process state, a
	// process that could not be resumed, a daemon without the fast path): a bash or
	// python one starts afresh on its next call (session_restarted). Sorted.
	Sessions      []string `json:"sessions,omitempty"`
	SessionsEnded []string `json:"sessions_ended,omitempty"`
	// Warm: the restore installed a state of the node mounted ahead of time
	// (state/warm.go).
	Warm bool `json:"warm,omitempty"`
	// FromImage: the node's templates were gone (evicted, killed) and the restore
	// brought them back from the node's durable image first (state/durable.go).
	FromImage bool `json:"from_image,omitempty"`
	// FromSpare: the restore swapped in a spare of the node (its processes forked and
	// placed ahead of time) instead of forking them (docs/design/spares.md).
	FromSpare bool `json:"from_spare,omitempty"`
	// LazyImage: that restore from the image was lazy (state/lazy.go): it answered
	// before every page was read, which the image's server copies in meanwhile.
	LazyImage bool `json:"lazy_image,omitempty"`
	// Prepared: the checkpoint used the next state mounted ahead of time.
	Prepared bool `json:"prepared,omitempty"`
	// PhasesUS is the time of each step in microseconds, to see where latency goes.
	PhasesUS map[string]int64 `json:"phases_us,omitempty"`
	// WaitedMS: how long the operation queued behind running calls (wait_ms) before it
	// started; not part of DurationMS.
	WaitedMS float64 `json:"waited_ms,omitempty"`
	// Memory is the sandbox's memory after the operation, its templates' included.
	Memory *OpMemory `json:"memory,omitempty"`
	// Warnings: what the caller should act on, such as templates holding over half of
	// the sandbox's memory limit.
	Warnings []string `json:"warnings,omitempty"`
}

// OpMemory is a sandbox's memory after a checkpoint or restore (OpResult's "memory").
// The templates a checkpoint forks are processes of the sandbox: they count against its
// memory limit.
type OpMemory struct {
	LimitBytes int64 `json:"limit_bytes"` // the sandbox's memory limit (memory_mb)
	// TemplateBudgetBytes is the templates' budget (template_budget_mb), apart from
	// LimitBytes: the kernel caps UsageBytes at their sum. Absent: no budget (-1).
	TemplateBudgetBytes int64 `json:"template_budget_bytes,omitempty"`
	// KernelLimitBytes is the kernel's memory limit of the sandbox now: LimitBytes plus
	// what its templates may come to hold, up to the budget (docs/API.md, Template
	// memory). Absent without a budget (it is LimitBytes).
	KernelLimitBytes int64 `json:"kernel_limit_bytes,omitempty"`
	// UsageBytes is what the sandbox's processes, its templates included, and their page
	// cache use now (the memory cgroup's count, which the limit caps).
	UsageBytes int64 `json:"usage_bytes"`
	// NodeTemplatesRSS (checkpoint answers): the resident memory of the templates this
	// checkpoint forked. At first they share it with the live processes; as those
	// write their memory, the originals stay with the templates: this is the most the
	// node comes to hold alone.
	NodeTemplatesRSS int64 `json:"node_templates_rss_bytes,omitempty"`
	// Templates totals every template of the sandbox (all its nodes) and what they hold
	// (Memory: their pss_bytes is their share). Measured (smaps_rollup, about 1 ms per
	// 100 MB of template) only when the sandbox uses over half its limit: below that,
	// templates cannot hold more than half of it. Absent otherwise.
	Templates *TemplateInfo `json:"templates,omitempty"`
}
