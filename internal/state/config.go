package state

import (
	"time"

	"deltabox/internal/cgroup"
)

// Config is the manager's configuration, fixed for its life. The daemon fills it once at
// start (from its flags and environment: cmd/deltabox/daemon.go); nothing in this
// package reads the environment.
type Config struct {
	// FastPath keeps processes across checkpoints and restores (template forks). Off,
	// a checkpoint carries files only and ends the sessions (DELTABOX_FASTPATH=0).
	FastPath bool
	// ForkFast lets a fork of a live sandbox's node take the fast path (family.go):
	// branches in sibling namespaces of the sandbox's, its templates forked into them at
	// their PIDs, the sandbox moved into one of its own. On by default; the family
	// outlives a daemon restart (famrestart.go). DELTABOX_FORK_FAST=0 turns it off.
	ForkFast bool
	// NoSpares turns off spares (spares.go: restores of a family member from copies
	// placed ahead; DELTABOX_SPARES=0), to measure the fork path beside them.
	NoSpares bool
	// WarmProcesses pre-faults restored processes' memory after every restore, in every
	// sandbox (procwarm.go; DELTABOX_WARM_PROC=1). A sandbox can ask for it alone
	// (CreateOptions.WarmProcesses).
	WarmProcesses bool
	// Prepare mounts each sandbox's next checkpoint state ahead of time (prepare.go).
	// Off (DELTABOX_NO_PREPARE=1) only to measure or debug the plain path.
	Prepare bool
	// WarmMax bounds the warm restore states kept mounted per sandbox (warm.go;
	// DELTABOX_WARM_MAX); 0 turns them off.
	WarmMax int
	// EarlyAnswer: a checkpoint answers once the sandbox's processes are seized, and
	// makes its templates after the answer (checkpoint.go: "The early answer";
	// DELTABOX_EARLY_ANSWER=0 turns it off). A request can choose (CheckpointOptions.Answer).
	EarlyAnswer bool
	// AnswerDelay is how long background work waits after the answer it follows
	// (background.go; DELTABOX_ANSWER_DELAY).
	AnswerDelay time.Duration
	// NoIsolation starts sandboxes without a user namespace of their own, their root
	// the host's root (DELTABOX_ISOLATION=off). It exists to measure what isolation
	// costs (bench latency and fs, side by side); never run untrusted code so.
	NoIsolation bool
	// IDsDir is the host's record of sandboxes' id ranges, shared by every daemon of
	// the host (package hostids); "": hostids.DefaultDir.
	IDsDir string
	// MaxSessionsPerSandbox and MaxSessions cap the sessions a sandbox, and all of them,
	// hold at once (DELTABOX_MAX_SESSIONS_PER_SANDBOX, DELTABOX_MAX_SESSIONS): each holds
	// a terminal, a reader goroutine and up to 1 MiB of output in the daemon. Past a cap
	// a start is refused (409); a restore brings back the sessions its node holds even
	// past the total cap (they were within the caps when it was taken).
	MaxSessionsPerSandbox int
	MaxSessions           int
	// StopSandboxes ends every sandbox's processes when the daemon stops
	// (DELTABOX_STOP_SANDBOXES=1). By default they keep running, and the next daemon
	// adopts them (restart.go).
	StopSandboxes bool
	// Durable writes every node's templates to durable CRIU images in the background
	// (durable.go; DELTABOX_DURABLE=0 turns it off), where CRIU works here.
	Durable bool
	// TemplateBudgetBytes is a sandbox's template budget when its create names none
	// (template_budget_mb 0; DELTABOX_TEMPLATE_BUDGET), and TemplateBudgetTotalBytes
	// the budget of every sandbox's templates together (DELTABOX_TEMPLATE_BUDGET_TOTAL);
	// budget.go. 0 in either: the default, a fraction of the host's RAM
	// (DefaultTemplateBudgets).
	TemplateBudgetBytes      int64
	TemplateBudgetTotalBytes int64
	// LazyRestoreMinBytes: a restore from a durable image whose pages hold at least
	// this many bytes is lazy (lazy.go); -1 never (DELTABOX_LAZY_RESTORE=0), 0 always
	// (DELTABOX_LAZY_RESTORE=1). Default DefaultLazyRestoreMinBytes.
	LazyRestoreMinBytes int64
	// NetDNS is the resolver ("ip:port") the network proxy asks for the names sandboxes
	// resolve (DELTABOX_NET_DNS); "": the host's (/etc/resolv.conf).
	NetDNS string
	// SquashDepth is the stack length (layers above the image) at which a node's stack
	// is squashed into one layer in the background (squash.go;
	// DELTABOX_SQUASH_DEPTH); 0: never.
	SquashDepth int
}

// DefaultLazyRestoreMinBytes is where a lazy restore from an image starts to pay.
const DefaultLazyRestoreMinBytes = 64 << 20

// The session caps' defaults: an agent uses a handful of sessions; 1024 sessions at
// their 1 MiB log cap each are 1 GiB of the daemon's memory at worst.
const (
	DefaultMaxSessionsPerSandbox = 64
	DefaultMaxSessions           = 1024
)

// DefaultTemplateBudgets are the template budgets' defaults: an eighth of the host's RAM
// per sandbox and a quarter in total (3 and 6 GiB on a 24 GiB host), so that a few
// sandboxes' templates cannot push the host into its global OOM killer, while a search
// over a python of a few hundred MB keeps tens of nodes' processes.
func DefaultTemplateBudgets() (perSandbox, total int64) {
	ram := cgroup.HostMemoryBytes()
	if ram <= 0 {
		ram = 8 << 30
	}
	return ram / 8, ram / 4
}

// DefaultConfig is the configuration the daemon runs with unless told otherwise.
func DefaultConfig() Config {
	per, total := DefaultTemplateBudgets()
	return Config{LazyRestoreMinBytes: DefaultLazyRestoreMinBytes, FastPath: true, EarlyAnswer: true, ForkFast: true, Durable: true, Prepare: true, WarmMax: 256, SquashDepth: DefaultSquashDepth, AnswerDelay: defaultAnswerDelay,
		MaxSessionsPerSandbox: DefaultMaxSessionsPerSandbox, MaxSessions: DefaultMaxSessions,
		TemplateBudgetBytes: per, TemplateBudgetTotalBytes: total}
}
