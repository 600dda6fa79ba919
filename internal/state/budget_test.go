package state

import (
	"context"
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"deltabox/internal/errdefs"
	"deltabox/internal/store"
)

// TestBudgetCheckOver: a checkpoint waits while its sandbox's templates are over their
// budget or every sandbox's over the total, and the refusal is a 507 that names the
// budget, the usage and what to do.
func TestBudgetCheckOver(t *testing.T) {
	for _, tc := range []struct {
		name string
		c    budgetCheck
		want string // "" (admitted) or a part of the reason
	}{
		{"under", budgetCheck{sandbox: "a", budget: 200 << 20, used: 150 << 20, total: 1 << 30, totalUsed: 500 << 20}, ""},
		{"at the budget", budgetCheck{sandbox: "a", budget: 200 << 20, used: 200 << 20, total: 1 << 30, totalUsed: 200 << 20}, ""},
		{"sandbox over", budgetCheck{sandbox: "a", budget: 200 << 20, used: 300 << 20, total: 1 << 30, totalUsed: 300 << 20}, "sandbox a's template budget: its checkpoints' templates hold 300 MiB of template_budget_mb 200 MiB"},
		{"total over", budgetCheck{sandbox: "a", budget: 200 << 20, used: 100 << 20, total: 1 << 30, totalUsed: 1100 << 20}, "total template budget: the templates of every sandbox hold 1100 MiB of 1024 MiB"},
		{"no budget of its own", budgetCheck{sandbox: "a", budget: -1, used: 900 << 20, total: 1 << 30, totalUsed: 900 << 20}, ""},
		{"no budget, total over", budgetCheck{sandbox: "a", budget: -1, used: 1100 << 20, total: 1 << 30, totalUsed: 1100 << 20}, "DELTABOX_TEMPLATE_BUDGET_TOTAL"},
	} {
		got := tc.c.over()
		if (tc.want == "") != (got == "") || !strings.Contains(got, tc.want) {
			t.Errorf("%s: over() = %q, want %q", tc.name, got, tc.want)
		}
	}
	c := budgetCheck{sandbox: "a", budget: 200 << 20, used: 300 << 20, total: 1 << 30, totalUsed: 300 << 20, pinned: 150 << 20, nodesInSbox: 2, topNodes: ": n1 150 MiB, n2 150 MiB"}
	err := c.refusal(time.Second)
	if status, code := errdefs.HTTPStatus(err); status != 507 || code != "template_budget" || !errors.Is(err, errdefs.ErrQuota) {
		t.Fatalf("refusal %v: status %d %s, want 507 template_budget (an ErrQuota)", err, status, code)
	}
	for _, want := range []string{"waited 1s", "300 MiB of template_budget_mb 200 MiB", "n1 150 MiB", "150 MiB of it pinned", "tree rm", "larger template_budget_mb"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("refusal %q lacks %q", err, want)
		}
	}
}

// overFor is a check that is over budget for its first n calls, then has room.
func overFor(n int, calls *int) func(bool) budgetCheck {
	return func(bool) budgetCheck {
		*calls++
		c := budgetCheck{sandbox: "a", budget: 100, used: 50, total: 1000, totalUsed: 50}
		if *calls <= n {
			c.used, c.totalUsed = 150, 150
		}
		return c
	}
}

// TestWaitForRoom: admitted at once with room; admitted once room appears (a node
// removed meanwhile); refused with 507 after its deadline, not before; at once when
// eviction makes room; abandoned with its caller.
func TestWaitForRoom(t *testing.T) {
	ctx := context.Background()
	var calls int
	t0 := time.Now()
	if err := waitForRoom(ctx, t0.Add(time.Second), overFor(0, &calls), nil); err != nil || calls != 1 || time.Since(t0) > 50*time.Millisecond {
		t.Fatalf("room at once: %v after %d checks, %v", err, calls, time.Since(t0))
	}

	calls = 0
	t0 = time.Now()
	if err := waitForRoom(ctx, t0.Add(5*time.Second), overFor(2, &calls), nil); err != nil || calls != 3 {
		t.Fatalf("room after two polls: %v after %d checks", err, calls)
	}
	if d := time.Since(t0); d < budgetPoll || d > 3*budgetPoll+100*time.Millisecond {
		t.Fatalf("room after two polls took %v (poll %v)", d, budgetPoll)
	}

	calls = 0
	t0 = time.Now()
	err := waitForRoom(ctx, t0.Add(350*time.Millisecond), overFor(1<<30, &calls), nil)
	d := time.Since(t0)
	if !errors.Is(err, errdefs.ErrTemplateBudget) || d < 350*time.Millisecond || d > 600*time.Millisecond {
		t.Fatalf("never room: %v after %v, want the 507 after 350 ms", err, d)
	}
	if !strings.Contains(err.Error(), "template_budget_mb") {
		t.Fatalf("refusal %q does not name the budget", err)
	}

	calls = 0
	evicted := 0
	t0 = time.Now()
	evict := func(c budgetCheck) bool { evicted++; calls = 1 << 30; return true } // room from now on
	err = waitForRoom(ctx, t0.Add(time.Second), func(f bool) budgetCheck {
		c := budgetCheck{sandbox: "a", budget: 100, used: 150, totalUsed: 150}
		if calls == 1<<30 {
			c.used = 50
		}
		return c
	}, evict)
	if err != nil || evicted != 1 || time.Since(t0) > 50*time.Millisecond {
		t.Fatalf("eviction made room: %v, %d evictions, after %v", err, evicted, time.Since(t0))
	}

	cctx, cancel := context.WithTimeout(ctx, 150*time.Millisecond)
	defer cancel()
	calls = 0
	t0 = time.Now()
	err = waitForRoom(cctx, t0.Add(10*time.Second), overFor(1<<30, &calls), nil)
	if err == nil || errors.Is(err, errdefs.ErrTemplateBudget) || !errors.Is(err, context.DeadlineExceeded) || time.Since(t0) > time.Second {
		t.Fatalf("abandoned: %v after %v", err, time.Since(t0))
	}
}

// TestEvictionOrder: the nodes whose templates may go over budget are the unpinned ones
// with a complete image, least recently restored (or made) first; none without the
// image hook (durable images do not exist yet).
func TestEvictionOrder(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	m := &Manager{nodes: map[string]*node{}, templates: map[string][]*procTemplate{}}
	m.mu.Lock() // evictionOrder's precondition
	defer m.mu.Unlock()
	s := &sb{rec: store.Sandbox{ID: "a"}}
	add := func(id string, created time.Duration, restored time.Duration, pinned bool, sandbox string) {
		n := &node{Node: store.Node{ID: id, Created: t0.Add(created)}, pinned: pinned}
		if restored > 0 {
			n.lastRestore = t0.Add(restored)
		}
		m.nodes[id] = n
		m.templates[id] = []*procTemplate{{sandbox: sandbox}}
	}
	add("n1", 1*time.Second, 9*time.Second, false, "a") // restored last
	add("n2", 2*time.Second, 0, false, "a")             // never restored: made at 2 s
	add("n3", 3*time.Second, 5*time.Second, false, "a")
	add("n4", 4*time.Second, 0, true, "a") // pinned
	add("n5", 0, 0, false, "b")            // another sandbox's
	add("n6", 0, 0, false, "a")            // no image
	if got := m.evictionOrder(s); len(got) != 0 {
		t.Fatalf("without images: %v, want none", got)
	}
	m.imageDone = func(n string) bool { return n != "n6" }
	if got, want := m.evictionOrder(s), []string{"n2", "n3", "n1"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("eviction order %v, want %v", got, want)
	}
}
