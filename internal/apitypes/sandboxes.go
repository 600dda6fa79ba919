package apitypes

import "time"

// CreateOptions is the body of POST /v1/sandboxes. Every field is optional.
type CreateOptions struct {
	ID       string `json:"id,omitempty"`
	Image    string `json:"image,omitempty"`
	Workdir  string `json:"workdir,omitempty"`
	Hostname string `json:"hostname,omitempty"`
	// User runs sessions and execs as that user instead of root: "NAME", "UID",
	// "NAME:GROUP" or "UID:GID", resolved in the sandbox's own /etc/passwd and
	// /etc/group at every start of a command (a numeric one need not be listed). A
	// name the sandbox does not list is a 400. Not a limit on the API's caller: an exec
	// may name another user, root included (ExecRequest.User).
	User string `json:"user,omitempty"`
	// Limits (0: the default; see cgroup.DefaultLimits and docs/API.md). MemoryMB is
	// in MiB.
	MemoryMB int64   `json:"memory_mb,omitempty"`
	Pids     int64   `json:"pids,omitempty"`
	CPUs     float64 `json:"cpus,omitempty"`
	// DiskMB caps what the sandbox's upper layer holds (its changes since its last
	// checkpoint or restore), in MiB of allocated blocks (0: 10240; docs/API.md, Disk).
	DiskMB int64 `json:"disk_mb,omitempty"`
	// WarmProcesses: after each restore, pre-fault the pages the restored processes
	// had written, while their sessions wait for input (state/procwarm.go). Default:
	// off, or on for every sandbox when the daemon runs with DELTABOX_WARM_PROC=1.
	WarmProcesses bool `json:"warm_processes,omitempty"`
	// TemplateBudgetMB is the memory the templates of the sandbox's checkpoints may hold,
	// in MiB, apart from MemoryMB (docs/API.md, Template memory): the kernel limit is
	// their sum, and a checkpoint while the templates hold more waits, then fails with
	// 507. 0: the daemon's default (DELTABOX_TEMPLATE_BUDGET); -1: no budget of their
	// own, templates count against memory_mb (as before the budget existed).
	TemplateBudgetMB int64 `json:"template_budget_mb,omitempty"`
	// Network gives the sandbox egress through the daemon's proxy, by these rules
	// (docs/design/network.md). nil: no network (lo only).
	Network *Network `json:"network,omitempty"`
}

// Network is a sandbox's egress rules: a connection or DNS name is allowed when it
// matches an entry of AllowOut and none of DenyOut (deny wins). An entry is a domain
// ("pypi.org"), a wildcard ("*.github.com": subdomains only), "*" (everything), an IP
// or a CIDR ("10.0.0.0/8"). AllowOut must not be empty.
type Network struct {
	AllowOut []string `json:"allow_out"`
	DenyOut  []string `json:"deny_out,omitempty"`
	// Model is an OpenAI-compatible endpoint the sandbox reaches as
	// http://model.deltabox.internal (ModelHost), whatever the rules, the proxy adding
	// the key: the key never enters the sandbox or a checkpoint.
	Model *ModelEndpoint `json:"model,omitempty"`
}

// ModelHost is the name a sandbox reaches its model endpoint by (plain HTTP inside).
const ModelHost = "model.deltabox.internal"

// ModelEndpoint is a sandbox's model endpoint: URL is the upstream base (e.g.
// https://api.openai.com/v1; a request for /chat/completions inside goes to
// URL/chat/completions), Key is sent upstream as "Authorization: Bearer KEY". The
// API's answers never show the key (KeySet says one is kept).
type ModelEndpoint struct {
	URL    string `json:"url"`
	Key    string `json:"key,omitempty"`
	KeySet bool   `json:"key_set,omitempty"`
}

// NetUsage is what a sandbox's traffic through the proxy came to (Usage's "network").
type NetUsage struct {
	Connections int64 `json:"connections"` // made upstream
	Refused     int64 `json:"refused"`     // refused by the rules or the guard (each logged)
	BytesOut    int64 `json:"bytes_out"`
	BytesIn     int64 `json:"bytes_in"`
	DNSQueries  int64 `json:"dns_queries"`
	DNSRefused  int64 `json:"dns_refused"` // names not allowed: NXDOMAIN, never sent upstream
	Open        int64 `json:"open"`        // connections open now
}

// SandboxInfo is what the API shows of a sandbox: the answer of POST /v1/sandboxes,
// GET /v1/sandboxes/{id}, and each element of GET /v1/sandboxes's "sandboxes".
type SandboxInfo struct {
	Sandbox
	InitPid int    `json:"init_pid,omitempty"`
	Status  string `json:"status"`          // running | broken
	Error   string `json:"error,omitempty"` // why broken
	Stats   Stats  `json:"stats"`
	Durable bool   `json:"durable"`
	// WarmStates is how many nodes' states are kept mounted for fast restores
	// (state/warm.go).
	WarmStates int `json:"warm_states"`
	// Usage of the limits (Sandbox.Limits) by the sandbox's commands, when running.
	Usage *Usage `json:"usage,omitempty"`
	// Templates totals the sandbox's process templates (every node's) and their memory.
	Templates *TemplateInfo `json:"templates,omitempty"`
	// Disk is its upper's usage against its quota (disk_mb).
	Disk *DiskInfo `json:"disk,omitempty"`
	// TemplateBudget is its templates' memory against their budget (template_budget_mb).
	TemplateBudget *TemplateBudget `json:"template_budget,omitempty"`
}

// TemplateBudget is what a sandbox's templates hold against their budget, and the
// daemon's total against its own (SandboxInfo's "template_budget"; state/budget.go).
// Used figures are the templates' pss_anon_bytes (Memory), measured at most a second
// ago: pages a template shares with a live process count in part.
type TemplateBudget struct {
	BudgetBytes int64 `json:"budget_bytes"` // template_budget_mb; -1: none
	UsedBytes   int64 `json:"used_bytes"`
	// PinnedBytes: held by the templates of pinned nodes (never evicted).
	PinnedBytes int64 `json:"pinned_bytes"`
	PinnedNodes int   `json:"pinned_nodes"`
	// EvictableBytes: held by templates that may be evicted over budget, those of
	// unpinned nodes whose process image is complete (0 with durable images off or
	// still pending: docs/design/template-budget.md).
	EvictableBytes int64 `json:"evictable_bytes"`
	// TotalBudgetBytes and TotalUsedBytes: every sandbox's templates together
	// (DELTABOX_TEMPLATE_BUDGET_TOTAL).
	TotalBudgetBytes int64 `json:"total_budget_bytes"`
	// TotalUsedBytes adds to this sandbox's figure what the others' templates held when
	// last measured (after each checkpoint and restore, in the background; a sandbox far
	// under its budgets counts its whole memory usage instead, a bound).
	TotalUsedBytes int64 `json:"total_used_bytes"`
	// KernelLimitBytes is the kernel's memory limit of the sandbox: memory_mb plus the
	// anonymous resident memory of its templates (what they may come to hold alone), up
	// to the budget.
	KernelLimitBytes int64 `json:"kernel_limit_bytes"`
}

// DiskInfo is a sandbox's disk usage (SandboxInfo's "disk"), as the daemon's watcher
// last measured it (state/diskquota.go).
type DiskInfo struct {
	LimitMB int64 `json:"limit_mb"` // disk_mb
	// UpperBytes: the blocks allocated to the files of its upper layer (its changes since
	// the last checkpoint or restore), deleted files still open included.
	// Each of its inodes counts the store's inode size (512 B) on top of its blocks.
	UpperBytes int64 `json:"upper_bytes"`
	// ImageBytes: what the process images of the checkpoints it made hold in the store
	// (the CRIU images of the processes the fast path refused, and its templates' durable
	// images: their new pages and CRIU's other files). Counted against the limit with
	// UpperBytes.
	ImageBytes    int64 `json:"image_bytes"`
	MeasuredMSAgo int64 `json:"measured_ms_ago"`
	// Exceeded says why the sandbox's processes were stopped and its writes answer 507,
	// until files are deleted or a node restored; "" when they are not.
	Exceeded string `json:"exceeded,omitempty"`
	// Warning: the store ran out of space and the index used its reserve.
	Warning string `json:"warning,omitempty"`
}

// Sandbox is the persistent record of a sandbox as the API shows it (the index keeps its
// own, store.Sandbox; state/sandboxes.go: apiSandbox converts); SandboxInfo embeds it.
type Sandbox struct {
	ID       string `json:"id"`
	Image    string `json:"image"`
	Head     string `json:"head,omitempty"` // node the current state descends from
	Upper    uint64 `json:"upper"`          // layer id of the writable upper
	Workdir  string `json:"workdir"`
	Hostname string `json:"hostname"`
	// User is CreateOptions.User as given ("": root).
	User    string    `json:"user,omitempty"`
	Created time.Time `json:"created"`
	// Limits are resolved at create time (no zero field) and applied again whenever the
	// sandbox starts; zero fields in records older than limits mean the defaults.
	Limits Limits `json:"limits"`
	// WarmProcesses turns on the async warm-up of processes after a restore
	// (state/procwarm.go) for this sandbox.
	WarmProcesses bool `json:"warm_processes,omitempty"`
	// UIDBase is the host uid and gid that root of the sandbox's user namespace maps
	// to, and the owner of that namespace; its 65536 ids follow. Each sandbox has a
	// range of its own on the host (package hostids), allocated at create and kept in
	// its record. 0: no user namespace (the daemon runs with isolation off).
	UIDBase uint32 `json:"uid_base,omitempty"`
	// DiskMB is the quota on its upper layer, resolved at create (0 in records older than
	// quotas: the default).
	DiskMB int64 `json:"disk_mb,omitempty"`
	// TemplateBudgetMB is CreateOptions.TemplateBudgetMB resolved at create (-1: none; 0
	// in records older than budgets: the daemon's default). The sandbox's kernel memory
	// limit is Limits.MemoryBytes plus this.
	TemplateBudgetMB int64 `json:"template_budget_mb,omitempty"`
	// Init names the running init for the next daemon, which adopts the sandbox, its
	// processes and sessions instead of starting it afresh; nil: none recorded.
	Init *InitRef `json:"init,omitempty"`
	// Network is CreateOptions.Network as given (nil: no network).
	Network *Network `json:"network,omitempty"`
	// ForkOf: the node this sandbox was forked from, when a fork made it (its
	// stats.fork says how); its restores of that node and the nodes before it may bring
	// their processes back from their images.
	ForkOf string `json:"fork_of,omitempty"`
	// Family: for a member of a fast fork's family (a branch, or the sandbox it was
	// forked from), the family's holder, which lives while any member does; nil: none.
	Family *FamilyRef `json:"family,omitempty"`
	// Cgroup: the name of its runtime's cgroups when not its id (a runtime that was a
	// spare: docs/design/spares.md).
	Cgroup string `json:"cgroup,omitempty"`
}

// FamilyRef names a fast fork's family: its id, the sandbox it was forked from, its
// holder's init, and whether the fork that made it finished (made).
type FamilyRef struct {
	ID     string  `json:"id"`
	Source string  `json:"source"`
	Holder InitRef `json:"holder"`
	Made   bool    `json:"made,omitempty"`
}

// InitRef names one process for good: its host PID and its /proc/PID/stat starttime
// (clock ticks after boot), which a reused PID does not have.
type InitRef struct {
	Pid   int    `json:"pid"`
	Start uint64 `json:"start"`
	// Level is the feature level of the daemon that started it: a daemon adopts no init
	// below its own (the sandbox restarts afresh). 0: older than levels.
	Level int `json:"level,omitempty"`
}

// Limits are one sandbox's resource limits (SandboxInfo's "limits"; cgroup.Limits in the
// daemon, which applies them). Zero fields mean "the default" (cgroup.WithDefaults); the
// daemon stores the resolved values with the sandbox.
type Limits struct {
	// MemoryBytes caps the sandbox's memory (anonymous memory, page cache, kernel
	// memory; swap too). Over it, the kernel reclaims page cache, then OOM-kills the
	// largest process of the sandbox.
	MemoryBytes int64 `json:"memory_bytes"`
	// Pids caps the number of processes and threads the sandbox runs at once (its init
	// excluded): fork and clone fail with EAGAIN beyond it.
	Pids int64 `json:"pids"`
	// CPUs is CPU time per wall-clock time (1.5: one and a half CPUs); the sandbox is
	// throttled beyond it. At or above the host's CPU count nothing is throttled.
	CPUs float64 `json:"cpus"`
}

// Usage is what a sandbox's processes use, read from its v1 cgroups (SandboxInfo's
// "usage"). Zero when a controller is missing. (memory.failcnt is not reported: this
// kernel does not count it for v1; the peak reaching the limit and oom_kills say the
// limit was hit.)
type Usage struct {
	MemoryBytes     int64 `json:"memory_bytes"`      // now (memory.usage_in_bytes)
	MemoryPeakBytes int64 `json:"memory_peak_bytes"` // since the sandbox started
	OOMKills        int64 `json:"oom_kills"`         // processes the limit OOM-killed
	Pids            int64 `json:"pids"`              // processes and threads now (init excluded)
	PidsPeak        int64 `json:"pids_peak"`
	PidsLimitHits   int64 `json:"pids_limit_hits"` // forks refused by the limit (pids.events max)
	CPUNanos        int64 `json:"cpu_ns"`          // CPU time used (cpuacct.usage)
	CPUThrottled    int64 `json:"cpu_throttled_periods"`
	CPUThrottledNS  int64 `json:"cpu_throttled_ns"`
	// Network: the sandbox's traffic through the proxy (nil: no network).
	Network *NetUsage `json:"network,omitempty"`
}

// Stats counts what happened to a sandbox (SandboxInfo's "stats").
type Stats struct {
	Checkpoints int `json:"checkpoints"`
	Restores    int `json:"restores"`
	Execs       int `json:"execs"`
	// Checkpoints that forked process templates and restores that forked them back (the
	// same as checkpoint_paths.process and restore_paths.process).
	ProcessCheckpoints int `json:"process_checkpoints"`
	ProcessRestores    int `json:"process_restores"`
	// Per path, with the reasons for the files-only one.
	CheckpointPaths PathCounts `json:"checkpoint_paths"`
	RestorePaths    PathCounts `json:"restore_paths"`
	// WarmedBytes is how much restored processes' memory was pre-faulted
	// (state/procwarm.go).
	WarmedBytes int64 `json:"warmed_bytes,omitempty"`
	// EvictedNodes counts the nodes whose templates were evicted over the template
	// budget (state/budget.go); a later restore of one brings them back from its
	// durable image (restore_paths.image).
	EvictedNodes int `json:"evicted_nodes,omitempty"`
	// SparesMade and SparesDropped count the spares made for this sandbox and those
	// dropped unused (docs/design/spares.md); restore_paths.spare the restores served
	// by one.
	SparesMade    int `json:"spares_made,omitempty"`
	SparesDropped int `json:"spares_dropped,omitempty"`
	// SpareBytes is what its spares hold, measured when made: their copies'
	// pss_anon_bytes, which its template budget counts as it counts templates';
	// SparePrivateBytes, what they hold alone: their private dirty pages and page tables
	// (the rest they share with the node's templates).
	SpareBytes        int64 `json:"spare_bytes,omitempty"`
	SparePrivateBytes int64 `json:"spare_private_bytes,omitempty"`
	// ForkPaths counts the branches forked from this sandbox's nodes, per path
	// ("durable", "files"; ForkBranch.Path).
	ForkPaths map[string]int `json:"fork_paths,omitempty"`
	// Fork says how a fork made this sandbox; absent for one made otherwise.
	Fork *ForkOrigin `json:"fork,omitempty"`
}

// ForkOrigin is how a fork made a sandbox (Stats's "fork"): its branch of a fork of
// Node, and the path that put the node's state in it, with why.
type ForkOrigin struct {
	Node   string `json:"node"`
	Branch int    `json:"branch"`
	Count  int    `json:"count"`
	Path   string `json:"path"`
	Reason string `json:"reason"`
}

// PathCounts counts a sandbox's checkpoints or restores per path (Stats's
// "checkpoint_paths" and "restore_paths"): files and processes (the fast path:
// templates forked at a checkpoint, forked back at a restore) or files only, with the
// reason, and the operations that failed or were refused.
type PathCounts struct {
	Process int `json:"process"`
	// Restore: of Process, those whose templates came back from the node's durable
	// image first (evicted or lost).
	Image int `json:"image,omitempty"`
	// Restore: of Process, those that swapped in a spare of the node instead of forking.
	Spare int `json:"spare,omitempty"`
	// Of Process, those that took processes through CRIU (OpResult.CRIUProcesses).
	CRIU      int `json:"criu,omitempty"`
	FilesOnly int `json:"files_only"` // the sum of the reasons below
	// The daemon runs without the fast path (DELTABOX_FASTPATH=0).
	FastPathOff int `json:"fastpath_off"`
	// Checkpoint: no session was running. Restore: the node has no process state in this
	// sandbox (made while no session ran, or its templates cut by a daemon crash before
	// they were recorded).
	NoSessions int `json:"no_sessions"`
	// Restore: the node's templates are in the sandbox that made it (a fork cannot
	// leave its PID namespace).
	OtherSandbox int `json:"other_sandbox"`
	// The sandbox runs as a user (CreateOptions.User): the fast path needs root to move
	// a process onto a state (docs/API.md), so sessions end at each operation.
	RunAs int `json:"run_as,omitempty"`
	// Failed or refused (nothing changed; see the error), and among them: a session that
	// cannot be checkpointed with its state (checkpoint), a template of the node that is
	// gone (restore).
	Failed       int `json:"failed"`
	Ineligible   int `json:"ineligible,omitempty"`
	TemplateGone int `json:"template_gone,omitempty"`
	// OverBudget: checkpoints refused with 507 after waiting for room under a template
	// budget (docs/API.md, Template memory).
	OverBudget int `json:"over_budget,omitempty"`
}

// TemplateInfo is what a node's process templates cost (Memory explains the figures):
// NodeInfo's "templates" in GET /v1/tree and GET /v1/nodes/{id}; a sandbox's
// (SandboxInfo) and the tree's totals (Tree) have the same shape.
type TemplateInfo struct {
	Processes int `json:"processes"`
	Memory
	Sessions []string `json:"sessions,omitempty"` // a node's: the sessions they belong to
}

// Memory is what a process costs, from /proc/PID/smaps_rollup (bytes); TemplateInfo
// embeds it.
//
// After a fork a private page is mapped by both processes: each counts it in Rss and
// Shared_*, and half of it in Pss. When the live process writes such a page it gets a
// copy of its own, and the original is then mapped by the template alone: it moves to
// the template's Private_Dirty. So a template's Private_Dirty is the memory its node
// keeps that no live process shares (what removing the node frees), and it grows as the
// live process dirties memory; Pss splits shared pages between their sharers, so the
// sum of Pss over every process is the memory they use together.
//
// PssAnon is the anonymous part of Pss: what the template budgets count (file pages are
// page cache, charged to whoever read them first and reclaimable).
type Memory struct {
	Rss          int64 `json:"rss_bytes"`
	Pss          int64 `json:"pss_bytes"`
	PssAnon      int64 `json:"pss_anon_bytes"`
	PrivateDirty int64 `json:"private_dirty_bytes"`
}
