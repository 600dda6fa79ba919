// Package skip decides what a test that cannot run does: skip with the reason, or, with
// CI=true, fail, so that CI cannot pass with privileged tests silently skipped. It has no
// dependencies, so that low-level packages' tests can use it without import cycles.
package skip

import (
	"fmt"
	"os"
	"testing"
)

// Require skips t with reason unless ok; under CI=true it fails instead.
func Require(t testing.TB, ok bool, reason string, args ...any) {
	t.Helper()
	if ok {
		return
	}
	msg := fmt.Sprintf(reason, args...)
	if os.Getenv("CI") == "true" {
		t.Fatalf("cannot run (and CI=true forbids skipping): %s", msg)
	}
	t.Skip(msg)
}
