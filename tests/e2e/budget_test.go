package e2e

// The template memory budget (issue 17, item 3): templates have a budget of their own,
// apart from memory_mb. The reproduction of the report: memory_mb=512 and a python
// session holding a 150 MB heap it rewrites between three checkpoints. Without a budget
// of their own (template_budget_mb -1, as before) the templates' old pages stay charged
// to the sandbox and a process is OOM-killed; with one the session survives; with a
// small one the checkpoint past it waits its wait_ms, then gets 507 naming the budget,
// and the session is alive and unchanged. Raw JSON for the new fields, so that the tests
// compile and fail against a daemon without them. Helpers are prefixed bud.

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"deltabox/internal/api"
	"deltabox/internal/cgroup"
	"deltabox/internal/testutil"
)

// budHeap makes the session's 150 MiB heap, every page written.
const budHeap = "h = bytearray(150 << 20)\nstep = 0\nfor i in range(0, len(h), 4096): h[i] = 1\n"

// budRewrite writes every page of the heap again, in place (a new bytearray would hold
// two heaps at once): after a checkpoint each write copies a page the template keeps.
const budRewrite = "step += 1\nfor i in range(0, len(h), 4096): h[i] = (step * 7 + i // 4096) % 251\n"

// budState prints what the session holds: its step, and a checksum of its heap.
const budState = "print(step, sum(h[::4096]))\n"

// budCreate creates a sandbox of 512 MiB with the template budget given (raw JSON:
// 0 leaves it out) and a python session "py" holding the heap.
func budCreate(t *testing.T, d *testutil.Daemon, id string, budgetMB int) map[string]any {
	t.Helper()
	body := fmt.Sprintf(`{"id":%q,"memory_mb":512`, id)
	if budgetMB != 0 {
		body += fmt.Sprintf(`,"template_budget_mb":%d`, budgetMB)
	}
	st, raw := dbxRaw(t, d, "POST", "/sandboxes", body+"}")
	if st != 201 {
		t.Fatalf("create %s: %d %s", body, st, raw)
	}
	var info map[string]any
	json.Unmarshal(raw, &info)
	st, raw = dbxRaw(t, d, "POST", "/sandboxes/"+id+"/sessions", `{"name":"py","kind":"python"}`)
	if st != 201 {
		t.Fatalf("session: %d %s", st, raw)
	}
	budPy(t, d, id, budHeap)
	return info
}

// budPy runs code in session py and returns its output; a call the kernel killed (or
// that failed) is reported in ok false with what it answered.
func budPyTry(t *testing.T, d *testutil.Daemon, id, code string) (out string, ok bool) {
	t.Helper()
	st, raw := dbxRaw(t, d, "POST", "/sandboxes/"+id+"/exec", mustJSON(t, api.ExecRequest{Session: "py", Argv: []string{code}, TimeoutMS: 60_000}))
	var res map[string]any
	json.Unmarshal(raw, &res)
	code_, _ := res["exit_code"].(float64)
	if st != 200 || code_ != 0 {
		return string(raw), false
	}
	stdout, _ := res["stdout"].(string)
	return strings.TrimSpace(stdout), true
}

func budPy(t *testing.T, d *testutil.Daemon, id, code string) string {
	t.Helper()
	out, ok := budPyTry(t, d, id, code)
	if !ok {
		t.Fatalf("session call %q in %s: %s", code, id, out)
	}
	return out
}

// budInfo is GET /v1/sandboxes/ID, decoded.
func budInfo(t *testing.T, d *testutil.Daemon, id string) map[string]any {
	t.Helper()
	st, raw := dbxRaw(t, d, "GET", "/sandboxes/"+id, "")
	if st != 200 {
		t.Fatalf("sandbox info: %d %s", st, raw)
	}
	var info map[string]any
	json.Unmarshal(raw, &info)
	return info
}

func budNum(v any, keys ...string) float64 {
	for _, k := range keys {
		m, _ := v.(map[string]any)
		v = m[k]
	}
	f, _ := v.(float64)
	return f
}

// TestTemplateBudgetReproduction is the report's case, with and without a budget.
func TestTemplateBudgetReproduction(t *testing.T) {
	d := testutil.StartDaemonNoImages(t)

	// Without a budget of their own (the behaviour before it): the third rewrite finds
	// the live heap and three templates' 150 MiB each charged to 512 MiB.
	t.Run("no budget: OOM-killed", func(t *testing.T) {
		id := "bud-none"
		budCreate(t, d, id, -1)
		killed := ""
		for i := 0; i < 3 && killed == ""; i++ {
			if s, _, m := wtOp(t, d, id, "", nil); s != 201 {
				t.Fatalf("checkpoint %d: %d %s", i+1, s, m)
			}
			if out, ok := budPyTry(t, d, id, budRewrite); !ok {
				killed = out
			}
		}
		oom := budNum(budInfo(t, d, id), "usage", "oom_kills")
		if killed == "" || oom == 0 {
			t.Fatalf("three checkpoints of a rewritten 150 MiB heap at memory_mb 512 without a template budget: no kill (oom_kills %v); the reproduction no longer reproduces", oom)
		}
		t.Logf("without a budget: %d processes OOM-killed; the call answered %s", int(oom), killed)
	})

	// With the budget (1 GiB, beside memory_mb 512): the kernel limit is their sum and
	// the session survives three checkpoints and three rewrites with its state.
	t.Run("budget: survives", func(t *testing.T) {
		id := "bud-ok"
		budCreate(t, d, id, 1024)
		var nodes []string
		for i := 0; i < 3; i++ {
			s, a, m := wtOp(t, d, id, "", nil)
			if s != 201 {
				t.Fatalf("checkpoint %d: %d %s", i+1, s, m)
			}
			if b := budNum(a, "memory", "template_budget_bytes"); b != 1<<30 {
				t.Fatalf("checkpoint answer's memory.template_budget_bytes %v, want 1 GiB: %v", b, a["memory"])
			}
			// The kernel's limit grows by what the new template may come to hold alone.
			if k, want := budNum(a, "memory", "kernel_limit_bytes"), float64(512<<20+(i+1)*150<<20); k < want || k > want+float64((i+1)*30<<20) {
				t.Fatalf("checkpoint %d: memory.kernel_limit_bytes %v, want 512 MiB + %d x ~155 MiB", i+1, k, i+1)
			}
			nodes = append(nodes, wtNode(t, a))
			budPy(t, d, id, budRewrite)
		}
		if got := budPy(t, d, id, budState); !strings.HasPrefix(got, "3 ") {
			t.Fatalf("session state after three rewrites: %q", got)
		}
		info := budInfo(t, d, id)
		if oom := budNum(info, "usage", "oom_kills"); oom != 0 {
			t.Fatalf("%v processes OOM-killed with a template budget", oom)
		}
		used := budNum(info, "template_budget", "used_bytes")
		if budNum(info, "template_budget", "budget_bytes") != 1<<30 || used < 300<<20 || used > 1<<30 {
			t.Fatalf("template_budget %v: want 1 GiB, three templates holding 300-450 MiB", info["template_budget"])
		}
		if l := budNum(info, "limits", "memory_bytes"); l != 512<<20 {
			t.Fatalf("limits.memory_bytes %v: memory_mb is the live processes' alone", l)
		}
		// Pinning: a hint, shown on the node and counted in the sandbox's stats.
		st, raw := dbxRaw(t, d, "POST", "/nodes/"+nodes[0]+"/pin", `{"pinned":true}`)
		var n map[string]any
		json.Unmarshal(raw, &n)
		if st != 200 || n["pinned"] != true {
			t.Fatalf("pin: %d %s", st, raw)
		}
		info = budInfo(t, d, id)
		if p := budNum(info, "template_budget", "pinned_bytes"); budNum(info, "template_budget", "pinned_nodes") != 1 || p < 140<<20 || p > 200<<20 {
			t.Fatalf("after pinning %s: template_budget %v, want one pinned node of ~150 MiB", nodes[0], info["template_budget"])
		}
		if e := budNum(info, "template_budget", "evictable_bytes"); e != 0 {
			t.Fatalf("evictable_bytes %v without durable images", e)
		}
		if st, raw := dbxRaw(t, d, "POST", "/nodes/"+nodes[0]+"/pin", `{"pinned":false}`); st != 200 || strings.Contains(string(raw), `"pinned"`) {
			t.Fatalf("unpin: %d %s", st, raw)
		}
		s, a, m := wtOp(t, d, id, "", map[string]any{"pin": true})
		if node, _ := a["node"].(map[string]any); s != 201 || node["pinned"] != true {
			t.Fatalf("checkpoint with pin: %d %s %v", s, m, a["node"])
		}
		// A restore is recorded for eviction's order.
		if s, _, m := wtOp(t, d, id, nodes[1], nil); s != 200 {
			t.Fatalf("restore: %d %s", s, m)
		}
		st, raw = dbxRaw(t, d, "GET", "/nodes/"+nodes[1], "")
		if st != 200 || !strings.Contains(string(raw), `"last_restored"`) {
			t.Fatalf("node after its restore: %d %s", st, raw)
		}
	})

	// A small budget: the checkpoint past it waits its wait_ms, then 507 naming the
	// budget; the session is alive and unchanged. A restore and the removal of the node
	// it left make room again.
	t.Run("small budget: 507", func(t *testing.T) {
		id := "bud-small"
		budCreate(t, d, id, 200)
		var nodes []string
		for i := 0; i < 2; i++ {
			s, a, m := wtOp(t, d, id, "", nil)
			if s != 201 {
				t.Fatalf("checkpoint %d (under the budget): %d %s", i+1, s, m)
			}
			nodes = append(nodes, wtNode(t, a))
			budPy(t, d, id, budRewrite)
		}
		before := budPy(t, d, id, budState)
		t0 := time.Now()
		st, raw := dbxRaw(t, d, "POST", "/sandboxes/"+id+"/checkpoint", `{"wait_ms":700}`)
		waited := time.Since(t0)
		if st != 507 {
			t.Fatalf("checkpoint past the budget: %d %s, want 507", st, raw)
		}
		code, msg := dbxErrorBody(t, raw)
		for _, want := range []string{"template_budget_mb 200 MiB", "waited", nodes[0], "tree rm", "larger template_budget_mb"} {
			if !strings.Contains(msg, want) {
				t.Fatalf("507 message %q lacks %q", msg, want)
			}
		}
		if code != "template_budget" || waited < 700*time.Millisecond || waited > 5*time.Second {
			t.Fatalf("507 %s after %v, want code template_budget after its 700 ms wait", code, waited)
		}
		t.Logf("507 after %v: %s", waited.Round(time.Millisecond), msg)
		if after := budPy(t, d, id, budState); after != before {
			t.Fatalf("session after the refused checkpoint: %q, before %q", after, before)
		}
		if n := budNum(budInfo(t, d, id), "stats", "checkpoint_paths", "over_budget"); n != 1 {
			t.Fatalf("stats.checkpoint_paths.over_budget %v, want 1", n)
		}
		if tr, _ := d.C.Tree(dbxCtx(t)); len(tr.Nodes) != 0 {
			for _, n := range tr.Nodes {
				if n.Sandbox == id && n.ID != nodes[0] && n.ID != nodes[1] {
					t.Fatalf("the refused checkpoint made node %s", n.ID)
				}
			}
		}
		// Room again: back to the first node, whose template the live process then
		// shares, and the second node removed.
		if s, _, m := wtOp(t, d, id, nodes[0], nil); s != 200 {
			t.Fatalf("restore: %d %s", s, m)
		}
		klBefore := budNum(budInfo(t, d, id), "template_budget", "kernel_limit_bytes")
		if klBefore != 712<<20 {
			t.Fatalf("kernel limit with two templates of ~155 MiB: %v, want 512 + 200 MiB (the budget)", klBefore)
		}
		if st, raw := dbxRaw(t, d, "DELETE", "/nodes/"+nodes[1], ""); st != 200 {
			t.Fatalf("remove %s: %d %s", nodes[1], st, raw)
		}
		// The kernel limit comes down to memory_mb plus the one template left.
		var after float64
		for t0 := time.Now(); time.Since(t0) < 3*time.Second; time.Sleep(50 * time.Millisecond) {
			if after = budNum(budInfo(t, d, id), "template_budget", "kernel_limit_bytes"); after < klBefore {
				break
			}
		}
		if after < 512<<20+140<<20 || after > 512<<20+180<<20 {
			t.Fatalf("kernel limit after the removal: %v MiB, want 512 + ~155", after/(1<<20))
		}
		if s, _, m := wtOp(t, d, id, "", nil); s != 201 {
			t.Fatalf("checkpoint after making room: %d %s", s, m)
		}
	})
}

// TestTemplateBudgetDefault: a sandbox created without one gets the daemon's default,
// an eighth of the host's RAM, in its record and its answers.
func TestTemplateBudgetDefault(t *testing.T) {
	d := testutil.StartDaemonNoImages(t)
	st, raw := dbxRaw(t, d, "POST", "/sandboxes", `{"id":"bud-def"}`)
	if st != 201 {
		t.Fatalf("create: %d %s", st, raw)
	}
	var info map[string]any
	json.Unmarshal(raw, &info)
	want := float64(cgroup.HostMemoryBytes() / 8 >> 20)
	if got := budNum(info, "template_budget_mb"); got != want {
		t.Fatalf("template_budget_mb %v, want an eighth of RAM, %v MiB", got, want)
	}
	if st, raw := dbxRaw(t, d, "POST", "/sandboxes", `{"id":"bud-bad","template_budget_mb":-2}`); st != 400 || !strings.Contains(string(raw), "template_budget_mb") {
		t.Fatalf("template_budget_mb -2: %d %s", st, raw)
	}
}

// TestTemplateBudgetTotal: the daemon's total counts every sandbox's templates: a
// checkpoint of one sandbox waits for, and is refused over, what another's templates
// hold, and goes once that sandbox is removed.
func TestTemplateBudgetTotal(t *testing.T) {
	t.Setenv("DELTABOX_TEMPLATE_BUDGET_TOTAL", "128M")
	d := testutil.StartDaemonNoImages(t)
	for _, id := range []string{"bud-a", "bud-b"} {
		if st, raw := dbxRaw(t, d, "POST", "/sandboxes", fmt.Sprintf(`{"id":%q,"memory_mb":512,"template_budget_mb":1024}`, id)); st != 201 {
			t.Fatalf("create %s: %d %s", id, st, raw)
		}
		if st, raw := dbxRaw(t, d, "POST", "/sandboxes/"+id+"/sessions", `{"name":"py","kind":"python"}`); st != 201 {
			t.Fatalf("session: %d %s", st, raw)
		}
	}
	// a: one template holding 100 MiB alone.
	budPy(t, d, "bud-a", "h = bytearray(100 << 20)\nstep = 0\nfor i in range(0, len(h), 4096): h[i] = 1\n")
	if s, _, m := wtOp(t, d, "bud-a", "", nil); s != 201 {
		t.Fatalf("checkpoint a: %d %s", s, m)
	}
	budPy(t, d, "bud-a", budRewrite)
	// b: 60 MiB; its first checkpoint fits (its template shares its heap), its second
	// does not: a's 100 and b's 60 are over 128.
	budPy(t, d, "bud-b", "h = bytearray(60 << 20)\nstep = 0\nfor i in range(0, len(h), 4096): h[i] = 1\n")
	s, a, m := wtOp(t, d, "bud-b", "", nil)
	if s != 201 {
		t.Fatalf("checkpoint b: %d %s", s, m)
	}
	if _, ok := a["phases_us"].(map[string]any)["admit"]; !ok {
		t.Fatalf("phases_us has no admit: %v", a["phases_us"])
	}
	budPy(t, d, "bud-b", budRewrite)
	st, raw := dbxRaw(t, d, "POST", "/sandboxes/bud-b/checkpoint", `{"wait_ms":300}`)
	if st != 507 {
		t.Fatalf("checkpoint of b over the total: %d %s", st, raw)
	}
	if _, msg := dbxErrorBody(t, raw); !strings.Contains(msg, "total template budget") || !strings.Contains(msg, "of 128 MiB") {
		t.Fatalf("507 message %q does not name the total", msg)
	}
	info := budInfo(t, d, "bud-b")
	if tot := budNum(info, "template_budget", "total_budget_bytes"); tot != 128<<20 {
		t.Fatalf("total_budget_bytes %v", tot)
	}
	// a goes: room again.
	if st, raw := dbxRaw(t, d, "DELETE", "/sandboxes/bud-a", ""); st != 200 {
		t.Fatalf("remove a: %d %s", st, raw)
	}
	if s, _, m := wtOp(t, d, "bud-b", "", map[string]any{"wait_ms": 3000}); s != 201 {
		t.Fatalf("checkpoint of b once a is gone: %d %s", s, m)
	}
}

// TestTemplateBudgetEvictsNodesWithImages: over its template budget, a checkpoint evicts
// the templates of the least recently restored node whose durable image is complete
// instead of failing with 507; that node then restores its process from the image, with
// the state it had.
func TestTemplateBudgetEvictsNodesWithImages(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "budevict"
	budCreate(t, d, id, 200)
	var nodes []string
	var states []string
	checkpoint := func() {
		t.Helper()
		st, raw := dbxRaw(t, d, "POST", "/sandboxes/"+id+"/checkpoint", `{}`)
		if st != 201 {
			t.Fatalf("checkpoint %d: %d %s", len(nodes)+1, st, raw)
		}
		var a struct {
			Node struct{ ID string } `json:"node"`
		}
		json.Unmarshal(raw, &a)
		nodes = append(nodes, a.Node.ID)
		states = append(states, budPy(t, d, id, budState))
		durWaitImage(t, d, a.Node.ID)
	}
	checkpoint()
	budPy(t, d, id, budRewrite)
	checkpoint()
	budPy(t, d, id, budRewrite)
	// The templates now hold two heaps (300 MiB) of a 200 MiB budget: the third
	// checkpoint evicts the first node's.
	checkpoint()
	n1, err := d.C.Node(dbxCtx(t), nodes[0])
	if err != nil {
		t.Fatal(err)
	}
	if n1.Templates != nil && n1.Templates.Processes > 0 {
		t.Fatalf("node %s still has %d templates over the budget", nodes[0], n1.Templates.Processes)
	}
	res := dbxRestore(t, d, id, nodes[0])
	if !res.FromImage || res.Processes != 1 {
		t.Fatalf("restore of the evicted node: from_image %v, %d processes %v", res.FromImage, res.Processes, res.ProcessErrors)
	}
	if got := budPy(t, d, id, budState); got != states[0] {
		t.Fatalf("the evicted node restored from its image holds %q, want %q", got, states[0])
	}
}

// TestRestoreFromImageMakesRoom: a restore that brings a node's templates back from its
// image first evicts, within the template budget, room for them (they share no page
// with the others): with node 1's templates holding 150 MiB of a 200 MiB budget, the
// restore of node 2 from its image evicts node 1's (it has a complete image), and node
// 1 then restores from its image with its state. Without it, restores from many nodes'
// images kept a template each until the memory cgroup's OOM killer took one.
func TestRestoreFromImageMakesRoom(t *testing.T) {
	d := testutil.StartDaemon(t)
	const id = "budroom"
	budCreate(t, d, id, 200)
	var nodes, states []string
	for i := 0; i < 2; i++ {
		if i > 0 {
			budPy(t, d, id, budRewrite)
		}
		nodes = append(nodes, dbxCheckpoint(t, d, id, fmt.Sprintf("n%d", i+1)).Node.ID)
		states = append(states, budPy(t, d, id, budState))
		durWaitImage(t, d, nodes[i])
	}
	if _, err := d.C.EvictNode(dbxCtx(t), nodes[1]); err != nil {
		t.Fatal(err)
	}
	before, err := d.C.Get(dbxCtx(t), id)
	if err != nil {
		t.Fatal(err)
	}
	res := dbxRestore(t, d, id, nodes[1])
	if !res.FromImage || res.Processes != 1 {
		t.Fatalf("restore of node 2: from_image %v, %d processes %v", res.FromImage, res.Processes, res.ProcessErrors)
	}
	if got := budPy(t, d, id, budState); got != states[1] {
		t.Fatalf("node 2 from its image holds %q, want %q", got, states[1])
	}
	n1, err := d.C.Node(dbxCtx(t), nodes[0])
	if err != nil {
		t.Fatal(err)
	}
	after, err := d.C.Get(dbxCtx(t), id)
	if err != nil {
		t.Fatal(err)
	}
	if n1.Templates != nil && n1.Templates.Processes > 0 {
		t.Fatalf("node 1 keeps %d templates after node 2's 150 MiB came back from its image into a 200 MiB budget", n1.Templates.Processes)
	}
	if after.Stats.EvictedNodes != before.Stats.EvictedNodes+1 {
		t.Fatalf("evicted_nodes went from %d to %d, want one more", before.Stats.EvictedNodes, after.Stats.EvictedNodes)
	}
	res = dbxRestore(t, d, id, nodes[0])
	if !res.FromImage {
		t.Fatal("node 1, evicted for node 2's image, did not restore from its own image")
	}
	if got := budPy(t, d, id, budState); got != states[0] {
		t.Fatalf("node 1 from its image holds %q, want %q", got, states[0])
	}
}
