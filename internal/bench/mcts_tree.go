package bench

import (
	"encoding/json"
	"fmt"
	"slices"
	"sort"
	"strconv"

	"deltabox/internal/treesvg"
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

// The picture of a search: the tree drawn as SVG by package treesvg, one box per node
// with its score, visits, restores, own layer and template memory, the path to the best
// node drawn thick, children in the order of their ids.

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

// MCTSTreeSVG draws nodes (one search's tree) with title over it.
func MCTSTreeSVG(nodes []MCTSTreeNode, title string) []byte {
	nodes = slices.Clone(nodes)
	sort.SliceStable(nodes, func(i, j int) bool { return nodes[i].ID < nodes[j].ID })
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
	boxes := make([]treesvg.Node, 0, len(nodes))
	for _, n := range nodes {
		f := 0.5
		if hi > lo {
			f = (n.Score - lo) / (hi - lo)
		}
		solved := ""
		if n.Solved {
			solved = " solved"
		}
		box := treesvg.Node{
			ID:    strconv.Itoa(n.ID),
			Attrs: [][2]string{{"data-id", strconv.Itoa(n.ID)}, {"data-checkpoint", n.Node}},
			Lines: []string{
				fmt.Sprintf("n%d %s%s", n.ID, n.Node, solved),
				fmt.Sprintf("score %g  reward %.3f", n.Score, n.Reward),
				fmt.Sprintf("visits %d  restores %d", n.Visits, n.Restores),
				"layer " + treesvg.Size(n.LayerBytes),
				fmt.Sprintf("templ. %s", treesvg.Size(n.TemplateBytes)),
			},
			Fill:   fmt.Sprintf("rgb(%d,%d,%d)", int(250-60*f), int(235+15*f), int(230-60*f)),
			Marked: best[n.ID],
		}
		if n.Parent != nil {
			box.Parent = strconv.Itoa(*n.Parent)
		}
		boxes = append(boxes, box)
	}
	return treesvg.Draw(boxes, treesvg.Options{Title: title, Legend: fmt.Sprintf(
		"%d nodes. Each box: node, score (green: higher) / visits / restores (rollbacks to it) / own layer / template private dirty memory. Thick red: the path to the best node.", len(nodes))})
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
