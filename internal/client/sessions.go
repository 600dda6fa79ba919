package client

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"time"

	"deltabox/internal/apitypes"
)

// ExecStream runs a command and calls onOutput with its output as it is produced.
func (c *Client) ExecStream(ctx context.Context, id string, r apitypes.ExecRequest, onOutput func(stream, data string)) (*apitypes.ExecResult, error) {
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
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 64<<20)
	for sc.Scan() {
		var ev apitypes.StreamEvent
		if err := json.Unmarshal(sc.Bytes(), &ev); err != nil {
			return nil, fmt.Errorf("bad stream event: %w", err)
		}
		switch ev.Type {
		case "stdout", "stderr":
			if onOutput != nil {
				onOutput(ev.Type, ev.Data)
			}
		case "result":
			ev.Result.Duration = time.Duration(ev.Result.DurationMS * float64(time.Millisecond))
			return ev.Result, nil
		case "error":
			return nil, &Error{Status: statusOf(ev.Error.Error.Code), Code: ev.Error.Error.Code, Message: ev.Error.Error.Message}
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	return nil, fmt.Errorf("the daemon ended the stream without a result")
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
