//go:build !testhooks

package state

import (
	"log/slog"
	"os"
)

// crashAtFromEnv: a daemon built without -tags testhooks has no crash points
// (crashpoint_testhooks.go), and says so to whoever sets DELTABOX_CRASH_AT.
func crashAtFromEnv(log *slog.Logger) string {
	if os.Getenv("DELTABOX_CRASH_AT") != "" {
		log.Warn("DELTABOX_CRASH_AT is ignored: crash points are a test hook, in a daemon built with -tags testhooks only")
	}
	return ""
}
