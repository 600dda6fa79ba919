package state

import (
	"errors"
	"strings"
	"testing"

	"deltabox/internal/errdefs"
)

// TestCRIURefusalLeads: a 409 of a tree neither path takes gives CRIU's reason first,
// then the fast path's (which was most often only shared anonymous memory, and came
// first).
func TestCRIURefusalLeads(t *testing.T) {
	for _, sessions := range []bool{false, true} {
		err := criuRefusal("process 3 cannot be checkpointed with its state: it has shared anonymous memory", "process 3 (x): it holds the thing", sessions)
		if !errors.Is(err, errdefs.ErrConflict) || !strings.HasPrefix(err.Error(), "process 3 (x): it holds the thing (end ") ||
			!strings.Contains(err.Error(), "; nor can the fast path take it: process 3 cannot be checkpointed with its state: it has shared anonymous memory") {
			t.Errorf("sessions %v: %v", sessions, err)
		}
	}
}
