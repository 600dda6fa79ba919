package client

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"deltabox/internal/apitypes"
)

// ExecStream runs a command and calls onOutput with its output as it is produced
// (stream "stdout" or "stderr"; DeltaBox's markers included, where they stand). The
// result holds the whole kept output, as a whole answer would. Output is bytes, as
// for Exec.
func (c *Client) ExecStream(ctx context.Context, id string, r apitypes.ExecRequest, onOutput func(stream, data string)) (*apitypes.ExecResult, error) {
	var out, errb strings.Builder
	res, err := c.ExecEvents(ctx, id, r, func(ev apitypes.StreamEvent) {
		if ev.Type == "stderr" {
			errb.WriteString(ev.Data)
		} else {
			out.WriteString(ev.Data)
		}
		if onOutput != nil {
			onOutput(ev.Type, ev.Data)
		}
	})
	if err != nil {
		return nil, err
	}
	res.Stdout, res.Stderr = out.String(), errb.String()
	return res, nil
}

// ExecEvents runs a command with a streamed answer and calls onEvent with each
// "stdout" and "stderr" event (Data as bytes; Marker set on DeltaBox's markers). The
// result's Stdout and Stderr are empty: the events carried the output.
func (c *Client) ExecEvents(ctx context.Context, id string, r apitypes.ExecRequest, onEvent func(apitypes.StreamEvent)) (*apitypes.ExecResult, error) {
	r = base64Request(r)
	r.Stream = true
	b, err := json.Marshal(r)
	if err != nil {
		return nil, err
	}
	req, err := http.NewRequestWithContext(ctx, "POST", "http://deltabox/"+apitypes.Version+"/sandboxes/"+id+"/exec", bytes.NewReader(b))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.hc.Do(req)
	if err != nil {
		return nil, transportError(ctx, c.Socket, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 300 {
		body, _ := io.ReadAll(resp.Body)
		return nil, errorFrom(resp, body)
	}
	// A decoder, not a line scanner: an event has no size limit.
	dec := json.NewDecoder(resp.Body)
	for {
		var ev apitypes.StreamEvent
		if err := dec.Decode(&ev); err != nil {
			if ctx.Err() != nil {
				return nil, fmt.Errorf("exec abandoned: %w", ctx.Err())
			}
			if err == io.EOF {
				return nil, fmt.Errorf("the daemon ended the stream without a result")
			}
			return nil, fmt.Errorf("reading the daemon's exec stream: %w", err)
		}
		switch ev.Type {
		case "stdout", "stderr":
			d, err := base64.StdEncoding.DecodeString(ev.Data)
			if err != nil {
				return nil, fmt.Errorf("bad stream event (data not base64): %w", err)
			}
			ev.Data = string(d)
			if onEvent != nil {
				onEvent(ev)
			}
		case "result":
			if ev.Result == nil {
				return nil, fmt.Errorf("the daemon's result event has no result")
			}
			if err := decodeResult(ev.Result); err != nil {
				return nil, err
			}
			return ev.Result, nil
		case "error":
			if ev.Error == nil {
				return nil, fmt.Errorf("the daemon's error event has no error")
			}
			return nil, &Error{Status: statusOf(ev.Error.Error.Code), Code: ev.Error.Error.Code, Message: ev.Error.Error.Message}
		}
	}
}

func statusOf(code string) int {
	switch code {
	case "not_found":
		return 404
	case "conflict":
		return 409
	case "invalid":
		return 400
	case "unavailable":
		return 503
	}
	return 500
}

// Run runs code in a session (bash by default: "main").
func (c *Client) Run(ctx context.Context, id, sessionName, code string, timeout time.Duration) (*apitypes.ExecResult, error) {
	return c.Exec(ctx, id, apitypes.ExecRequest{Argv: []string{code}, Session: sessionName, TimeoutMS: timeout.Milliseconds()})
}

func (c *Client) StartSession(ctx context.Context, id string, o apitypes.SessionOptions) (*apitypes.SessionInfo, error) {
	var out apitypes.SessionInfo
	return &out, c.do(ctx, "POST", "/sandboxes/"+id+"/sessions", o, &out)
}

func (c *Client) Sessions(ctx context.Context, id string) ([]apitypes.SessionInfo, error) {
	var out apitypes.SessionList
	return out.Sessions, c.do(ctx, "GET", "/sandboxes/"+id+"/sessions", nil, &out)
}

func (c *Client) KillSession(ctx context.Context, id, name string) error {
	return c.do(ctx, "DELETE", "/sandboxes/"+id+"/sessions/"+name, nil, nil)
}

func (c *Client) SessionLogs(ctx context.Context, id, name string) (string, error) {
	req, err := http.NewRequestWithContext(ctx, "GET", "http://deltabox/"+apitypes.Version+"/sandboxes/"+id+"/sessions/"+name+"/logs", nil)
	if err != nil {
		return "", err
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if resp.StatusCode >= 300 {
		return "", errorFrom(resp, b)
	}
	return string(b), err
}
