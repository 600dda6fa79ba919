#!/usr/bin/env bash
# scripts/demo.sh: the README's first command. Sets the machine up (scripts/setup.sh,
# idempotent), builds bin/deltabox, (re)starts the daemon on the default socket and
# runs the demo: a sandbox holds a git repository and a live python session with data
# in memory; a checkpoint freezes both, the agent breaks both, a restore brings both
# back, with the latency of each step beside what the same takes without DeltaBox
# (copying the workspace, replaying the session's code); then what to do next.
#
# With DELTABOX_SOCKET set, the demo uses the daemon already listening there (started
# with its own --root) and neither sets the machine up nor (re)starts a daemon.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PATH=$PATH:/usr/local/go/bin

if [ -n "${DELTABOX_SOCKET:-}" ]; then
	bash scripts/build.sh
	bin/deltabox ls >/dev/null # fails clearly if no daemon answers there
else
	bash scripts/setup.sh
	bash scripts/start-daemon.sh
fi
D=bin/deltabox

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
# op: one line from a checkpoint's or restore's JSON answer (stdin).
op() {
	python3 -c '
import json, sys
r = json.load(sys.stdin)
m = r.get("memory") or {}
line = "%-10s %s  %6.2f ms in the daemon" % (sys.argv[1], r["node"]["id"], r["duration_ms"])
if r.get("processes"):
    line += "  (%d process%s: session %s)" % (r["processes"], "" if r["processes"] == 1 else "es", ", ".join(r.get("sessions") or []))
else:
    line += "  (files only)"
if m.get("node_templates_rss_bytes"):
    line += "; its template: %d MiB resident of the %d MiB limit" % (m["node_templates_rss_bytes"] >> 20, m["limit_bytes"] >> 20)
print(line)
for w in r.get("warnings") or []:
    print("warning:", w)
' "$1"
}
# took: "N ms" of an exec's JSON answer (stdin), as measured by the daemon.
took() { python3 -c 'import json,sys; r=json.load(sys.stdin); assert r["exit_code"] == 0, r; print("%.1f ms" % r["duration_ms"])'; }
py() { $D exec "$SB" --session py -- "$1"; }

step "create a sandbox from the default image, with a python session"
SB=$($D create --name demo-$$)
echo "$SB"
N1=
cleanup() {
	$D rm "$SB" >/dev/null 2>&1 || true
	[ -z "$N1" ] || $D tree rm "$N1" >/dev/null 2>&1 || true
}
trap cleanup EXIT
$D session start "$SB" py --python >/dev/null

step "work in it: a git repository in /workspace, and objects in the python session"
$D exec "$SB" -- bash -c 'git init -q proj && cd proj && printf "def add(a, b):\n    return a + b\n" > calc.py &&
  git -c user.email=demo@deltabox -c user.name=demo add . && git -c user.email=demo@deltabox -c user.name=demo commit -qm init && git log --oneline'
SETUP='import hashlib, random
random.seed(7)
model = {"step": 3, "weights": [random.random() for _ in range(200_000)]}   # an agent'"'"'s state
cache = {i: hashlib.sha256(str(i).encode()).hexdigest() for i in range(100_000)}
print("model step %d, %d weights, %d cache entries" % (model["step"], len(model["weights"]), len(cache)))'
py "$SETUP"

step "checkpoint: the files and the python process, together (nothing is copied)"
N1=$($D checkpoint "$SB" --label "clean" --json | op checkpoint)
echo "$N1"
N1=$(awk '{print $2}' <<<"$N1")

step "the agent breaks both"
py 'model["step"] = 99; model["weights"].clear(); cache.clear(); print("model step %d, %d weights, %d cache entries" % (model["step"], len(model["weights"]), len(cache)))'
$D exec "$SB" -- bash -c 'cd proj && echo "    return a - b  # bug" >> calc.py && rm -rf .git && dd if=/dev/urandom of=big.bin bs=1M count=64 status=none && ls'
N2=$($D checkpoint "$SB" --label "broken" --json | op checkpoint)
echo "$N2"
N2=$(awk '{print $2}' <<<"$N2")

step "restore \"clean\": the objects and the files come back together"
$D restore "$SB" "$N1" --json | op restore
py 'print("model step %d, %d weights, %d cache entries" % (model["step"], len(model["weights"]), len(cache)))'
$D exec "$SB" -- bash -c 'cd proj && git log --oneline && cat calc.py && ls'

step "the same without DeltaBox (no CRIU): copy the workspace, replay the session's code"
echo "copy /workspace (cp -a):            $($D exec "$SB" --json -- cp -a /workspace /tmp/workspace-copy | took)"
$D session start "$SB" replay --python >/dev/null
echo "replay the python session's code:   $($D exec "$SB" --json --session replay -- "$SETUP" | took)"
echo "(and a copy or a replay grows with the workspace and the agent's history; a checkpoint does not)"

step "10 restores back and forth, as a tree search would"
for i in $(seq 1 5); do
	for n in "$N2" "$N1"; do
		$D restore "$SB" "$n" --json | op restore
	done
done

step "the snapshot tree"
$D tree

step "next: the same from Python (stdlib only; pip install ./clients/python)"
SNIPPET='from deltabox import Sandbox

with Sandbox.create(remove_nodes=True) as sb:        # removed at the end, its nodes too
    sb.sessions.start("py", kind="python")
    sb.run("data = list(range(10)); open(\"notes.txt\", \"w\").write(\"v1\")", session="py")
    ckpt = sb.checkpoint(label="v1")                  # waits for running commands (5 s)
    sb.run("data.clear(); open(\"notes.txt\", \"w\").write(\"broken\")", session="py")
    sb.restore(ckpt)
    print(sb.run("len(data), open(\"notes.txt\").read()", session="py").stdout.strip())   # (10, '"'"'v1'"'"')
    print("checkpoint %.2f ms, template %d MiB" % (ckpt.duration * 1000, ckpt.memory.node_templates_rss_bytes >> 20))'
sed 's/^/    /' <<<"$SNIPPET"
echo "which prints:"
PYTHONPATH=clients/python DELTABOX_SOCKET=${DELTABOX_SOCKET:-/run/deltabox/deltabox.sock} python3 -c "$SNIPPET" | sed 's/^/    /'
cat <<'EOF'

Then the examples (README "Python and examples"), each on a real repository:
    python3 examples/mcts.py         # tree search: expand, test, roll back
    python3 examples/best_of_n.py    # N sandboxes forked from one checkpoint
    python3 examples/rl_fanout.py    # N rollouts from one state, repeated
The API: docs/API.md; how it works: docs/DESIGN.md.
EOF
echo
echo "demo done; the daemon keeps running (socket ${DELTABOX_SOCKET:-/run/deltabox/deltabox.sock})"
