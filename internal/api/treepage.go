package api

import (
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"html/template"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"deltabox/internal/apitypes"
	"deltabox/internal/errdefs"
	"deltabox/internal/treesvg"
)

// GET /v1/tree/page?root=NODE&sandbox=ID: the snapshot tree, or NODE's subtree, as one
// HTML page for a browser: the tree drawn by package treesvg (bench report's drawing)
// and a table of GET /v1/tree's figures per node, the path to the sandbox's node drawn
// thick. The page is read-only and self-contained: no script at all, no link, no
// external reference, and a Content-Security-Policy (default-src 'none', its one style
// element allowed by hash) that would stop any that a label smuggled past the escaping.
// Served where the API is, so on the TCP listener it takes an API key like every route.

// treePageStyle is the page's only style; the CSP allows exactly it, by its hash.
const treePageStyle = `
body { font-family: sans-serif; font-size: 14px; margin: 16px; color: #222; }
h1 { font-size: 20px; margin: 0 0 6px; }
p { margin: 4px 0 10px; }
.tree { overflow-x: auto; border: 1px solid #ccc; margin-bottom: 14px; }
table { border-collapse: collapse; font-size: 12px; }
th, td { border: 1px solid #ccc; padding: 2px 6px; text-align: left; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
tr.marked td { background: #fbe3e0; }
`

var treePageCSP = "default-src 'none'; style-src 'sha256-" + func() string {
	h := sha256.Sum256([]byte(treePageStyle))
	return base64.StdEncoding.EncodeToString(h[:])
}() + "'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"

// The boxes' colours: what a restore to the node brings back.
const (
	fillTemplates = "#d5efd5" // processes held by templates: restored in milliseconds
	fillImage     = "#d8e6f6" // processes in a durable image only
	fillFiles     = "#f2f2f2" // files only
)

var treePageTmpl = template.Must(template.New("page").Parse(`<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{{.Title}}</title><style>` + treePageStyle + `</style></head>
<body>
<h1>{{.Title}}</h1>
<p id="summary">{{.Summary}}</p>
<p>Each box: the node (← the sandboxes standing on it), its label, depth and children, its own layer, its process templates and
their private memory, its durable process image. Green: processes held by templates; blue: in a durable image only; grey: files only.</p>
{{range .Notes}}<p class="note">{{.}}</p>
{{end}}<div class="tree">{{.SVG}}</div>
<table id="nodes">
<thead><tr><th>node</th><th>parent</th><th>image</th><th>label</th><th>created</th><th>depth</th><th>children</th><th>sandboxes</th><th>own layer bytes</th><th>template processes</th><th>template private dirty bytes</th><th>process image</th><th>durable</th><th>pinned</th></tr></thead>
<tbody>
{{range .Rows}}<tr id="node-{{.ID}}"{{if .Marked}} class="marked"{{end}}><td class="id">{{.ID}}</td><td class="parent">{{.Parent}}</td><td class="image">{{.Image}}</td><td class="label">{{.Label}}</td><td class="created">{{.Created}}</td><td class="n depth">{{.Depth}}</td><td class="n children">{{.Children}}</td><td class="sandboxes">{{.Sandboxes}}</td><td class="n layer">{{.Layer}}</td><td class="n processes">{{.Processes}}</td><td class="n private">{{.Private}}</td><td class="process-image">{{.ProcessImage}}</td><td class="durable">{{.Durable}}</td><td class="pinned">{{.Pinned}}</td></tr>
{{end}}</tbody></table>
</body></html>
`))

type treePageRow struct {
	ID, Parent, Image, Label, Created string
	Depth, Children                   int
	Sandboxes, Layer                  string
	Processes                         int
	Private, ProcessImage             string
	Durable, Pinned, Marked           bool
}

func (s *Server) treePage(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	for k := range q {
		if k != "root" && k != "sandbox" {
			writeErr(w, fmt.Errorf("unknown parameter %q of GET /v1/tree/page: it takes root=NODE (that node's subtree) and sandbox=ID (its path drawn thick): %w", k, errdefs.ErrInvalid))
			return
		}
	}
	page, err := treePageHTML(s.m.Tree(), q.Get("root"), q.Get("sandbox"))
	if err != nil {
		writeErr(w, err)
		return
	}
	h := w.Header()
	h.Set("Content-Type", "text/html; charset=utf-8")
	h.Set("Content-Security-Policy", treePageCSP)
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "no-referrer")
	h.Set("Cache-Control", "no-store")
	w.WriteHeader(200)
	_, _ = w.Write(page) // a client that went away: nothing to tell it
}

// treePageHTML renders t's subtree under root ("" for all of it), the path to
// sandbox's node ("" for none) marked.
func treePageHTML(t *apitypes.Tree, root, sandbox string) ([]byte, error) {
	byID := map[string]*apitypes.NodeInfo{}
	for _, n := range t.Nodes {
		byID[n.ID] = n
	}
	// The nodes shown, in the tree's order (creation).
	shown := map[string]bool{}
	if root == "" {
		for _, n := range t.Nodes {
			shown[n.ID] = true
		}
	} else {
		if byID[root] == nil {
			return nil, fmt.Errorf("no node %q (GET /v1/tree lists them): %w", root, errdefs.ErrNotFound)
		}
		stack := []string{root}
		for len(stack) > 0 {
			id := stack[len(stack)-1]
			stack = stack[:len(stack)-1]
			if n := byID[id]; n != nil && !shown[id] {
				shown[id] = true
				stack = append(stack, n.Children...)
			}
		}
	}
	var notes []string
	marked := map[string]bool{}
	if sandbox != "" {
		head, onImage := "", ""
		for _, n := range t.Nodes {
			if slices.Contains(n.Sandboxes, sandbox) {
				head = n.ID
			}
		}
		for im, sbs := range t.OnImage {
			if slices.Contains(sbs, sandbox) {
				onImage = im
			}
		}
		switch {
		case head != "":
			for id := head; id != "" && byID[id] != nil && !marked[id]; id = byID[id].Parent {
				marked[id] = true
			}
			if shown[head] {
				notes = append(notes, fmt.Sprintf("Sandbox %s stands on node %s: its path is drawn thick red.", sandbox, head))
			} else {
				notes = append(notes, fmt.Sprintf("Sandbox %s stands on node %s, outside this part of the tree.", sandbox, head))
			}
		case onImage != "":
			notes = append(notes, fmt.Sprintf("Sandbox %s stands on image %s with no checkpoint yet.", sandbox, onImage))
		default:
			return nil, fmt.Errorf("no sandbox %q (GET /v1/sandboxes lists them): %w", sandbox, errdefs.ErrNotFound)
		}
	}
	var boxes []treesvg.Node
	var rows []treePageRow
	for _, n := range t.Nodes {
		if !shown[n.ID] {
			continue
		}
		parent := n.Parent
		if !shown[parent] {
			parent = "" // the part's root
		}
		procs, private := 0, ""
		fill := fillFiles
		if tp := n.Templates; tp != nil && tp.Processes > 0 {
			procs, private, fill = tp.Processes, strconv.FormatInt(tp.PrivateDirty, 10), fillTemplates
		}
		img := ""
		if pi := n.ProcessImage; pi != nil {
			img = pi.State
			if pi.State == "complete" && fill == fillFiles {
				fill = fillImage
			}
		}
		layer := "parent's"
		if n.Own {
			layer = strconv.FormatInt(n.Bytes, 10)
		}
		head := n.ID
		if len(n.Sandboxes) > 0 {
			head += " ← " + n.Sandboxes[0]
			if len(n.Sandboxes) > 1 {
				head += fmt.Sprintf(" +%d", len(n.Sandboxes)-1)
			}
		}
		label := "(no label)"
		if n.Label != "" {
			label = clip(n.Label, 26)
		}
		boxLayer := "layer: the parent's"
		if n.Own {
			boxLayer = "layer " + treesvg.Size(n.Bytes)
		}
		boxProcs := "no processes"
		if procs > 0 {
			boxProcs = fmt.Sprintf("%d processes, %s", procs, treesvg.Size(n.Templates.PrivateDirty))
		}
		boxImage := "no process image"
		if img != "" {
			boxImage = "process image " + img
		}
		boxes = append(boxes, treesvg.Node{
			ID: n.ID, Parent: parent,
			Attrs:  [][2]string{{"data-node", n.ID}},
			Lines:  []string{head, label, fmt.Sprintf("depth %d, %d children", n.Depth, len(n.Children)), boxLayer, boxProcs, boxImage},
			Fill:   fill,
			Marked: marked[n.ID],
		})
		rows = append(rows, treePageRow{
			ID: n.ID, Parent: n.Parent, Image: n.Image, Label: n.Label, Created: n.Created.UTC().Format("2006-01-02 15:04:05.000"),
			Depth: n.Depth, Children: len(n.Children), Sandboxes: strings.Join(n.Sandboxes, " "), Layer: layer,
			Processes: procs, Private: private, ProcessImage: img, Durable: n.Durable, Pinned: n.Pinned, Marked: marked[n.ID],
		})
	}
	title := "DeltaBox snapshot tree"
	if root != "" {
		title += ": the subtree of " + root
	}
	summary := fmt.Sprintf("%d nodes shown of %d.", len(rows), len(t.Nodes))
	if tp := t.Templates; tp != nil {
		summary += fmt.Sprintf(" Templates of the daemon: %d processes, %d bytes private dirty.", tp.Processes, tp.PrivateDirty)
	}
	if len(t.OnImage) > 0 {
		var ims []string
		for im, sbs := range t.OnImage {
			ims = append(ims, fmt.Sprintf("%s: %s", im, strings.Join(sbs, " ")))
		}
		slices.Sort(ims)
		summary += " On their image with no checkpoint: " + strings.Join(ims, "; ") + "."
	}
	svg := treesvg.Draw(boxes, treesvg.Options{Title: title, BoxW: 160})
	var b bytes.Buffer
	err := treePageTmpl.Execute(&b, struct {
		Title, Summary string
		Notes          []string
		SVG            template.HTML // treesvg escapes every text and attribute
		Rows           []treePageRow
	}{title, summary, notes, template.HTML(svg), rows})
	return b.Bytes(), err
}

// clip shortens s to n characters, an ellipsis last.
func clip(s string, n int) string {
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	return string([]rune(s)[:n-1]) + "…"
}
