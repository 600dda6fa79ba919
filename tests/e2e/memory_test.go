package e2e

// The memory of checkpoints (issue 16, items 7 and 5): templates are processes of the
// sandbox, so they count against its memory limit. Checkpoint and restore answers show
// what they hold, warn when it is over half the limit, and a command killed by the
// limit says so, naming the templates. Raw JSON for the new fields, so that the tests
// compile and fail against a daemon without them. Helpers are prefixed mem.

import (
	"encoding/json"
	"strings"
	"testing"

	"deltabox/internal/api"
	"deltabox/internal/state"
	"deltabox/internal/testutil"
)

// memHeap (re)writes a 60 MiB heap in the python session py: after a checkpoint, the
// template keeps the old pages.
const memHeap = "h = bytearray(60 << 20)\nfor i in range(0, len(h), 4096): h[i] = 1\n"

// memSetup creates a sandbox with 256 MiB of memory, and no template budget of its own
// (template_budget_mb -1: templates count against memory_mb), and a python session holding
// 60 MiB, and checkpoints it three times, rewriting the heap in between: the first two
// templates then hold their 60 MiB alone, the third shares its with the live process.
// It returns the sandbox and the answers.
func memSetup(t *testing.T, d *testutil.Daemon, id string) []map[string]any {
	t.Helper()
	if _, err := d.C.Create(dbxCtx(t), state.CreateOptions{ID: id, MemoryMB: 256, TemplateBudgetMB: -1}); err != nil {
		t.Fatal(err)
	}
	if _, err := d.C.StartSession(dbxCtx(t), id, state.SessionOptions{Name: "py", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	var out []map[string]any
	for i := 0; i < 3; i++ {
		r := dbxExec(t, d, id, api.ExecRequest{Session: "py", Argv: []string{memHeap}})
		if r.ExitCode != 0 {
			t.Fatalf("heap %d: %+v", i, r)
		}
		s, a, m := wtOp(t, d, id, "", map[string]any{"label": "heap"})
		if s != 201 {
			t.Fatalf("checkpoint %d: %d %s", i, s, m)
		}
		out = append(out, a)
	}
	return out
}

// memField is ans["memory"][key] as a number (0 if missing).
func memField(ans map[string]any, keys ...string) float64 {
	var v any = ans["memory"]
	for _, k := range keys {
		m, _ := v.(map[string]any)
		v = m[k]
	}
	f, _ := v.(float64)
	return f
}

func memWarnings(ans map[string]any) string {
	ws, _ := ans["warnings"].([]any)
	var out []string
	for _, w := range ws {
		s, _ := w.(string)
		out = append(out, s)
	}
	return strings.Join(out, "\n")
}

// TestTemplateMemoryInAnswers: a checkpoint's answer has the sandbox's limit and usage
// and its new templates' resident memory; once the templates hold over half the limit
// it totals them and warns, naming the nodes; sandbox info and the tree show them too.
func TestTemplateMemoryInAnswers(t *testing.T) {
	d := testutil.StartDaemonNoImages(t)
	id := "mem1"
	ans := memSetup(t, d, id)
	first := ans[0]
	if got := memField(first, "limit_bytes"); got != 256<<20 {
		t.Fatalf("memory.limit_bytes %v, want 256 MiB: %v", got, first["memory"])
	}
	if u := memField(first, "usage_bytes"); u < 60<<20 || u > 256<<20 {
		t.Fatalf("memory.usage_bytes %v, want the session's 60 MiB and more", u)
	}
	if rss := memField(first, "node_templates_rss_bytes"); rss < 60<<20 || rss > 120<<20 {
		t.Fatalf("memory.node_templates_rss_bytes %v, want the python's ~65 MiB", rss)
	}
	if w := memWarnings(first); w != "" {
		t.Fatalf("first checkpoint warns: %s", w)
	}
	last := ans[2]
	pss := memField(last, "templates", "pss_bytes")
	if pss < 128<<20 || memField(last, "templates", "processes") != 3 {
		t.Fatalf("memory.templates after three checkpoints of a rewritten 60 MiB heap: %v, want 3 processes holding over 128 MiB", last["memory"])
	}
	w := memWarnings(last)
	n1 := wtNode(t, first)
	if !strings.Contains(w, "of its 256 MiB memory limit") || !strings.Contains(w, n1) || !strings.Contains(w, "tree rm") {
		t.Fatalf("warning %q, want the limit, the first node %s and what to do", w, n1)
	}
	t.Logf("warning: %s", w)

	// Sandbox info: the total; the tree: each node's.
	_, raw := dbxRaw(t, d, "GET", "/sandboxes/"+id, "")
	var info map[string]any
	json.Unmarshal(raw, &info)
	tm, _ := info["templates"].(map[string]any)
	if p, _ := tm["processes"].(float64); p != 3 {
		t.Fatalf("sandbox info templates %v", info["templates"])
	}
	tree, err := d.C.Tree(dbxCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range tree.Nodes {
		if n.Templates == nil || n.Templates.Processes != 1 || n.Templates.Rss < 60<<20 {
			t.Fatalf("node %s: templates %+v", n.ID, n.Templates)
		}
	}
	// A restore answers with the sandbox's memory too.
	s, a, m := wtOp(t, d, id, n1, nil)
	if s != 200 || memField(a, "limit_bytes") != 256<<20 || memField(a, "usage_bytes") <= 0 {
		t.Fatalf("restore: %d %s %v", s, m, a["memory"])
	}
}

// TestOOMMessageNamesLimitAndTemplates: an exec, and a session call, whose process the
// sandbox's memory limit killed say so: the limit, and how much of it the templates of
// the sandbox's checkpoints hold, by node.
func TestOOMMessageNamesLimitAndTemplates(t *testing.T) {
	d := testutil.StartDaemonNoImages(t)
	id := "mem2"
	ans := memSetup(t, d, id)
	n1 := wtNode(t, ans[0])
	// The hog is the OOM killer's choice (oom_score_adj 1000), not a template.
	hog := `echo 1000 > /proc/self/oom_score_adj; exec python3 -c 'b = bytearray(300 << 20)
for i in range(0, len(b), 4096): b[i] = 1'`
	st, raw := dbxRaw(t, d, "POST", "/sandboxes/"+id+"/exec", mustJSON(t, api.ExecRequest{Argv: []string{"bash", "-c", hog}, TimeoutMS: 60_000}))
	var res map[string]any
	if err := json.Unmarshal(raw, &res); err != nil || st != 200 {
		t.Fatalf("exec: %d %s", st, raw)
	}
	oom, _ := res["oom"].(string)
	if sig, _ := res["signal"].(float64); sig != 9 {
		t.Fatalf("the hog was not killed by SIGKILL: %s", raw)
	}
	for _, want := range []string{"killed by SIGKILL", "memory limit (256 MiB) was reached", "held by the templates of the sandbox's checkpoints", n1, "memory_mb"} {
		if !strings.Contains(oom, want) {
			t.Fatalf("exec's oom %q lacks %q (answer %s)", oom, want, raw)
		}
	}
	t.Logf("exec: %s", oom)
	// The next command was not killed: no oom.
	st, raw = dbxRaw(t, d, "POST", "/sandboxes/"+id+"/exec", `{"argv":["true"]}`)
	if st != 200 || strings.Contains(string(raw), `"oom"`) {
		t.Fatalf("a command after the kill: %d %s", st, raw)
	}

	// A session whose process the limit kills during a call.
	if _, err := d.C.StartSession(dbxCtx(t), id, state.SessionOptions{Name: "hog", Kind: "python"}); err != nil {
		t.Fatal(err)
	}
	code := "open('/proc/self/oom_score_adj', 'w').write('1000')\nb = bytearray(300 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\n"
	st, raw = dbxRaw(t, d, "POST", "/sandboxes/"+id+"/exec", mustJSON(t, api.ExecRequest{Session: "hog", Argv: []string{code}, TimeoutMS: 60_000}))
	// A session that ends during a call answers an error or, where the session says how
	// it ended in a result (exit -1, signal 9), that result: either carries the note.
	var msg string
	if st >= 300 {
		_, msg = dbxErrorBody(t, raw)
	} else {
		var sres map[string]any
		json.Unmarshal(raw, &sres)
		if sig, _ := sres["signal"].(float64); sig != 9 {
			t.Fatalf("the session call survived: %d %s", st, raw)
		}
		msg, _ = sres["oom"].(string)
	}
	for _, want := range []string{"memory limit (256 MiB) was reached", "held by the templates of the sandbox's checkpoints", n1} {
		if !strings.Contains(msg, want) {
			t.Fatalf("session call's answer %q lacks %q (%s)", msg, want, raw)
		}
	}
	t.Logf("session: %s", msg)
}

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
