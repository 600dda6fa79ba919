package durable

import (
	"strings"
	"testing"
)

// TestDumpHint: CRIU's dump errors that a sandbox's process meets get words that say what
// it holds and what to do; others none.
func TestDumpHint(t *testing.T) {
	for msg, want := range map[string]string{
		"criu dump failed (errno 0: Error (criu/sk-inet.c:176): inet: In-flight connection (l) for 4aeddf )":         "not yet accepted",
		"criu dump failed (errno 0: Error (criu/sk-unix.c:874): unix: External socket is used. Consider using --ext": "outside its tree",
		"criu dump failed (errno 0: Error (criu/fsnotify.c:284): fsnotify: \tCan't dump that handle )":               "inotify watch",
		"criu dump failed (errno 0: Error (criu/files.c:1): something else)":                                         "",
	} {
		if got := dumpHint(msg); (want == "") != (got == "") || !strings.Contains(got, want) {
			t.Errorf("dumpHint(%q) = %q, want one naming %q", msg, got, want)
		}
	}
}
