package bench

import (
	"bytes"
	"encoding/json"
	"fmt"
	"html"
	"sort"
)

// MCTSTreeNode is one node of the tree a search built, as examples/mcts.py records it
// before the checkpoints are removed: the search's own figures (score, reward, visits,
// rollbacks to it) and the daemon's (its own layer's bytes, its templates' private dirty
// memory, GET /v1/tree).
type MCTSTreeNode struct {
	ID                int     `json:"id"`
	Parent            *int    `json:"parent"`
	Node              string  `json:"node"` // the checkpoint's id
	Score             float64 `json:"score"`
	Reward            float64 `json:"reward"`
	Visits            int     `json:"visits"`
	Restores          int     `json:"restores"`
	Solved            bool    `json:"solved"`
	LayerBytes        int64   `json:"layer_bytes"`
	TemplateBytes     int64   `json:"template_bytes"`
	TemplateProcesses int     `json:"template_processes"`
}

// The picture of a search: the tree drawn as SVG (no script, no external reference),
// one box per node with its score, visits, restores, own layer and template memory, the
// path to the best node drawn thick. Laid out by depth (rows) and in order of the
// leaves (columns, each parent centred over its children), so the same tree gives the
// same bytes.

const (
	treeBoxW, treeBoxH = 122.0, 58.0
	treeGapX, treeGapY = 14.0, 36.0
	treeMargin         = 20.0
	treeHeader         = 56.0
)

// mctsTreeOf reads a row's tree (Info["tree"]: what mctsWorkloadInfo copied, or the
// same after a JSON round trip).
func mctsTreeOf(r MCTSRow) []MCTSTreeNode {
	v, ok := r.Info["tree"]
	if !ok {
		return nil
	}
	if t, ok := v.([]MCTSTreeNode); ok {
		return t
	}
	b, err := json.Marshal(v)
	if err != nil {
		return nil
	}
	var t []MCTSTreeNode
	if json.Unmarshal(b, &t) != nil {
		return nil
	}
	return t
}

// mctsBestPath: the ids from the root to the best node (highest score, then the
// earliest, as the search's summary picks it).
func mctsBestPath(nodes []MCTSTreeNode) map[int]bool {
	byID := map[int]MCTSTreeNode{}
	best := -1
	for _, n := range nodes {
		byID[n.ID] = n
		if best < 0 || n.Score > byID[best].Score || (n.Score == byID[best].Score && n.ID < best) {
			best = n.ID
		}
	}
	on := map[int]bool{}
	for id, ok := best, best >= 0; ok; {
		if on[id] {
			break // a cycle: not a tree
		}
		on[id] = true
		n := byID[id]
		if n.Parent == nil {
			break
		}
		id, ok = *n.Parent, true
		_, ok = byID[id]
	}
	return on
}

func kb(b int64) string {
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

// MCTSTreeSVG draws nodes (one search's tree) with title over it.
func MCTSTreeSVG(nodes []MCTSTreeNode, title string) []byte {
	kids := map[int][]int{}
	var roots []int
	byID := map[int]MCTSTreeNode{}
	for _, n := range nodes {
		byID[n.ID] = n
	}
	for _, n := range nodes {
		if n.Parent == nil {
			roots = append(roots, n.ID)
		} else if _, ok := byID[*n.Parent]; ok {
			kids[*n.Parent] = append(kids[*n.Parent], n.ID)
		} else {
			roots = append(roots, n.ID)
		}
	}
	for _, c := range kids {
		sort.Ints(c)
	}
	sort.Ints(roots)
	x := map[int]float64{}
	depth := map[int]int{}
	seen := map[int]bool{}
	next, maxDepth := 0.0, 0
	var place func(id, d int) float64
	place = func(id, d int) float64 {
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
	best := mctsBestPath(nodes)
	lo, hi := 0.0, 0.0
	for i, n := range nodes {
		if i == 0 || n.Score < lo {
			lo = n.Score
		}
		if i == 0 || n.Score > hi {
			hi = n.Score
		}
	}
	cx := func(id int) float64 { return treeMargin + x[id]*(treeBoxW+treeGapX) + treeBoxW/2 }
	cy := func(id int) float64 { return treeHeader + float64(depth[id])*(treeBoxH+treeGapY) }
	w := 2*treeMargin + max(1, next)*(treeBoxW+treeGapX) - treeGapX
	h := treeHeader + float64(maxDepth+1)*(treeBoxH+treeGapY) - treeGapY + treeMargin
	var b bytes.Buffer
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%.0f" height="%.0f" viewBox="0 0 %.0f %.0f" font-family="sans-serif" font-size="10">`+"\n", w, h, w, h)
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	fmt.Fprintf(&b, `<text x="%.0f" y="20" font-size="13" font-weight="bold">%s</text>`+"\n", treeMargin, html.EscapeString(title))
	fmt.Fprintf(&b, `<text x="%.0f" y="38">%s</text>`+"\n", treeMargin, html.EscapeString(fmt.Sprintf(
		"%d nodes. Each box: node, score (green: higher) / visits / restores (rollbacks to it) / own layer / template private dirty memory. Thick red: the path to the best node.", len(nodes))))
	ids := make([]int, 0, len(nodes))
	for _, n := range nodes {
		ids = append(ids, n.ID)
	}
	sort.Ints(ids)
	for _, id := range ids {
		n := byID[id]
		if n.Parent == nil || !seen[id] {
			continue
		}
		p := *n.Parent
		if _, ok := byID[p]; !ok {
			continue
		}
		stroke, sw := "#999", 1.0
		if best[id] && best[p] {
			stroke, sw = "#c0392b", 3.5
		}
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="%s" stroke-width="%.1f"/>`+"\n",
			cx(p), cy(p)+treeBoxH, cx(id), cy(id), stroke, sw)
	}
	for _, id := range ids {
		n := byID[id]
		if !seen[id] {
			continue
		}
		f := 0.5
		if hi > lo {
			f = (n.Score - lo) / (hi - lo)
		}
		fill := fmt.Sprintf("rgb(%d,%d,%d)", int(250-60*f), int(235+15*f), int(230-60*f))
		stroke, sw := "#555", 1.0
		if best[id] {
			stroke, sw = "#c0392b", 3.0
		}
		x0, y0 := cx(id)-treeBoxW/2, cy(id)
		fmt.Fprintf(&b, `<g class="node" data-id="%d" data-checkpoint="%s"><rect x="%.1f" y="%.1f" width="%.0f" height="%.0f" rx="5" fill="%s" stroke="%s" stroke-width="%.1f"/>`,
			id, html.EscapeString(n.Node), x0, y0, treeBoxW, treeBoxH, fill, stroke, sw)
		solved := ""
		if n.Solved {
			solved = " solved"
		}
		lines := []string{
			fmt.Sprintf("n%d %s%s", id, n.Node, solved),
			fmt.Sprintf("score %g  reward %.3f", n.Score, n.Reward),
			fmt.Sprintf("visits %d  restores %d", n.Visits, n.Restores),
			"layer " + kb(n.LayerBytes),
			fmt.Sprintf("templ. %s", kb(n.TemplateBytes)),
		}
		for i, l := range lines {
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

// mctsTreeFigures: the tree of DeltaBox's search at each think time (its first
// trajectory is enough when every think time made the same one).
func mctsTreeFigures(f *File, base string) []Figure {
	var out []Figure
	seen := map[string]bool{}
	for _, r := range f.MCTS {
		if r.System != MCTSDeltaBox {
			continue
		}
		t := mctsTreeOf(r)
		if len(t) == 0 {
			continue
		}
		key, _ := json.Marshal(struct {
			IDs []int
			P   []*int
		}{treeIDs(t), treeParents(t)})
		if seen[string(key)] {
			continue
		}
		seen[string(key)] = true
		title := fmt.Sprintf("bench %s: the tree DeltaBox's search built, %s s think", f.Bench, thinkArg(r.ThinkS))
		svg := MCTSTreeSVG(t, title)
		out = append(out, Figure{File: fmt.Sprintf("%s-tree-think%s.svg", base, thinkArg(r.ThinkS)), Title: title,
			Caption: fmt.Sprintf("%d nodes; layer and template memory as GET /v1/tree gave them at the end of the search", len(t)),
			raw:     func() ([]byte, error) { return svg, nil }})
	}
	return out
}

func treeIDs(t []MCTSTreeNode) []int {
	var out []int
	for _, n := range t {
		out = append(out, n.ID)
	}
	return out
}

func treeParents(t []MCTSTreeNode) []*int {
	var out []*int
	for _, n := range t {
		out = append(out, n.Parent)
	}
	return out
}
