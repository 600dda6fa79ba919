package client

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strconv"

	"deltabox/internal/apitypes"
)

// fileReq sends one files API request with a raw body and returns the response when
// its status is below 300 (the caller closes its body), else the daemon's error.
func (c *Client) fileReq(ctx context.Context, method, id, sub string, q url.Values, body io.Reader) (*http.Response, error) {
	u := "http://deltabox/" + apitypes.Version + "/sandboxes/" + url.PathEscape(id) + "/files" + sub + "?" + q.Encode()
	req, err := http.NewRequestWithContext(ctx, method, u, body)
	if err != nil {
		return nil, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/octet-stream")
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return nil, fmt.Errorf("request to the daemon abandoned: %w", ctx.Err())
		}
		return nil, fmt.Errorf("cannot reach the daemon on %s (is `deltabox daemon` running?): %w", c.Socket, err)
	}
	if resp.StatusCode < 300 {
		return resp, nil
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	return nil, errorFrom(resp, b)
}

func (c *Client) fileJSON(ctx context.Context, method, id, sub string, q url.Values, body io.Reader, out any) error {
	resp, err := c.fileReq(ctx, method, id, sub, q, body)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if out == nil {
		_, err = io.Copy(io.Discard, resp.Body)
		return err
	}
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		return err
	}
	switch v := out.(type) {
	case *apitypes.FileInfo:
		exactNames(v)
	case *apitypes.MkdirResult:
		exactNames(&v.Entry)
	case *apitypes.FileListing:
		v.Path = exact(v.Path, v.PathBase64)
		for i := range v.Entries {
			exactNames(&v.Entries[i])
		}
	}
	return nil
}

// exactNames puts the bytes of names that are not UTF-8 (sent in base64) in the text
// fields: Go strings hold any bytes, and a path from a listing then names its file.
func exactNames(in *apitypes.FileInfo) {
	in.Name = exact(in.Name, in.NameBase64)
	in.Path = exact(in.Path, in.PathBase64)
	in.LinkTarget = exact(in.LinkTarget, in.LinkTargetBase64)
}

func exact(text, b64 string) string {
	if b64 == "" {
		return text
	}
	if b, err := base64.StdEncoding.DecodeString(b64); err == nil {
		return string(b)
	}
	return text
}

// ReadFile returns the content of file p in sandbox id (absolute, or relative to
// its workdir). Files over 64 MiB are read with ReadFileRange.
func (c *Client) ReadFile(ctx context.Context, id, p string) ([]byte, error) {
	return c.ReadFileRange(ctx, id, p, 0, 0)
}

// ReadFileRange returns length bytes (0: to the end) of file p from offset.
func (c *Client) ReadFileRange(ctx context.Context, id, p string, offset, length int64) ([]byte, error) {
	rc, _, err := c.OpenFile(ctx, id, p, offset, length)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	return io.ReadAll(rc)
}

// OpenFile streams a range of file p (length 0: to the end) and returns the whole
// file's size. The caller closes the reader.
func (c *Client) OpenFile(ctx context.Context, id, p string, offset, length int64) (io.ReadCloser, int64, error) {
	q := url.Values{"path": {p}}
	if offset > 0 {
		q.Set("offset", strconv.FormatInt(offset, 10))
	}
	if length > 0 {
		q.Set("length", strconv.FormatInt(length, 10))
	}
	resp, err := c.fileReq(ctx, "GET", id, "", q, nil)
	if err != nil {
		return nil, 0, err
	}
	size, _ := strconv.ParseInt(resp.Header.Get(apitypes.HeaderFileSize), 10, 64)
	return resp.Body, size, nil
}

// WriteFileOptions configures WriteFile.
type WriteFileOptions struct {
	// Mode sets the file's permission bits when non-zero; otherwise an existing file
	// keeps its mode and a new one gets 0644.
	Mode os.FileMode
	// Mkdir creates missing parent directories.
	Mkdir bool
}

// WriteFile replaces file p's content with data, atomically, and returns the file.
func (c *Client) WriteFile(ctx context.Context, id, p string, data io.Reader, o WriteFileOptions) (*apitypes.FileInfo, error) {
	q := url.Values{"path": {p}}
	if o.Mode != 0 {
		q.Set("mode", fmt.Sprintf("%04o", uint32(o.Mode.Perm())|modeExtra(o.Mode)))
	}
	if o.Mkdir {
		q.Set("mkdir", "1")
	}
	if data == nil {
		data = bytes.NewReader(nil)
	}
	var out apitypes.FileInfo
	if err := c.fileJSON(ctx, "PUT", id, "", q, data, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// modeExtra is the setuid, setgid and sticky bits of m as permission bits.
func modeExtra(m os.FileMode) uint32 {
	var b uint32
	if m&os.ModeSetuid != 0 {
		b |= 0o4000
	}
	if m&os.ModeSetgid != 0 {
		b |= 0o2000
	}
	if m&os.ModeSticky != 0 {
		b |= 0o1000
	}
	return b
}

// ListFilesOptions configures ListFiles.
type ListFilesOptions struct {
	Recursive  bool
	Depth      int // levels of a recursive listing (0: the daemon's default, 32)
	MaxEntries int // 0: the daemon's default (10000)
}

// ListFiles lists directory p ("" for the workdir).
func (c *Client) ListFiles(ctx context.Context, id, p string, o ListFilesOptions) (*apitypes.FileListing, error) {
	q := url.Values{}
	if p != "" {
		q.Set("path", p)
	}
	if o.Recursive {
		q.Set("recursive", "1")
	}
	if o.Depth > 0 {
		q.Set("depth", strconv.Itoa(o.Depth))
	}
	if o.MaxEntries > 0 {
		q.Set("max_entries", strconv.Itoa(o.MaxEntries))
	}
	var out apitypes.FileListing
	if err := c.fileJSON(ctx, "GET", id, "/list", q, nil, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// StatFile describes p without following a final symlink.
func (c *Client) StatFile(ctx context.Context, id, p string) (*apitypes.FileInfo, error) {
	var out apitypes.FileInfo
	q := url.Values{}
	if p != "" {
		q.Set("path", p)
	}
	if err := c.fileJSON(ctx, "GET", id, "/stat", q, nil, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// RemoveFile removes p (a directory only when empty, unless recursive).
func (c *Client) RemoveFile(ctx context.Context, id, p string, recursive bool) error {
	q := url.Values{"path": {p}}
	if recursive {
		q.Set("recursive", "1")
	}
	return c.fileJSON(ctx, "DELETE", id, "", q, nil, nil)
}

// Mkdir creates directory p and its missing parents (mode 0: 0755) and reports
// whether p was created.
func (c *Client) Mkdir(ctx context.Context, id, p string, mode os.FileMode) (*apitypes.MkdirResult, error) {
	q := url.Values{"path": {p}}
	if mode != 0 {
		q.Set("mode", fmt.Sprintf("%04o", uint32(mode.Perm())|modeExtra(mode)))
	}
	var out apitypes.MkdirResult
	if err := c.fileJSON(ctx, "POST", id, "/mkdir", q, nil, &out); err != nil {
		return nil, err
	}
	return &out, nil
}
