package client

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"

	"deltabox/internal/apitypes"
)

// ImportImage imports an image (q.Source is a path on the daemon's host). With a
// progress function the daemon streams its progress (POST /v1/images?progress=1),
// which is passed on as it arrives.
func (c *Client) ImportImage(ctx context.Context, q apitypes.ImportRequest, progress func(done, total int64)) (*apitypes.Image, error) {
	if progress == nil {
		var out apitypes.Image
		if err := c.do(ctx, "POST", "/images", q, &out); err != nil {
			return nil, err
		}
		return &out, nil
	}
	b, err := json.Marshal(q)
	if err != nil {
		return nil, err
	}
	req, err := http.NewRequestWithContext(ctx, "POST", "http://deltabox/"+apitypes.Version+"/images?progress=1", bytes.NewReader(b))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.hc.Do(req)
	if err != nil {
		return nil, fmt.Errorf("cannot reach the daemon on %s (is `deltabox daemon` running?): %w", c.Socket, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 300 {
		body, _ := io.ReadAll(resp.Body)
		return nil, errorFrom(resp, body)
	}
	dec := json.NewDecoder(resp.Body)
	for {
		var ev apitypes.ImportEvent
		if err := dec.Decode(&ev); err != nil {
			if errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF
			}
			return nil, fmt.Errorf("the daemon's import stream ended before its outcome: %w", err)
		}
		switch {
		case ev.Error != nil:
			return nil, &Error{Status: statusOfCode(ev.Error.Code), Code: ev.Error.Code, Message: ev.Error.Message}
		case ev.Image != nil:
			return ev.Image, nil
		case ev.Done != nil && ev.Total != nil:
			progress(*ev.Done, *ev.Total)
		}
	}
}

// RemoveImage removes an image; the daemon refuses (409) while a sandbox or a node uses it.
func (c *Client) RemoveImage(ctx context.Context, name string) error {
	return c.do(ctx, "DELETE", "/images/"+url.PathEscape(name), nil, nil)
}

// statusOfCode is the HTTP status of an error code sent inside a stream.
func statusOfCode(code string) int {
	switch code {
	case "invalid":
		return http.StatusBadRequest
	case "not_found":
		return http.StatusNotFound
	case "conflict":
		return http.StatusConflict
	case "unavailable":
		return http.StatusServiceUnavailable
	}
	return http.StatusInternalServerError
}
