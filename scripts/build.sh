#!/usr/bin/env bash
# scripts/build.sh [-o OUTPUT] [GO BUILD FLAGS...]: build DeltaBox's one binary
# (default bin/deltabox) with the small sandbox init inside it. The init
# (cmd/deltabox-init) is built first, static (CGO_ENABLED=0: a branch init's exec root
# holds no ELF interpreter), into a temporary directory, and embedded as
# cmd/deltabox/initbin/deltabox-init through a `go build -overlay`: nothing is written
# in the tree, so builds may run in parallel (test packages do, internal/testutil), and
# a plain `go build ./cmd/deltabox` never embeds a stale init (it embeds none, and the
# daemon then runs its own binary as init and logs why). Every script and
# internal/testutil build through this one.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PATH=$PATH:/usr/local/go/bin
out=bin/deltabox
if [ "${1:-}" = "-o" ]; then
	out=$2
	shift 2
fi
tmp=$(mktemp -d "${TMPDIR:-/tmp}/deltabox-build-XXXXXX")
trap 'rm -rf "$tmp"' EXIT
CGO_ENABLED=0 go build -o "$tmp/deltabox-init" ./cmd/deltabox-init
printf '{"Replace": {"%s": "%s"}}\n' "$PWD/cmd/deltabox/initbin/deltabox-init" "$tmp/deltabox-init" >"$tmp/overlay.json"
go build -overlay "$tmp/overlay.json" -o "$out" "$@" ./cmd/deltabox
