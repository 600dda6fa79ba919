package main

import (
	"strings"
	"testing"

	"deltabox/internal/sbinit"
)

// TestPlainBuildCarriesNoInit: built without scripts/build.sh (as `go test` builds this
// package), the binary carries no small init, and the daemon's inits then run its own
// binary, with the reason naming the build to use.
func TestPlainBuildCarriesNoInit(t *testing.T) {
	if _, err := initBin.ReadFile("initbin/" + sbinit.InitBinaryName); err == nil {
		t.Fatalf("initbin/%s is embedded by a plain build: a stale file in cmd/deltabox/initbin?", sbinit.InitBinaryName)
	}
	useEmbeddedInit()
	if path, why := sbinit.InitBinary(); path != "/proc/self/exe" || !strings.Contains(why, "scripts/build.sh") {
		t.Errorf("a plain build's init: %s (%s), want /proc/self/exe and how to build it", path, why)
	}
}
