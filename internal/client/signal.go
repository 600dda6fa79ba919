package client

import (
	"context"

	"deltabox/internal/apitypes"
)

// Signal sends sig (0: SIGTERM) to process pid of sandbox id, from outside every
// command's domain (POST /v1/sandboxes/{id}/signal).
func (c *Client) Signal(ctx context.Context, id string, pid, sig int) (*apitypes.SignalResult, error) {
	var out apitypes.SignalResult
	return &out, c.do(ctx, "POST", "/sandboxes/"+id+"/signal", apitypes.SignalRequest{Pid: pid, Signal: sig}, &out)
}
