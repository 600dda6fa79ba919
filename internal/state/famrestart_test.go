package state

import (
	"reflect"
	"testing"

	"deltabox/internal/store"
)

// TestLoadFamilies: the records' families are grouped by id, and a family is made as
// soon as any member's record says so (the fork writes them made in one transaction;
// members removed since leave the others' records as they were).
func TestLoadFamilies(t *testing.T) {
	ref := func(id string, made bool) *store.FamilyRef {
		return &store.FamilyRef{ID: id, Source: "src-" + id, Holder: store.InitRef{Pid: 7, Start: 9}, Made: made}
	}
	fams := loadFamilies([]store.Sandbox{
		{ID: "plain"},
		{ID: "a0", Family: ref("a", false)},
		{ID: "a1", Family: ref("a", true)},
		{ID: "b0", Family: ref("b", false)},
		{ID: "b1", Family: ref("b", false)},
	})
	if len(fams) != 2 {
		t.Fatalf("%d families, want 2: %v", len(fams), fams)
	}
	if a := fams["a"]; !a.made || !reflect.DeepEqual(a.members, []string{"a0", "a1"}) || a.ref.Source != "src-a" {
		t.Fatalf("family a: %+v", a)
	}
	if b := fams["b"]; b.made || !reflect.DeepEqual(b.members, []string{"b0", "b1"}) {
		t.Fatalf("family b (cut): %+v", b)
	}
}
