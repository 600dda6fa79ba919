package e2e

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/net/html"

	"deltabox/internal/apitypes"
	"deltabox/internal/client"
	"deltabox/internal/testutil"
)

// tpArtifacts is the directory a test leaves its artefacts in, kept after the run:
// $DELTABOX_ARTIFACTS/NAME, or deltabox-artifacts/NAME in the temporary directory.
func tpArtifacts(t *testing.T) string {
	t.Helper()
	base := os.Getenv("DELTABOX_ARTIFACTS")
	if base == "" {
		base = filepath.Join(os.TempDir(), "deltabox-artifacts")
	}
	dir := filepath.Join(base, t.Name())
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Logf("artefacts in %s", dir)
	return dir
}

// tpChromium runs headless Chromium on url with args (--dump-dom, --screenshot=FILE)
// and returns its stdout and stderr.
func tpChromium(t *testing.T, chromium, url string, args ...string) (string, string) {
	t.Helper()
	args = append([]string{"--headless", "--disable-gpu", "--no-first-run", "--user-data-dir=" + t.TempDir(),
		"--enable-logging=stderr", "--v=0"}, args...)
	if os.Geteuid() == 0 {
		args = append(args, "--no-sandbox") // Chromium's own sandbox refuses to run as root; the page has no script
	}
	cmd := testutil.Command(t, 90*time.Second, chromium, append(args, url)...)
	var stdout, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("chromium %s: %v\n%s", strings.Join(args, " "), err, dbxTail(stderr.String(), 3000))
	}
	return stdout.String(), stderr.String()
}

// tpRow is what the page's table shows of a node, cell by cell (class: text).
func tpRows(doc *html.Node) (rows map[string]map[string]string, marked []string, boxes []string, summary string, scripts int) {
	rows = map[string]map[string]string{}
	text := func(n *html.Node) string {
		var b strings.Builder
		var f func(*html.Node)
		f = func(n *html.Node) {
			if n.Type == html.TextNode {
				b.WriteString(n.Data)
			}
			for c := n.FirstChild; c != nil; c = c.NextSibling {
				f(c)
			}
		}
		f(n)
		return b.String()
	}
	attr := func(n *html.Node, k string) string {
		for _, a := range n.Attr {
			if a.Key == k {
				return a.Val
			}
		}
		return ""
	}
	var walk func(*html.Node)
	walk = func(n *html.Node) {
		if n.Type == html.ElementNode {
			switch {
			case n.Data == "tr" && strings.HasPrefix(attr(n, "id"), "node-"):
				id := strings.TrimPrefix(attr(n, "id"), "node-")
				cells := map[string]string{}
				for c := n.FirstChild; c != nil; c = c.NextSibling {
					if c.Type == html.ElementNode && c.Data == "td" {
						cls := strings.Fields(attr(c, "class"))
						cells[cls[len(cls)-1]] = text(c)
					}
				}
				rows[id] = cells
				if attr(n, "class") == "marked" {
					marked = append(marked, id)
				}
			case n.Data == "g" && attr(n, "class") == "node":
				boxes = append(boxes, attr(n, "data-node"))
			case n.Data == "p" && attr(n, "id") == "summary":
				summary = text(n)
			case n.Data == "script":
				scripts++
			}
		}
		for c := n.FirstChild; c != nil; c = c.NextSibling {
			walk(c)
		}
	}
	walk(doc)
	return
}

// tpWant is what the page must show of node n: GET /v1/tree's figures.
func tpWant(n *apitypes.NodeInfo) map[string]string {
	layer, procs, private, img := "parent's", "0", "", ""
	if n.Own {
		layer = strconv.FormatInt(n.Bytes, 10)
	}
	if tp := n.Templates; tp != nil && tp.Processes > 0 {
		procs, private = strconv.Itoa(tp.Processes), strconv.FormatInt(tp.PrivateDirty, 10)
	}
	if n.ProcessImage != nil {
		img = n.ProcessImage.State
	}
	return map[string]string{"id": n.ID, "parent": n.Parent, "image": n.Image, "label": n.Label, "depth": strconv.Itoa(n.Depth),
		"children": strconv.Itoa(len(n.Children)), "sandboxes": strings.Join(n.Sandboxes, " "), "layer": layer,
		"processes": procs, "process-image": img, "durable": strconv.FormatBool(n.Durable), "private": private}
}

// TestTreePageChromium: a tree of 30 nodes (25 of files only, branching by restores,
// some without a layer of their own; then 5 with a bash session's process templates and
// their durable images; a second sandbox standing in the middle), its page fetched over
// the daemon's TCP listener with an API key (without one: 401) and rendered by headless
// Chromium: the DOM Chromium built lists every node GET /v1/tree lists, each with the
// tree's figures (parent, depth, children, sandboxes, own layer, template processes and
// memory, process image), a box per node in the drawing, and the path to the sandbox's
// node marked. The screenshot is the test's artefact.
func TestTreePageChromium(t *testing.T) {
	chromium, err := exec.LookPath("chromium")
	testutil.Require(t, err == nil, "needs Debian's chromium to render the tree page (scripts/setup.sh installs it): %v", err)
	d, addr := testutil.StartRemoteDaemon(t)
	key := testutil.NewKey(t, d, "treepage")
	start := time.Now()
	const a, b = "page-a", "page-b"
	dbxCreate(t, d, a)
	dbxCreate(t, d, b)

	// 25 nodes of files: a chain with a branch every fifth node (its parent the node
	// half-way back), every seventh checkpointed without a change (no layer of its own).
	var nodes []string
	var tRestore, tWrite, tCkpt time.Duration
	timed := func(acc *time.Duration, f func()) { t0 := time.Now(); f(); *acc += time.Since(t0) }
	noLayer := 0
	for i := 0; i < 25; i++ {
		if i > 0 && i%5 == 0 {
			timed(&tRestore, func() { dbxRestore(t, d, a, nodes[i/2]) })
		}
		if i%7 == 6 {
			noLayer++
		} else {
			timed(&tWrite, func() {
				if _, err := d.C.WriteFile(dbxCtx(t), a, fmt.Sprintf("/workspace/f%d", i), strings.NewReader(strings.Repeat("x", 1000*(i+1))), client.WriteFileOptions{}); err != nil {
					t.Fatal(err)
				}
			})
		}
		timed(&tCkpt, func() {
			nodes = append(nodes, dbxCheckpoint(t, d, a, fmt.Sprintf("files %d <script>document.title='ran'</script>&", i)).Node.ID)
		})
	}
	// 5 more with a bash session: its process is in each node's templates.
	for i := 25; i < 30; i++ {
		timed(&tWrite, func() { sessRun(t, d, a, "main", fmt.Sprintf("export STEP=%d; echo %d > /workspace/s", i, i)) })
		timed(&tCkpt, func() { nodes = append(nodes, dbxCheckpoint(t, d, a, fmt.Sprintf("session %d", i)).Node.ID) })
	}
	dbxRestore(t, d, b, nodes[7])
	built := time.Since(start)
	t.Logf("30 nodes built in %v: restores %v, writes %v, checkpoints %v", built.Round(time.Millisecond),
		tRestore.Round(time.Millisecond), tWrite.Round(time.Millisecond), tCkpt.Round(time.Millisecond))

	// Settled figures: every layer measured, no image pending.
	dbxWaitImages(t, d)
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		tr, err := d.C.Tree(dbxCtx(t))
		if err != nil {
			t.Fatal(err)
		}
		if !slices.ContainsFunc(tr.Nodes, func(n *apitypes.NodeInfo) bool { return n.Own && n.Bytes < 0 }) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("layers still unmeasured (layer_bytes -1) 20 s after the last checkpoint")
		}
	}

	// The daemon's TCP listener, with the key added by a proxy for Chromium (which cannot
	// send one); without a key the page is refused like any route.
	target := &url.URL{Scheme: "http", Host: addr}
	resp, err := http.Get(target.String() + "/v1/tree/page")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 401 {
		t.Errorf("GET /v1/tree/page without a key on the TCP listener: %d, want 401", resp.StatusCode)
	}
	rp := httputil.NewSingleHostReverseProxy(target)
	director := rp.Director
	rp.Director = func(r *http.Request) { director(r); r.Header.Set("Authorization", "Bearer "+key) }
	proxy := httptest.NewServer(rp)
	defer proxy.Close()
	pageURL := proxy.URL + "/v1/tree/page?sandbox=" + a
	resp, err = http.Get(pageURL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if csp := resp.Header.Get("Content-Security-Policy"); resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/html") ||
		!strings.HasPrefix(csp, "default-src 'none';") || strings.Contains(csp, "script-src") || strings.Contains(csp, "unsafe") {
		t.Errorf("GET /v1/tree/page with a key: %d, Content-Type %q, Content-Security-Policy %q: want 200, text/html, default-src 'none' and no script or unsafe source",
			resp.StatusCode, resp.Header.Get("Content-Type"), csp)
	}

	art := tpArtifacts(t)
	before, err := d.C.Tree(dbxCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	page, err := d.C.TreePage(dbxCtx(t), "", a)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(art, "tree-page.html"), page, 0o644); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	dom, stderr := tpChromium(t, chromium, pageURL, "--dump-dom")
	dumpTime := time.Since(t0)
	after, err := d.C.Tree(dbxCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(stderr, "violates the following Content Security Policy") {
		t.Errorf("Chromium refused part of the page under its CSP:\n%s", dbxTail(stderr, 2000))
	}
	if err := os.WriteFile(filepath.Join(art, "tree-page.dom.html"), []byte(dom), 0o644); err != nil {
		t.Fatal(err)
	}
	doc, err := html.Parse(strings.NewReader(dom))
	if err != nil {
		t.Fatal(err)
	}
	rows, marked, boxes, summary, scripts := tpRows(doc)
	if scripts > 0 || strings.Contains(dom, "<title>ran</title>") {
		t.Errorf("the labels' <script> became %d script elements in Chromium's DOM", scripts)
	}

	if len(before.Nodes) != 30 {
		t.Fatalf("GET /v1/tree lists %d nodes, want the 30 made", len(before.Nodes))
	}
	if want := "30 nodes shown of 30."; !strings.HasPrefix(summary, want) {
		t.Errorf("summary %q, want it to start %q", summary, want)
	}
	if len(rows) != 30 || len(boxes) != 30 {
		t.Errorf("the page shows %d rows and %d boxes, want 30 of each", len(rows), len(boxes))
	}
	for i, n := range before.Nodes {
		want := tpWant(n)
		if w2 := tpWant(after.Nodes[i]); fmt.Sprint(w2) != fmt.Sprint(want) {
			t.Fatalf("node %s changed while the page was rendered: %v, then %v", n.ID, want, w2)
		}
		got := rows[n.ID]
		for k, v := range want {
			if got[k] != v {
				t.Errorf("node %s: the page shows %s %q, the API %q", n.ID, k, got[k], v)
			}
		}
		if !slices.Contains(boxes, n.ID) {
			t.Errorf("node %s has no box in the drawing", n.ID)
		}
	}
	// The counts the test made: 5 nodes with a process, noLayer without a layer of their
	// own, b on node 7, a on the last node.
	withProcs, gotNoLayer := 0, 0
	for _, r := range rows {
		if r["processes"] != "0" {
			withProcs++
		}
		if r["layer"] == "parent's" {
			gotNoLayer++
		}
	}
	if withProcs != 5 || gotNoLayer != noLayer || rows[nodes[7]]["sandboxes"] != b || rows[nodes[29]]["sandboxes"] != a {
		t.Errorf("the page shows %d nodes with processes (want 5), %d without a layer of their own (want %d), %q on node 7 (want %s), %q on node 29 (want %s)",
			withProcs, gotNoLayer, noLayer, rows[nodes[7]]["sandboxes"], b, rows[nodes[29]]["sandboxes"], a)
	}
	var path []string
	for id := nodes[29]; id != ""; id = rows[id]["parent"] {
		path = append(path, id)
	}
	slices.Sort(path)
	slices.Sort(marked)
	if !slices.Equal(path, marked) {
		t.Errorf("marked rows %v, want the path to %s's node %v", marked, a, path)
	}

	// The CLI writes the same page (its figures may have moved on: only its rows).
	file := filepath.Join(t.TempDir(), "tree.html")
	if out, err := testutil.Command(t, time.Minute, testutil.Binary(t), "--socket", d.Socket, "tree", "--html", file, "--root", nodes[10], "--sandbox", b).CombinedOutput(); err != nil {
		t.Fatalf("deltabox tree --html: %v\n%s", err, out)
	}
	if cli, err := os.ReadFile(file); err != nil {
		t.Fatal(err)
	} else if s := string(cli); !strings.Contains(s, `<tr id="node-`+nodes[10]+`">`) || strings.Contains(s, `<tr id="node-`+nodes[9]+`">`) ||
		!strings.Contains(s, "outside this part of the tree") {
		t.Errorf("deltabox tree --html --root %s --sandbox %s wrote no page of %s's subtree (without %s, %s outside it):\n%s", nodes[10], b, nodes[10], nodes[9], b, dbxTail(s, 2000))
	}

	// The screenshot: wide enough for the drawing, tall enough for the table.
	w, h := 1400, 400+30*26
	if i := strings.Index(dom, `<svg xmlns="http://www.w3.org/2000/svg" width="`); i >= 0 {
		var sw, sh int
		if _, err := fmt.Sscanf(dom[i:], `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d"`, &sw, &sh); err == nil {
			w, h = min(max(w, sw+60), 6000), min(h+sh, 8000)
		}
	}
	shot := filepath.Join(art, "tree-page.png")
	tpChromium(t, chromium, pageURL, "--screenshot="+shot, fmt.Sprintf("--window-size=%d,%d", w, h), "--hide-scrollbars")
	if st, err := os.Stat(shot); err != nil || st.Size() < 10_000 {
		t.Fatalf("no screenshot at %s (%v)", shot, err)
	}
	t.Logf("chromium --dump-dom %v; the test from its first sandbox %v; screenshot %s (%dx%d)",
		dumpTime.Round(time.Millisecond), time.Since(start).Round(time.Millisecond), shot, w, h)
}
