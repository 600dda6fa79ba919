// Package client is the Go client of the daemon's API, used by the CLI, the
// benchmarks and the tests. It speaks the wire types of package apitypes and imports
// nothing else of DeltaBox but errdefs (imports_test.go).
package client

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"

	"deltabox/internal/apitypes"
	"deltabox/internal/errdefs"
)

// DefaultSocket is where the daemon listens unless told otherwise.
const DefaultSocket = "/run/deltabox/deltabox.sock"

// Client talks to one daemon.
type Client struct {
	Socket string
	hc     *http.Client
}

// New returns a client for the daemon on socket.
func New(socket string) *Client {
	return &Client{Socket: socket, hc: &http.Client{Transport: &unixTransport{socket: socket}}}
}

// Error is an error answered by the daemon. errors.Is(err, errdefs.ErrNotFound) etc. work.
type Error struct {
	Status  int
	Code    string
	Message string
}

func (e *Error) Error() string { return e.Message }
func (e *Error) Unwrap() error { return errdefs.FromStatus(e.Status) }

func (c *Client) do(ctx context.Context, method, path string, in, out any) error {
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return err
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://deltabox/"+apitypes.Version+path, body)
	if err != nil {
		return err
	}
	if in != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return transportError(ctx, c.Socket, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode >= 300 {
		return errorFrom(resp, b)
	}
	if out != nil {
		return json.Unmarshal(b, out)
	}
	return nil
}

func (c *Client) Health(ctx context.Context) error { return c.do(ctx, "GET", "/health", nil, nil) }

func (c *Client) Create(ctx context.Context, o apitypes.CreateOptions) (*apitypes.SandboxInfo, error) {
	var out apitypes.SandboxInfo
	return &out, c.do(ctx, "POST", "/sandboxes", o, &out)
}

func (c *Client) Get(ctx context.Context, id string) (*apitypes.SandboxInfo, error) {
	var out apitypes.SandboxInfo
	return &out, c.do(ctx, "GET", "/sandboxes/"+id, nil, &out)
}

func (c *Client) List(ctx context.Context) ([]*apitypes.SandboxInfo, error) {
	var out apitypes.SandboxList
	return out.Sandboxes, c.do(ctx, "GET", "/sandboxes", nil, &out)
}

func (c *Client) Remove(ctx context.Context, id string) error {
	return c.do(ctx, "DELETE", "/sandboxes/"+id, nil, nil)
}

// Exec runs a command and returns what it did. Output and stdin are bytes: the client
// asks for base64 on the wire (whatever r.Encoding says) and gives back Stdout and
// Stderr as the exact bytes in Go strings.
func (c *Client) Exec(ctx context.Context, id string, r apitypes.ExecRequest) (*apitypes.ExecResult, error) {
	var out apitypes.ExecResult
	if err := c.do(ctx, "POST", "/sandboxes/"+id+"/exec", base64Request(r), &out); err != nil {
		return nil, err
	}
	if err := decodeResult(&out); err != nil {
		return nil, err
	}
	return &out, nil
}

// base64Request is r asking for base64, with its stdin encoded.
func base64Request(r apitypes.ExecRequest) apitypes.ExecRequest {
	r.Encoding = apitypes.EncodingBase64
	r.Stdin = base64.StdEncoding.EncodeToString([]byte(r.Stdin))
	return r
}

// decodeResult turns an answer's base64 output into its bytes and sets Duration.
func decodeResult(r *apitypes.ExecResult) error {
	if r.Encoding == apitypes.EncodingBase64 {
		o, err1 := base64.StdEncoding.DecodeString(r.Stdout)
		e, err2 := base64.StdEncoding.DecodeString(r.Stderr)
		if err := errors.Join(err1, err2); err != nil {
			return fmt.Errorf("the daemon's exec answer has bad base64: %w", err)
		}
		r.Stdout, r.Stderr, r.Encoding = string(o), string(e), ""
	}
	r.Duration = time.Duration(r.DurationMS * float64(time.Millisecond))
	return nil
}

// Sh runs a shell command line (bash -c) with a timeout.
func (c *Client) Sh(ctx context.Context, id, script string, timeout time.Duration) (*apitypes.ExecResult, error) {
	return c.Exec(ctx, id, apitypes.ExecRequest{Argv: []string{"bash", "-c", script}, TimeoutMS: timeout.Milliseconds()})
}

func (c *Client) Checkpoint(ctx context.Context, id, label string) (*apitypes.OpResult, error) {
	return c.CheckpointWith(ctx, id, apitypes.CheckpointRequest{Label: label})
}

// CheckpointWith checkpoints with every option of the request.
func (c *Client) CheckpointWith(ctx context.Context, id string, q apitypes.CheckpointRequest) (*apitypes.OpResult, error) {
	var out apitypes.OpResult
	return &out, c.do(ctx, "POST", "/sandboxes/"+id+"/checkpoint", q, &out)
}

func (c *Client) Restore(ctx context.Context, id, node string) (*apitypes.OpResult, error) {
	return c.RestoreWith(ctx, id, apitypes.RestoreRequest{Node: node})
}

// RestoreWith restores with every option of the request (WaitMS).
func (c *Client) RestoreWith(ctx context.Context, id string, q apitypes.RestoreRequest) (*apitypes.OpResult, error) {
	var out apitypes.OpResult
	return &out, c.do(ctx, "POST", "/sandboxes/"+id+"/restore", q, &out)
}

func (c *Client) Tree(ctx context.Context) (*apitypes.Tree, error) {
	var out apitypes.Tree
	return &out, c.do(ctx, "GET", "/tree", nil, &out)
}

// TreePage returns the tree as an HTML page (GET /v1/tree/page): root's subtree ("":
// all of it), the path to sandbox's node drawn thick ("": none).
func (c *Client) TreePage(ctx context.Context, root, sandbox string) ([]byte, error) {
	q := url.Values{}
	if root != "" {
		q.Set("root", root)
	}
	if sandbox != "" {
		q.Set("sandbox", sandbox)
	}
	req, err := http.NewRequestWithContext(ctx, "GET", "http://deltabox/"+apitypes.Version+"/tree/page?"+q.Encode(), nil)
	if err != nil {
		return nil, err
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return nil, transportError(ctx, c.Socket, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode >= 300 {
		return nil, errorFrom(resp, b)
	}
	return b, nil
}

func (c *Client) Node(ctx context.Context, id string) (*apitypes.NodeInfo, error) {
	var out apitypes.NodeInfo
	return &out, c.do(ctx, "GET", "/nodes/"+id, nil, &out)
}

// PinNode pins (pinned true) or unpins a node: its templates are never evicted over a
// template budget (docs/API.md, Template memory).
func (c *Client) PinNode(ctx context.Context, id string, pinned bool) (*apitypes.NodeInfo, error) {
	var out apitypes.NodeInfo
	return &out, c.do(ctx, "POST", "/nodes/"+id+"/pin", apitypes.PinRequest{Pinned: pinned}, &out)
}

// PrepareNode makes sure sandbox (""): the node's own) holds a spare of node id (POST
// /v1/nodes/ID/prepare: docs/design/spares.md); it answers once it does.
func (c *Client) PrepareNode(ctx context.Context, id, sandbox string) (*apitypes.NodeInfo, error) {
	var out apitypes.NodeInfo
	return &out, c.do(ctx, "POST", "/nodes/"+id+"/prepare", apitypes.PrepareRequest{Sandbox: sandbox}, &out)
}

// EvictNode drops a node's templates, which its durable image brings back at its next
// restore (POST /v1/nodes/ID/evict).
func (c *Client) EvictNode(ctx context.Context, id string) (*apitypes.NodeInfo, error) {
	var out apitypes.NodeInfo
	return &out, c.do(ctx, "POST", "/nodes/"+id+"/evict", nil, &out)
}

// Fork makes q.Count sandboxes on node (POST /v1/nodes/{id}/fork).
func (c *Client) Fork(ctx context.Context, node string, q apitypes.ForkRequest) (*apitypes.ForkResult, error) {
	var out apitypes.ForkResult
	return &out, c.do(ctx, "POST", "/nodes/"+node+"/fork", q, &out)
}

// ForkSandbox checkpoints sandbox id and forks the node it made, in one request.
func (c *Client) ForkSandbox(ctx context.Context, id string, q apitypes.SandboxForkRequest) (*apitypes.ForkResult, error) {
	var out apitypes.ForkResult
	return &out, c.do(ctx, "POST", "/sandboxes/"+id+"/fork", q, &out)
}

func (c *Client) RemoveNode(ctx context.Context, id string) ([]string, error) {
	var out apitypes.NodesRemoved
	return out.Removed, c.do(ctx, "DELETE", "/nodes/"+id, nil, &out)
}

func (c *Client) Images(ctx context.Context) ([]apitypes.Image, error) {
	var out apitypes.ImageList
	return out.Images, c.do(ctx, "GET", "/images", nil, &out)
}

func (c *Client) Sync(ctx context.Context) error { return c.do(ctx, "POST", "/sync", nil, nil) }

// transportError tells a caller's own deadline or cancellation apart from a daemon
// that cannot be reached.
func transportError(ctx context.Context, socket string, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("request to the daemon abandoned: %w", ctx.Err())
	}
	return fmt.Errorf("cannot reach the daemon on %s (is `deltabox daemon` running?): %w", socket, err)
}

// errorFrom turns a daemon's error answer (status >= 300, body read) into an *Error.
func errorFrom(resp *http.Response, body []byte) *Error {
	var eb apitypes.ErrorBody
	if json.Unmarshal(body, &eb) == nil && eb.Error.Message != "" {
		return &Error{Status: resp.StatusCode, Code: eb.Error.Code, Message: eb.Error.Message}
	}
	return &Error{Status: resp.StatusCode, Message: fmt.Sprintf("daemon answered %s: %s", resp.Status, body)}
}

// Port sends an HTTP request to a server listening on port inside sandbox id, through
// the daemon (ANY /v1/sandboxes/{id}/ports/{port}/{path}); the caller closes the
// answer's body. A daemon error (nothing listens, no such sandbox) is an answer with
// its status and an error body, as for any route.
func (c *Client) Port(ctx context.Context, id string, port int, method, path string, body io.Reader) (*http.Response, error) {
	u := fmt.Sprintf("http://deltabox/%s/sandboxes/%s/ports/%d/%s", apitypes.Version, url.PathEscape(id), port, strings.TrimPrefix(path, "/"))
	req, err := http.NewRequestWithContext(ctx, method, u, body)
	if err != nil {
		return nil, err
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return nil, transportError(ctx, c.Socket, err)
	}
	return resp, nil
}
