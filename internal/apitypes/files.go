package apitypes

import "time"

// FileInfo describes one file (files.Info in the daemon): the answer of PUT
// /v1/sandboxes/{id}/files and GET /v1/sandboxes/{id}/files/stat, and each of
// FileListing's entries.
type FileInfo struct {
	Name        string    `json:"name"`
	Path        string    `json:"path"`
	Type        string    `json:"type"` // file, dir, symlink, fifo, socket, char, block
	Size        int64     `json:"size"`
	Mode        uint32    `json:"mode"`        // permission bits, setuid/setgid/sticky included (07777)
	Permissions string    `json:"permissions"` // as ls prints them: "-rw-r--r--"
	UID         uint32    `json:"uid"`
	GID         uint32    `json:"gid"`
	ModTime     time.Time `json:"mtime"`
	LinkTarget  string    `json:"link_target,omitempty"` // a symlink's target, as stored
	MountPoint  bool      `json:"mount_point,omitempty"` // another mount is on it (not reachable)
	// A name, path or link target that is not valid UTF-8 is also sent as base64 of
	// its bytes (the text field then has U+FFFD for each invalid byte). A path query
	// parameter takes the bytes percent-encoded (%E9).
	NameBase64       string `json:"name_base64,omitempty"`
	PathBase64       string `json:"path_base64,omitempty"`
	LinkTargetBase64 string `json:"link_target_base64,omitempty"`
}

// FileListing is the answer of GET /v1/sandboxes/{id}/files/list (files.Listing in
// the daemon).
type FileListing struct {
	Path       string     `json:"path"`
	PathBase64 string     `json:"path_base64,omitempty"` // Path's bytes when not UTF-8
	Entries    []FileInfo `json:"entries"`
	Truncated  bool       `json:"truncated"` // max_entries was reached
}

// FileContent is the answer of GET /v1/sandboxes/{id}/files?format=json.
type FileContent struct {
	Path     string `json:"path"`
	Size     int64  `json:"size"`     // the whole file's size
	Offset   int64  `json:"offset"`   // where Content starts
	Encoding string `json:"encoding"` // "base64"
	Content  []byte `json:"content"`  // base64 in JSON
}

// MkdirResult is the answer of POST /v1/sandboxes/{id}/files/mkdir.
type MkdirResult struct {
	Created bool     `json:"created"` // false: it existed already
	Entry   FileInfo `json:"entry"`
}

// Headers of a raw read (GET /v1/sandboxes/{id}/files).
const (
	HeaderFileSize = "X-Deltabox-File-Size" // the whole file's size (a range may be shorter)
	HeaderFileMode = "X-Deltabox-File-Mode" // permission bits, octal
)
