package main

import (
	"embed"

	"deltabox/internal/sbinit"
)

// initBin holds the small sandbox init (cmd/deltabox-init, static, 4 MB) when
// scripts/build.sh built this binary: every sandbox init execs it from a sealed memfd
// (sbinit.InitBinary), whose exec and Go start take 2.7 ms and 3.7 MB RSS where this
// 36 MB binary's take 34.6 ms and 18 MB (docs/design/fork.md). The directory's README
// makes the pattern match without it.
//
//go:embed initbin
var initBin embed.FS

// useEmbeddedInit hands the small init, if this binary carries it, to sbinit.
func useEmbeddedInit() {
	b, err := initBin.ReadFile("initbin/" + sbinit.InitBinaryName)
	if err != nil {
		sbinit.UseInit(nil, "this binary carries no small init: build it with scripts/build.sh, not a plain go build")
		return
	}
	sbinit.UseInit(b, "")
}
