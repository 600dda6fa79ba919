package apitypes

import "time"

// ExecRequest is the body of POST /v1/sandboxes/{id}/exec. (The daemon turns it into
// a sandbox.ExecRequest, which is not a wire type.)
type ExecRequest struct {
	Argv        []string `json:"argv"`
	Env         []string `json:"env,omitempty"`
	Dir         string   `json:"dir,omitempty"`
	Stdin       string   `json:"stdin,omitempty"`
	TimeoutMS   int64    `json:"timeout_ms,omitempty"`
	OutputLimit int      `json:"output_limit,omitempty"`
	// Session runs the command as code in a persistent session ("main": the default
	// bash session, started on first use). argv is then one string of code (or words,
	// joined with shell quoting).
	Session string `json:"session,omitempty"`
	// Stream answers with NDJSON events (StreamEvent) as output is produced (see
	// docs/API.md).
	Stream bool `json:"stream,omitempty"`
}

// ExecResult is what a command did: the answer of POST /v1/sandboxes/{id}/exec, and
// a streamed exec's "result" event.
type ExecResult struct {
	ExitCode        int    `json:"exit_code"` // -1 when killed by a signal
	Signal          int    `json:"signal,omitempty"`
	Stdout          string `json:"stdout"`
	Stderr          string `json:"stderr"`
	StdoutTruncated bool   `json:"stdout_truncated,omitempty"`
	StderrTruncated bool   `json:"stderr_truncated,omitempty"`
	TimedOut        bool   `json:"timed_out,omitempty"`
	// Session calls: stdout holds the terminal's merged output.
	Session          string `json:"session,omitempty"`
	SessionRestarted bool   `json:"session_restarted,omitempty"` // a checkpoint/restore had ended it
	// OOM is set when the sandbox's memory limit made the kernel kill a process while the
	// command ran (this command's, or another's of the sandbox): it names the limit and
	// what holds the memory, the templates of the sandbox's checkpoints included.
	OOM string `json:"oom,omitempty"`
	// Duration is not sent: DurationMS is. The daemon sets both; the Go client sets
	// Duration from DurationMS.
	Duration   time.Duration `json:"-"`
	DurationMS float64       `json:"duration_ms"`
}

// StreamEvent is one line of a streamed exec answer (ExecRequest.Stream; NDJSON):
// "stdout" and "stderr" events as output is produced, then one "result" or "error".
type StreamEvent struct {
	Type   string      `json:"type"`             // stdout | stderr | result | error
	Data   string      `json:"data,omitempty"`   // stdout, stderr
	Result *ExecResult `json:"result,omitempty"` // result
	// Error (error) is a whole ErrorBody: the line reads
	// {"type":"error","error":{"error":{"code":...,"message":...}}}.
	Error *ErrorBody `json:"error,omitempty"`
}
