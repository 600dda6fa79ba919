package apitypes

import "time"

// Image is an imported image (store.Image in the daemon): the answer of POST
// /v1/images, and each of GET /v1/images's "images".
type Image struct {
	Name    string    `json:"name"`
	Created time.Time `json:"created"`
	Source  string    `json:"source,omitempty"`
	Bytes   int64     `json:"bytes,omitempty"`
}

// ImportRequest is the body of POST /v1/images.
type ImportRequest struct {
	Name        string `json:"name"`
	Source      string `json:"source"` // a path on the daemon's host
	AllowSetuid bool   `json:"allow_setuid,omitempty"`
	MaxBytes    int64  `json:"max_bytes,omitempty"`   // 0: the default (4 GiB; image.DefaultMaxBytes)
	MaxEntries  int64  `json:"max_entries,omitempty"` // 0: the default (4194304; image.DefaultMaxEntries)
}

// ImportEvent is one line of POST /v1/images?progress=1 (NDJSON): progress
// ({"done":N,"total":M}), then exactly one of {"image":{...}} or {"error":{...}}.
type ImportEvent struct {
	Done  *int64       `json:"done,omitempty"`
	Total *int64       `json:"total,omitempty"`
	Image *Image       `json:"image,omitempty"`
	Error *ErrorDetail `json:"error,omitempty"`
}

// NodeImport is the answer of POST /v1/nodes/import.
type NodeImport struct {
	// Node is the imported node here (the archive's last), to restore or create from.
	Node  string `json:"node"`
	Image string `json:"image"`
	// Nodes maps the archive's chain, root first, to this store's nodes; Reused: the
	// store had it (same image and layers) and nothing was written for it (an ancestor
	// of a reused node has an empty id: the reused node stands for its whole chain).
	Nodes []ImportedNode `json:"nodes"`
	// ProcessImage: the node's durable process image was carried, verified and kept.
	ProcessImage bool     `json:"process_image"`
	Warnings     []string `json:"warnings,omitempty"`
}

// ImportedNode is one node of an imported chain.
type ImportedNode struct {
	From   string `json:"from"` // its id on the exporting host
	ID     string `json:"id,omitempty"`
	Reused bool   `json:"reused,omitempty"`
}
