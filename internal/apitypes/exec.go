package apitypes

import "time"

// ExecRequest is the body of POST /v1/sandboxes/{id}/exec. (The daemon turns it into
// a sandbox.ExecRequest, which is not a wire type.)
type ExecRequest struct {
	Argv []string `json:"argv"`
	Env  []string `json:"env,omitempty"`
	Dir  string   `json:"dir,omitempty"`
	// User runs this command as another user than the sandbox's (CreateOptions.User;
	// "root" or "0" for root). Not with Session: a session runs as the sandbox's user.
	User string `json:"user,omitempty"`
	// Stdin is in Encoding: text, or base64 of any bytes.
	Stdin string `json:"stdin,omitempty"`
	// TimeoutMS bounds the call: 0 (or absent) is DefaultExecTimeoutMS, -1 is none.
	TimeoutMS   int64 `json:"timeout_ms,omitempty"`
	OutputLimit int   `json:"output_limit,omitempty"`
	// Session runs the command as code in a persistent session ("main": the default
	// bash session, started on first use). argv is then one string of code (or words,
	// joined with shell quoting).
	Session string `json:"session,omitempty"`
	// Stream answers with NDJSON events (StreamEvent) as output is produced (see
	// docs/API.md).
	Stream bool `json:"stream,omitempty"`
	// Encoding of stdin, of the answer's stdout and stderr and of streamed data:
	// EncodingText (the default; output that is not UTF-8 has its invalid bytes
	// replaced by U+FFFD, stdin is sent as its UTF-8 bytes) or EncodingBase64 (exact
	// bytes both ways).
	Encoding string `json:"encoding,omitempty"`
}

// Encodings of ExecRequest.Encoding.
const (
	EncodingText   = "utf-8"
	EncodingBase64 = "base64"
)

// DefaultExecTimeoutMS is the timeout of a call whose timeout_ms is 0 or absent: 10
// minutes, long enough for a package install or a test suite, short enough that a
// hung command does not hold an agent for ever.
const DefaultExecTimeoutMS = 10 * 60 * 1000

// ExecResult is what a command did: the answer of POST /v1/sandboxes/{id}/exec, and
// a streamed exec's "result" event (whose stdout and stderr are empty: the events
// carried them).
type ExecResult struct {
	ExitCode int `json:"exit_code"` // -1 when killed by a signal
	Signal   int `json:"signal,omitempty"`
	// Stdout and Stderr are the kept output (the first quarter and the last three
	// quarters of output_limit, a marker between them when bytes were dropped), in
	// Encoding.
	Stdout          string `json:"stdout"`
	Stderr          string `json:"stderr"`
	StdoutTruncated bool   `json:"stdout_truncated,omitempty"`
	StderrTruncated bool   `json:"stderr_truncated,omitempty"`
	// StdoutDropped and StderrDropped count the bytes dropped between head and tail.
	StdoutDropped int64 `json:"stdout_dropped,omitempty"`
	StderrDropped int64 `json:"stderr_dropped,omitempty"`
	TimedOut      bool  `json:"timed_out,omitempty"`
	// TimeoutMS is the timeout that applied (absent: none).
	TimeoutMS int64 `json:"timeout_ms,omitempty"`
	// Encoding is EncodingBase64 when stdout and stderr are base64 (absent: text).
	Encoding string `json:"encoding,omitempty"`
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
	Type string `json:"type"` // stdout | stderr | result | error
	// Data (stdout, stderr) is output, in the request's Encoding.
	Data string `json:"data,omitempty"`
	// Marker is set when Data is not the command's output but DeltaBox's marker in
	// it, where it stands in a whole answer: MarkerDropped (Dropped bytes of this
	// stream were dropped here) or MarkerTimeout.
	Marker  string      `json:"marker,omitempty"`
	Dropped int64       `json:"dropped,omitempty"`
	Result  *ExecResult `json:"result,omitempty"` // result
	// Error (error) is a whole ErrorBody: the line reads
	// {"type":"error","error":{"error":{"code":...,"message":...}}}.
	Error *ErrorBody `json:"error,omitempty"`
}

// Kinds of StreamEvent.Marker.
const (
	MarkerDropped = "dropped"
	MarkerTimeout = "timeout"
)
