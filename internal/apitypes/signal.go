package apitypes

// SignalRequest is the body of POST /v1/sandboxes/{id}/signal: a signal sent by the
// sandbox's init, from outside every command's Landlock domain. Inside the sandbox a
// command cannot signal what another command started (docs/SECURITY.md); this is how
// a server one command left running is stopped from outside.
type SignalRequest struct {
	Pid    int `json:"pid"`              // in the sandbox (ps there); > 1
	Signal int `json:"signal,omitempty"` // 0 means SIGTERM (15)
}

// SignalResult answers a SignalRequest.
type SignalResult struct {
	Pid    int `json:"pid"`
	Signal int `json:"signal"`
}
