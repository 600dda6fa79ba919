//go:build testhooks

package state

import (
	"log/slog"
	"os"
)

// crashAtFromEnv reads DELTABOX_CRASH_AT ("checkpoint:K", "restore:K", "image:K"): the
// daemon kills itself with SIGKILL just before step K of that operation (K one past the
// last: after the last step, before the answer), to test what the next daemon makes of
// an operation cut there (tests/e2e/restart_test.go). A node's image (durable.go:
// dumpNode) has three steps per template (its dump, its pages' ingest, what follows) and
// the complete mark: image:1 is before the first template's dump, image:2 before its
// ingest, image:3 after it, image:3N+1 after the mark.
//
// Only a daemon built with -tags testhooks has this hook (testutil.Binary builds the
// e2e tests' daemon so): a kill switch in the environment has no place in the daemon
// people run, and the e2e tests need it in a real daemon binary, killed as kill -9
// would, which a test inside the state package cannot be.
func crashAtFromEnv(log *slog.Logger) string {
	at := os.Getenv("DELTABOX_CRASH_AT")
	if at != "" {
		log.Warn("DELTABOX_CRASH_AT: this daemon kills itself at that step (a test hook)", "at", at)
	}
	return at
}
