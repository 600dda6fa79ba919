package apitypes

import "time"

// SessionKind is what runs in a session (session.Kind in the daemon).
type SessionKind string

// The kinds of session.
const (
	SessionBash    SessionKind = "bash"
	SessionPython  SessionKind = "python"
	SessionCommand SessionKind = "command" // any long-lived command; output is kept, calls are refused
)

// SessionOptions is the body of POST /v1/sandboxes/{id}/sessions: a session to start.
type SessionOptions struct {
	Name string      `json:"name"`
	Kind SessionKind `json:"kind,omitempty"` // bash (default), python, command
	Argv []string    `json:"argv,omitempty"` // for command
	Dir  string      `json:"dir,omitempty"`
	Env  []string    `json:"env,omitempty"`
}

// SessionInfo is what the API shows of a session (session.Info in the daemon): the
// answer of POST /v1/sandboxes/{id}/sessions, and each of GET
// /v1/sandboxes/{id}/sessions's "sessions".
type SessionInfo struct {
	Name    string      `json:"name"`
	Kind    SessionKind `json:"kind"`
	Argv    []string    `json:"argv"`
	Pid     int         `json:"pid"` // in the sandbox
	Started time.Time   `json:"started"`
	Running bool        `json:"running"`
	Busy    bool        `json:"busy"`
	Exit    string      `json:"exit,omitempty"` // how it ended
}
