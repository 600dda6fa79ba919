package state

import (
	"reflect"
	"testing"

	"deltabox/internal/store"
)

// TestForkIDs: ID-0, ID-1, ... for several branches, ID alone for one, generated ones
// ("") without an ID.
func TestForkIDs(t *testing.T) {
	for _, c := range []struct {
		id    string
		count int
		want  []string
	}{
		{"b", 3, []string{"b-0", "b-1", "b-2"}},
		{"b", 1, []string{"b"}},
		{"", 2, []string{"", ""}},
	} {
		if got := forkIDs(c.id, c.count); !reflect.DeepEqual(got, c.want) {
			t.Errorf("forkIDs(%q, %d) = %q, want %q", c.id, c.count, got, c.want)
		}
	}
}

// TestPidsKept: a sandbox may restore from their images the nodes it made, and, as a
// fork's branch, its fork node and that node's ancestors; no other node (a sibling's,
// a descendant of its fork node), whose PIDs its boot did not keep free.
// +checklocksignore: a manager of the test's own, shared with nothing
func TestPidsKept(t *testing.T) {
	m := &Manager{nodes: map[string]*node{}}
	add := func(id, parent, sandbox string) {
		m.nodes[id] = &node{Node: store.Node{ID: id, Parent: parent, Sandbox: sandbox}}
	}
	add("n1", "", "src")
	add("n2", "n1", "src")
	add("n3", "n2", "src") // after the fork node
	add("n4", "n2", "b-1") // a sibling's
	add("n5", "n2", "b-0") // the branch's own
	b := &sb{rec: store.Sandbox{ID: "b-0", ForkOf: "n2"}}
	for node, want := range map[string]bool{"n1": true, "n2": true, "n3": false, "n4": false, "n5": true, "gone": false} {
		if got := m.pidsKept(b, node); got != want {
			t.Errorf("pidsKept(branch, %s) = %v, want %v", node, got, want)
		}
	}
	if src := (&sb{rec: store.Sandbox{ID: "src"}}); !m.pidsKept(src, "n3") || m.pidsKept(src, "n5") {
		t.Errorf("the source: its own nodes only")
	}
}

// TestImageFirst: a fork's node jumps the image queue; the others keep their order.
// +checklocksignore: a manager of the test's own, shared with nothing
func TestImageFirst(t *testing.T) {
	m := &Manager{img: &images{queue: []string{"a", "b", "c", "d"}}}
	m.imageFirst("c")
	m.imageFirst("x") // not queued: nothing changes
	m.imageFirst("c") // already first
	if want := []string{"c", "a", "b", "d"}; !reflect.DeepEqual(m.img.queue, want) {
		t.Fatalf("queue %v, want %v", m.img.queue, want)
	}
}
