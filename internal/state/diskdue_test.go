package state

import (
	"testing"
	"time"

	"deltabox/internal/store"
)

// TestDiskPassWaitsForFastFork: the watcher's timed pass (a bulkstat of the whole
// filesystem, 18% of the daemon's CPU in a 64-branch fork) waits while a fast fork is
// under way, diskForkWait at most; growth and a short store are passed at once, fork
// or not.
func TestDiskPassWaitsForFastFork(t *testing.T) {
	roomy := int64(store.ReserveBytes) * 4
	cost := 10 * time.Millisecond
	if !diskDue(diskInterval, cost, 0, diskGrowth, roomy, false) {
		t.Fatal("no fork: the pass is not due after its interval")
	}
	if diskDue(diskInterval, cost, 0, diskGrowth, roomy, true) {
		t.Fatal("a fast fork under way: the timed pass runs in it")
	}
	if !diskDue(diskInterval+diskForkWait, cost, 0, diskGrowth, roomy, true) {
		t.Fatalf("a fast fork under way: the pass waits longer than diskForkWait (%v)", diskForkWait)
	}
	if !diskDue(time.Millisecond, cost, diskGrowth, diskGrowth, roomy, true) {
		t.Fatal("the store grew by diskGrowth during a fork: no pass")
	}
	if !diskDue(time.Millisecond, cost, 0, diskGrowth, store.ReserveBytes-1, true) {
		t.Fatal("the store is short during a fork: no pass")
	}
	if diskDue(diskInterval/2, cost, 0, diskGrowth, roomy, false) {
		t.Fatal("a pass before its interval")
	}
}
