package state

import (
	"reflect"
	"testing"
)

func TestUndoListRunsLastFirstOnce(t *testing.T) {
	var got []int
	var u undoList
	for i := 1; i <= 3; i++ {
		u.push(func() { got = append(got, i) })
	}
	u.run()
	u.run()
	if want := []int{3, 2, 1}; !reflect.DeepEqual(got, want) {
		t.Fatalf("undo ran %v, want %v", got, want)
	}
	got = nil
	u.push(func() { got = append(got, 9) })
	u.release()
	u.run()
	if got != nil {
		t.Fatalf("a released list ran %v", got)
	}
}
