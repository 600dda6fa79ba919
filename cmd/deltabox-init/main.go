// Command deltabox-init is the sandbox init alone (sbinit.Main). Built static
// (CGO_ENABLED=0) and embedded in the daemon's binary by scripts/build.sh, it is what
// every sandbox init runs, from a sealed memfd (sbinit.InitBinary): a sandbox's, which
// the daemon starts, and a fast fork's branch inits, which the family init execs. It
// links only the init's packages: its exec and Go start take 1.5 ms of CPU and 3 MB of
// RSS, where the daemon's 36 MB binary, whose 205 packages all initialise before main,
// takes 7 ms and 18 MB (docs/design/fork.md, Figures). A daemon built without it execs
// its own binary.
package main

import (
	"fmt"
	"os"

	"deltabox/internal/sbinit"
)

func main() {
	if len(os.Args) > 2 && os.Args[1] == sbinit.InitArg {
		sbinit.Main(os.Args[2])
		return
	}
	fmt.Fprintln(os.Stderr, "deltabox-init: the sandbox init; the deltabox daemon runs it (deltabox daemon)")
	os.Exit(2)
}
