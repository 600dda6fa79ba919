package client

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"

	"deltabox/internal/apitypes"
)

// ExportNode streams node id's archive (GET /v1/nodes/{id}/export) into w and returns
// the daemon's warnings (what the archive does not carry). An archive cut short is an
// error: the caller must not keep what it wrote.
func (c *Client) ExportNode(ctx context.Context, id string, w io.Writer) (warnings []string, err error) {
	req, err := http.NewRequestWithContext(ctx, "GET", "http://deltabox/"+apitypes.Version+"/nodes/"+url.PathEscape(id)+"/export", nil)
	if err != nil {
		return nil, err
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return nil, transportError(ctx, c.Socket, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 300 {
		b, _ := io.ReadAll(resp.Body)
		return nil, errorFrom(resp, b)
	}
	if _, err := io.Copy(w, resp.Body); err != nil {
		return nil, fmt.Errorf("the export of %s was cut short: %w", id, err)
	}
	return resp.Header.Values("Deltabox-Warning"), nil
}

// ImportNode sends a node archive (POST /v1/nodes/import). maxBytes and maxEntries
// of 0 are the daemon's defaults.
func (c *Client) ImportNode(ctx context.Context, r io.Reader, maxBytes, maxEntries int64) (*apitypes.NodeImport, error) {
	q := url.Values{}
	if maxBytes > 0 {
		q.Set("max_bytes", strconv.FormatInt(maxBytes, 10))
	}
	if maxEntries > 0 {
		q.Set("max_entries", strconv.FormatInt(maxEntries, 10))
	}
	u := "http://deltabox/" + apitypes.Version + "/nodes/import"
	if len(q) > 0 {
		u += "?" + q.Encode()
	}
	req, err := http.NewRequestWithContext(ctx, "POST", u, r)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/x-tar")
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
	var out apitypes.NodeImport
	return &out, json.Unmarshal(b, &out)
}
