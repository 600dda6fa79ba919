#!/usr/bin/env bash
# scripts/demo.sh: the README's first command. Sets the machine up (scripts/setup.sh,
# idempotent), builds bin/deltabox, (re)starts the daemon on the default socket and
# runs the demo: a sandbox is created from the default image, works, is checkpointed,
# changes, and is rolled back, with the latency of each step.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PATH=$PATH:/usr/local/go/bin

bash scripts/setup.sh
bash scripts/start-daemon.sh
D=bin/deltabox

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
ms() { python3 -c 'import json,sys; r=json.load(sys.stdin); print("%s  (%.2f ms in the daemon)" % (r["node"]["id"], r["duration_ms"]))'; }

step "create a sandbox from the default image"
SB=$($D create --name demo-$$)
echo "$SB"
N1=
cleanup() {
	$D rm "$SB" >/dev/null 2>&1 || true
	[ -z "$N1" ] || $D tree rm "$N1" >/dev/null 2>&1 || true
}
trap cleanup EXIT

step "work in it: a git repository in /workspace"
$D exec "$SB" -- bash -c 'git init -q proj && cd proj && printf "def add(a, b):\n    return a + b\n" > calc.py &&
  git -c user.email=demo@deltabox -c user.name=demo add . && git -c user.email=demo@deltabox -c user.name=demo commit -qm init && git log --oneline'

step "checkpoint (files frozen into a layer; nothing is copied)"
N1=$($D checkpoint "$SB" --label "clean repo" --json | ms)
echo "$N1"
N1=${N1%% *}

step "the agent breaks things"
$D exec "$SB" -- bash -c 'cd proj && echo "    return a - b  # bug" >> calc.py && rm -rf .git && dd if=/dev/urandom of=big.bin bs=1M count=64 status=none && ls -la'
N2=$($D checkpoint "$SB" --label "broken" --json | ms)
echo "$N2"

step "roll back to \"clean repo\""
$D restore "$SB" "$N1"
$D exec "$SB" -- bash -c 'cd proj && git status --short && git log --oneline && cat calc.py && ls'

step "the snapshot tree"
$D tree

step "10 restores back and forth, as a tree search would"
N2=${N2%% *}
for i in $(seq 1 5); do
	for n in "$N2" "$N1"; do
		$D restore "$SB" "$n" --json | python3 -c 'import json,sys; r=json.load(sys.stdin); print("restore %s: %.2f ms" % (r["node"]["id"], r["duration_ms"]))'
	done
done
echo
echo "demo done; the daemon keeps running (socket /run/deltabox/deltabox.sock, log /var/log/deltabox.log)"
