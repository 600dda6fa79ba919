package state

import (
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"

	"deltabox/internal/errdefs"
)

func TestUndoListRunsLastFirstOnce(t *testing.T) {
	var got []int
	var u undoList
	for i := 1; i <= 3; i++ {
		u.push(func() error { got = append(got, i); return nil })
	}
	if err := u.run(); err != nil {
		t.Fatalf("an undo that failed nowhere answered %v", err)
	}
	u.run()
	if want := []int{3, 2, 1}; !reflect.DeepEqual(got, want) {
		t.Fatalf("undo ran %v, want %v", got, want)
	}
	got = nil
	u.push(func() error { got = append(got, 9); return nil })
	u.release()
	u.run()
	if got != nil {
		t.Fatalf("a released list ran %v", got)
	}
}

// An undo step that fails does not stop the others, and what it could not put back
// reaches the operation's error, whose class stays the operation's.
func TestUndoListReportsWhatItCouldNotPutBack(t *testing.T) {
	var u undoList
	ran := 0
	u.push(func() error { ran++; return errors.New("first pushed failed") })
	u.push(func() error { ran++; return nil })
	u.push(func() error { ran++; return errors.New("last pushed failed") })
	uerr := u.run()
	if ran != 3 || uerr == nil || !strings.Contains(uerr.Error(), "first pushed failed") || !strings.Contains(uerr.Error(), "last pushed failed") {
		t.Fatalf("ran %d steps, undo error %v: want all 3 run and both failures named", ran, uerr)
	}
	op := fmt.Errorf("step 4 failed: %w", errdefs.ErrConflict)
	err := withUndo(op, uerr)
	if code, _ := errdefs.HTTPStatus(err); !errors.Is(err, errdefs.ErrConflict) || code != 409 {
		t.Fatalf("the joined error %v lost the operation's class", err)
	}
	if !strings.Contains(err.Error(), "step 4 failed: conflict; undoing it: ") || strings.Contains(err.Error(), "\n") || !strings.Contains(err.Error(), "last pushed failed") {
		t.Fatalf("the joined error %q does not say what the undo could not do", err)
	}
	if withUndo(op, nil) != op {
		t.Fatal("an undo that did everything changed the operation's error")
	}
}
