package state

import (
	"reflect"
	"strings"
	"testing"
)

// TestAdmissionArrivalOrder checks the queue's policy (op.go): each arrival waits for the
// arrivals of the other kind that came before it, and for nothing that came after.
func TestAdmissionArrivalOrder(t *testing.T) {
	var a admission
	c1 := a.arrive(false, "exec 1")
	a.start(c1)
	c2 := a.arrive(false, "exec 2") // calls do not wait for calls
	a.start(c2)
	op := a.arrive(true, "checkpoint")
	c3 := a.arrive(false, "exec 3")
	op2 := a.arrive(true, "restore")
	for _, tc := range []struct {
		t    uint64
		want []uint64
	}{
		{c1, nil}, {c2, nil},
		{op, []uint64{c1, c2}}, // the calls that came before it
		{c3, []uint64{op}},     // the switch that came before it
		{op2, []uint64{c1, c2, c3}},
	} {
		if got := a.before(tc.t); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("before(%d) = %v, want %v", tc.t, got, tc.want)
		}
	}
	if got := a.running(); !reflect.DeepEqual(got, []uint64{c1, c2}) {
		t.Errorf("running = %v", got)
	}
	if d := a.describe([]uint64{c1, c3}); !strings.Contains(d, "exec 1 (running for") || !strings.Contains(d, "exec 3 (queued") {
		t.Errorf("describe: %q", d)
	}
	ch := a.waitCh()
	a.leave(c1)
	select {
	case <-ch:
	default:
		t.Fatal("leave did not wake the waiters")
	}
	a.leave(c2)
	if got := a.before(op); got != nil {
		t.Errorf("before(op) once the calls left = %v", got)
	}
	a.leave(op)
	if got := a.before(c3); got != nil {
		t.Errorf("before(c3) once the switch left = %v", got)
	}
}
