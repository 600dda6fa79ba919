#!/usr/bin/env bash
# scripts/test.sh: the README's second command. Sets the machine up (idempotent), checks
# formatting, vet and the Python code's types, and runs the whole test suite as root.
# Tests mount, fork, ptrace and run CRIU for real; with CI=true a test that cannot run
# fails instead of skipping.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PATH=$PATH:/usr/local/go/bin
[ "$(id -u)" = 0 ] || { echo "run as root: the tests mount, make namespaces and ptrace" >&2; exit 1; }

bash scripts/setup.sh
unformatted=$(gofmt -l $(git ls-files '*.go'))
if [ -n "$unformatted" ]; then
	echo "gofmt would change: $unformatted" >&2
	exit 1
fi
go vet ./...
go vet -tags testhooks ./internal/state
# Guarded fields (// +checklocks:mu) are only touched with their lock held: gVisor's
# checklocks analyzer, from the Go module proxy (a pseudo-version: gVisor's go branch
# has no tags). -wrappers=false drops the findings that carry no position (the implicit
# returns of closures called under a lock, reported as returning with it held), as
# gVisor's own configuration does (internal/state/doc.go: Locking).
GOBIN="$(go env GOPATH)/bin" go install gvisor.dev/gvisor/tools/checklocks/cmd/checklocks@v0.0.0-20260905035102-160fafc42237
go vet -vettool="$(go env GOPATH)/bin/checklocks" -wrappers=false ./...
go vet -vettool="$(go env GOPATH)/bin/checklocks" -wrappers=false -tags testhooks ./internal/state
# No error dropped unsaid in the packages that undo and clean up: errcheck (from the Go
# module proxy) on their non-test code; an error ignored on purpose is written `_ =` with
# its reason beside it, and scripts/errcheck.excludes lists the calls never checked.
GOBIN="$(go env GOPATH)/bin" go install github.com/kisielk/errcheck@v1.30.0
"$(go env GOPATH)/bin/errcheck" -ignoretests -exclude scripts/errcheck.excludes \
	./internal/state ./internal/fastpath ./internal/durable ./internal/store \
	./internal/sandbox ./internal/session ./internal/api ./internal/files
# No code only tests reach, or none at all: deadcode (golang.org/x/tools, from the Go
# module proxy) with every test binary as a root lists nothing.
dead=$(go run golang.org/x/tools/cmd/deadcode@v0.52.0 -test ./...)
if [ -n "$dead" ]; then
	echo "deadcode: unreachable functions:" >&2
	echo "$dead" >&2
	exit 1
fi
# The Python client type-checks strictly, the examples and the workload plainly, for the
# oldest Python the client supports (mypy is Debian's, installed by setup.sh).
mypy --strict --python-version 3.9 clients/python/deltabox
MYPYPATH=clients/python mypy --python-version 3.9 examples workload
go test -count=1 -timeout 60m "$@" ./...
