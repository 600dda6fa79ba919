// Package treesvg draws a tree of boxes as SVG: the picture of a search in `deltabox
// bench report` (internal/bench) and the daemon's page of the snapshot tree
// (GET /v1/tree/page, internal/api). One drawing for both, so the two pictures read
// the same way.
//
// The SVG has no script, no external reference and no style attribute (colours are
// presentation attributes), so it renders under a Content-Security-Policy of
// default-src 'none'. Nodes are laid out by depth (rows) and in the order of the
// leaves (columns, each parent centred over its children), children and roots in the
// order the caller gives them: the same nodes in the same order give the same bytes.
package treesvg

import (
	"bytes"
	"fmt"
	"html"
	"math"
)

// Node is one box.
type Node struct {
	ID string
	// Parent: "" or an id not among the nodes makes a root.
	Parent string
	// Attrs are attributes of the node's <g class="node"> (data-*), in order.
	Attrs [][2]string
	// Lines are the box's text, the first in bold.
	Lines []string
	Fill  string // the box's colour (an SVG colour)
	// Marked boxes are drawn thick, and so is an edge between two marked nodes (a path).
	Marked bool
}

// Options are the drawing's title, the legend under it (none: "") and the width of a box.
type Options struct {
	Title, Legend string
	BoxW          float64 // 0: 122, which fits 20 characters of 10-pixel sans-serif
}

const (
	minBoxH      = 58.0 // five lines
	gapX, gapY   = 14.0, 36.0
	margin       = 20.0
	header       = 56.0
	defaultBoxW  = 122.0
	markedStroke = "#c0392b"
)

// Draw draws nodes, each child under its parent, in the order given.
func Draw(nodes []Node, o Options) []byte {
	boxW := o.BoxW
	if boxW <= 0 {
		boxW = defaultBoxW
	}
	boxH := minBoxH
	for _, n := range nodes {
		boxH = max(boxH, math.Ceil(10.5*float64(len(n.Lines))+5.5))
	}
	byID := map[string]*Node{}
	for i := range nodes {
		byID[nodes[i].ID] = &nodes[i]
	}
	kids := map[string][]string{}
	var roots []string
	for _, n := range nodes {
		if _, ok := byID[n.Parent]; n.Parent != "" && ok {
			kids[n.Parent] = append(kids[n.Parent], n.ID)
		} else {
			roots = append(roots, n.ID)
		}
	}
	x := map[string]float64{}
	depth := map[string]int{}
	seen := map[string]bool{}
	next, maxDepth := 0.0, 0
	var place func(id string, d int) float64
	place = func(id string, d int) float64 {
		seen[id] = true
		depth[id] = d
		maxDepth = max(maxDepth, d)
		var xs []float64
		for _, c := range kids[id] {
			if !seen[c] {
				xs = append(xs, place(c, d+1))
			}
		}
		if len(xs) == 0 {
			x[id] = next
			next++
		} else {
			x[id] = (xs[0] + xs[len(xs)-1]) / 2
		}
		return x[id]
	}
	for _, r := range roots {
		place(r, 0)
	}
	cx := func(id string) float64 { return margin + x[id]*(boxW+gapX) + boxW/2 }
	cy := func(id string) float64 { return header + float64(depth[id])*(boxH+gapY) }
	w := 2*margin + max(1, next)*(boxW+gapX) - gapX
	h := header + float64(maxDepth+1)*(boxH+gapY) - gapY + margin
	var b bytes.Buffer
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%.0f" height="%.0f" viewBox="0 0 %.0f %.0f" font-family="sans-serif" font-size="10">`+"\n", w, h, w, h)
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	fmt.Fprintf(&b, `<text x="%.0f" y="20" font-size="13" font-weight="bold">%s</text>`+"\n", margin, html.EscapeString(o.Title))
	if o.Legend != "" {
		fmt.Fprintf(&b, `<text x="%.0f" y="38">%s</text>`+"\n", margin, html.EscapeString(o.Legend))
	}
	for _, n := range nodes {
		p, ok := byID[n.Parent]
		if n.Parent == "" || !ok || !seen[n.ID] {
			continue
		}
		stroke, sw := "#999", 1.0
		if n.Marked && p.Marked {
			stroke, sw = markedStroke, 3.5
		}
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="%s" stroke-width="%.1f"/>`+"\n",
			cx(p.ID), cy(p.ID)+boxH, cx(n.ID), cy(n.ID), stroke, sw)
	}
	for _, n := range nodes {
		if !seen[n.ID] {
			continue
		}
		stroke, sw := "#555", 1.0
		if n.Marked {
			stroke, sw = markedStroke, 3.0
		}
		x0, y0 := cx(n.ID)-boxW/2, cy(n.ID)
		b.WriteString(`<g class="node"`)
		for _, a := range n.Attrs {
			fmt.Fprintf(&b, ` %s="%s"`, html.EscapeString(a[0]), html.EscapeString(a[1]))
		}
		fmt.Fprintf(&b, `><rect x="%.1f" y="%.1f" width="%.0f" height="%.0f" rx="5" fill="%s" stroke="%s" stroke-width="%.1f"/>`,
			x0, y0, boxW, boxH, html.EscapeString(n.Fill), stroke, sw)
		for i, l := range n.Lines {
			weight := ""
			if i == 0 {
				weight = ` font-weight="bold"`
			}
			fmt.Fprintf(&b, `<text x="%.1f" y="%.1f"%s>%s</text>`, x0+5, y0+12+float64(i)*10.5, weight, html.EscapeString(l))
		}
		b.WriteString("</g>\n")
	}
	b.WriteString("</svg>\n")
	return b.Bytes()
}

// Size is a byte count for a box: KiB or MiB, "?" for a negative (unmeasured) one.
func Size(b int64) string {
	switch {
	case b < 0:
		return "?"
	case b >= 10<<20:
		return fmt.Sprintf("%.0f MiB", float64(b)/(1<<20))
	case b >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20))
	}
	return fmt.Sprintf("%.0f KiB", float64(b)/1024)
}
