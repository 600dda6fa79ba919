package bench

import (
	"encoding/json"
	"encoding/xml"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// testTree: 30 nodes, node i's parent (i-1)/3, scores rising with the id mod 7 so the
// best node (the first with the highest score) is n6.
func testTree() []MCTSTreeNode {
	var t []MCTSTreeNode
	for i := 0; i < 30; i++ {
		n := MCTSTreeNode{ID: i, Node: fmt.Sprintf("n%05x", i), Score: float64(i % 7), Visits: 30 - i,
			Restores: i % 3, LayerBytes: int64(1000 * i), TemplateBytes: int64(4096 * i)}
		if i > 0 {
			p := (i - 1) / 3
			n.Parent = &p
		}
		t = append(t, n)
	}
	return t
}

func TestMCTSTreeSVG(t *testing.T) {
	tree := testTree()
	svg := MCTSTreeSVG(tree, "a <test> tree")
	// Well-formed XML, no script.
	d := xml.NewDecoder(strings.NewReader(string(svg)))
	for {
		tok, err := d.Token()
		if err != nil {
			if err.Error() != "EOF" {
				t.Fatalf("not well-formed: %v", err)
			}
			break
		}
		if se, ok := tok.(xml.StartElement); ok && (se.Name.Local == "script" || se.Name.Local == "image") {
			t.Fatalf("the SVG has a <%s>", se.Name.Local)
		}
	}
	s := string(svg)
	if n := strings.Count(s, `class="node"`); n != 30 {
		t.Errorf("%d node boxes, want 30", n)
	}
	for _, n := range tree {
		if !strings.Contains(s, fmt.Sprintf(`data-id="%d" data-checkpoint="%s"`, n.ID, n.Node)) {
			t.Errorf("node %d (%s) not drawn", n.ID, n.Node)
		}
	}
	// The best node n6 (score 6) is at depth 2 (6 -> 1 -> 0): two thick edges, three
	// thick boxes.
	if n := strings.Count(s, `stroke="#c0392b" stroke-width="3.5"`); n != 2 {
		t.Errorf("%d best-path edges, want 2", n)
	}
	if n := strings.Count(s, `stroke="#c0392b" stroke-width="3.0"`); n != 3 {
		t.Errorf("%d best-path boxes, want 3", n)
	}
	if !strings.Contains(s, "a &lt;test&gt; tree") || !strings.Contains(s, "visits 24  restores 0") || !strings.Contains(s, "templ. 24 KiB") {
		t.Errorf("labels missing:\n%s", s)
	}
	if string(MCTSTreeSVG(tree, "a <test> tree")) != s {
		t.Error("the same tree drew different bytes")
	}
}

// TestMCTSTreeFigure: a deltabox row's tree, after the JSON round trip of a results
// file, is a figure of the report, linked from its section and written as SVG.
func TestMCTSTreeFigure(t *testing.T) {
	f := &File{Bench: "mcts-django", MCTS: []MCTSRow{
		{System: MCTSDeltaBox, ThinkS: 0, TotalS: 10, StateS: 0.1, Info: map[string]any{"tree": testTree()}},
		{System: MCTSDeltaBox, ThinkS: 2, TotalS: 60, StateS: 0.1, Info: map[string]any{"tree": testTree()}},
	}}
	b, err := json.Marshal(f)
	if err != nil {
		t.Fatal(err)
	}
	var g File
	if err := json.Unmarshal(b, &g); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "mcts-django.json"), b, 0o644); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "docs", "BENCHMARKS.md")
	os.MkdirAll(filepath.Dir(out), 0o755)
	if err := WriteReport(dir, out); err != nil {
		t.Fatal(err)
	}
	md, _ := os.ReadFile(out)
	// Both think times made the same tree: one figure.
	if n := strings.Count(string(md), "](plots/mcts-django-tree-"); n != 1 {
		t.Errorf("%d tree figures linked, want 1:\n%s", n, md)
	}
	svg, err := os.ReadFile(filepath.Join(dir, "docs", "plots", "mcts-django-tree-think0.svg"))
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(svg), `class="node"`); n != 30 {
		t.Errorf("the written SVG has %d nodes, want 30", n)
	}
}
