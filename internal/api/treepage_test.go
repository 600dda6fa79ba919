package api

import (
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"regexp"
	"strings"
	"testing"
	"time"

	"golang.org/x/net/html"

	"deltabox/internal/apitypes"
	"deltabox/internal/errdefs"
)

// pageTestTree: n0 <- n1 <- {n2, n3}, sandbox sb on n2, sandbox other on the image;
// n1's label tries to open a script.
func pageTestTree() *apitypes.Tree {
	t0 := time.Unix(1_800_000_000, 0)
	mk := func(id, parent string, kids ...string) *apitypes.NodeInfo {
		n := &apitypes.NodeInfo{Node: apitypes.Node{ID: id, Parent: parent, Image: "default", Created: t0, Own: true, Bytes: 4096}, Children: kids, Durable: true}
		t0 = t0.Add(time.Second)
		return n
	}
	n0, n1, n2, n3 := mk("n0", "", "n1"), mk("n1", "n0", "n2", "n3"), mk("n2", "n1"), mk("n3", "n1")
	n0.Depth, n1.Depth, n2.Depth, n3.Depth = 1, 2, 3, 3
	n1.Label = `</td><script>alert(1)</script><img src=x onerror=alert(2)>`
	n2.Sandboxes = []string{"sb"}
	n2.Templates = &apitypes.TemplateInfo{Processes: 2, Memory: apitypes.Memory{PrivateDirty: 123456}}
	n2.ProcessImage = &apitypes.ImageInfo{State: "complete"}
	return &apitypes.Tree{Nodes: []*apitypes.NodeInfo{n0, n1, n2, n3}, Roots: []string{"n0"},
		OnImage: map[string][]string{"default": {"other"}}, Templates: &apitypes.TemplateInfo{Processes: 2}}
}

// TestTreePage: the page is well-formed HTML without any script, element or attribute
// that loads or runs something (a label's markup is text), its style is the one the
// CSP allows by hash, it shows the subtree asked for and marks the sandbox's path, and
// an unknown root or sandbox is a 404.
func TestTreePage(t *testing.T) {
	tr := pageTestTree()
	page, err := treePageHTML(tr, "", "sb")
	if err != nil {
		t.Fatal(err)
	}
	doc, err := html.Parse(bytes.NewReader(page))
	if err != nil {
		t.Fatal(err)
	}
	var rows []string
	var style string
	var walk func(*html.Node)
	walk = func(n *html.Node) {
		if n.Type == html.ElementNode {
			switch n.Data {
			case "script", "img", "image", "iframe", "object", "embed", "link", "foreignObject", "a", "form":
				t.Errorf("the page has a <%s>", n.Data)
			case "style":
				style = n.FirstChild.Data
			}
			for _, a := range n.Attr {
				if strings.HasPrefix(a.Key, "on") || a.Key == "href" || a.Key == "src" || a.Key == "style" {
					t.Errorf("<%s> has an attribute %s=%q", n.Data, a.Key, a.Val)
				}
				if a.Key == "id" && strings.HasPrefix(a.Val, "node-") {
					rows = append(rows, a.Val)
				}
			}
		}
		for c := n.FirstChild; c != nil; c = c.NextSibling {
			walk(c)
		}
	}
	walk(doc)
	if got := strings.Join(rows, " "); got != "node-n0 node-n1 node-n2 node-n3" {
		t.Errorf("rows %s, want n0 to n3", got)
	}
	h := sha256.Sum256([]byte(style))
	if !strings.Contains(treePageCSP, "'sha256-"+base64.StdEncoding.EncodeToString(h[:])+"'") || !strings.HasPrefix(treePageCSP, "default-src 'none';") {
		t.Errorf("the CSP %q does not allow exactly the page's style", treePageCSP)
	}
	s := string(page)
	for _, want := range []string{
		`<tr id="node-n2" class="marked"><td class="id">n2</td>`,
		`<td class="n processes">2</td><td class="n private">123456</td><td class="process-image">complete</td>`,
		"&lt;/td&gt;&lt;script&gt;alert(1)&lt;/script&gt;",
		"Sandbox sb stands on node n2",
		"On their image with no checkpoint: default: other.",
		`data-node="n2"><rect`,
	} {
		if !strings.Contains(s, want) {
			t.Errorf("the page lacks %q", want)
		}
	}
	// n2's path (n0, n1, n2): three thick boxes, two thick edges.
	if n := len(regexp.MustCompile(`stroke="#c0392b" stroke-width="3.0"`).FindAllString(s, -1)); n != 3 {
		t.Errorf("%d thick boxes, want 3", n)
	}
	if n := strings.Count(s, `stroke="#c0392b" stroke-width="3.5"`); n != 2 {
		t.Errorf("%d thick edges, want 2", n)
	}

	sub, err := treePageHTML(tr, "n1", "other")
	if err != nil {
		t.Fatal(err)
	}
	if s := string(sub); strings.Contains(s, `id="node-n0"`) || !strings.Contains(s, `id="node-n3"`) || !strings.Contains(s, "3 nodes shown of 4.") ||
		!strings.Contains(s, "Sandbox other stands on image default") {
		t.Errorf("the subtree of n1 for sandbox other:\n%s", s)
	}
	for _, c := range [][2]string{{"nX", ""}, {"", "nosuch"}} {
		if _, err := treePageHTML(tr, c[0], c[1]); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("root %q sandbox %q: %v, want not found", c[0], c[1], err)
		}
	}
}
