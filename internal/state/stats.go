package state

// PathCounts counts a sandbox's checkpoints or restores per path: files and processes
// (the fast path: templates forked at a checkpoint, forked back at a restore) or files
// only, with the reason, and the operations that failed or were refused.
type PathCounts struct {
	Process   int `json:"process"`
	FilesOnly int `json:"files_only"` // the sum of the reasons below
	// DELTABOX_FASTPATH=0.
	FastPathOff int `json:"fastpath_off"`
	// Checkpoint: no session was running. Restore: the node has no process state in this
	// sandbox (made while no session ran, or before a daemon restart, which ends every
	// process).
	NoSessions int `json:"no_sessions"`
	// Restore: the node's templates are in the sandbox that made it (a fork cannot
	// leave its PID namespace).
	OtherSandbox int `json:"other_sandbox"`
	// Failed or refused (nothing changed; see the error), and among them: a session that
	// cannot be checkpointed with its state (checkpoint), a template of the node that is
	// gone (restore).
	Failed       int `json:"failed"`
	Ineligible   int `json:"ineligible,omitempty"`
	TemplateGone int `json:"template_gone,omitempty"`
}

type opPath int

const (
	pathProcess opPath = iota
	pathFastPathOff
	pathNoSessions
	pathOtherSandbox

	pathNoTemplates = pathNoSessions // a restore's name for it
)

// countPath counts a completed checkpoint or restore.
func (m *Manager) countPath(s *sb, op string, p opPath) {
	s.mu.Lock()
	defer s.mu.Unlock()
	c := &s.stats.CheckpointPaths
	if op == "restore" {
		c = &s.stats.RestorePaths
		s.stats.Restores++
		if p == pathProcess {
			s.stats.ProcessRestores++
		}
	} else {
		s.stats.Checkpoints++
		if p == pathProcess {
			s.stats.ProcessCheckpoints++
		}
	}
	switch p {
	case pathProcess:
		c.Process++
		return
	case pathFastPathOff:
		c.FastPathOff++
	case pathNoSessions:
		c.NoSessions++
	case pathOtherSandbox:
		c.OtherSandbox++
	}
	c.FilesOnly++
}

// countFailed counts a failed or refused checkpoint or restore; why is "ineligible",
// "template_gone" or "".
func (m *Manager) countFailed(s *sb, op, why string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	c := &s.stats.CheckpointPaths
	if op == "restore" {
		c = &s.stats.RestorePaths
	}
	c.Failed++
	switch why {
	case "ineligible":
		c.Ineligible++
	case "template_gone":
		c.TemplateGone++
	}
}
