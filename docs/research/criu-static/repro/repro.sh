#!/bin/bash
# repro.sh PROGRAM.py [CHECK]: in a new sandbox, start PROGRAM in the background, run CHECK
# (a shell command in the sandbox), checkpoint, CHECK, restore to that node, CHECK; then
# remove the sandbox and the node. DELTABOX (default bin/deltabox) and DELTABOX_SOCKET as for the CLI.
# The programs and what to CHECK for each: README.md in the directory above.
set -u
D=${DELTABOX:-bin/deltabox}
n=repro-$$
check=${2:-'ps -e -o pid,stat,comm | grep python3 || echo "no python3 left"'}
$D create --name $n >/dev/null
$D exec $n -- mkdir -p /workspace/d
$D exec -i $n -- sh -c 'cat > /workspace/r.py' < "$1"
$D exec $n -- bash -c 'nohup python3 /workspace/r.py >/workspace/r.log 2>&1 </dev/null & sleep 1'
echo "== before"; $D exec $n -- sh -c "$check"
if node=$($D checkpoint $n 2>&1); then
    echo "== checkpoint: $node"; $D exec $n -- sh -c "$check"
    $D restore $n $node >/dev/null && echo "== restored to $node"; $D exec $n -- sh -c "$check"
else
    echo "== checkpoint failed: $node"; $D exec $n -- sh -c "$check"; node=
fi
$D rm $n >/dev/null; [ -n "$node" ] && $D tree rm $node >/dev/null
