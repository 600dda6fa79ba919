#!/bin/bash
# lazy vs eager CRIU restore of a host python with MB MiB heap: time until its first answer.
set -u
MB=$1; N=${2:-5}
CRIU=/opt/deltabox/criu/sbin/criu
export CRIU_FAULT=130
D=/dev/shm/lazyimg
mkdir -p /tmp/lazy; rm -rf $D /tmp/lazy/ready /tmp/lazy/answer; mkdir -p $D
setsid python3 "$(dirname "$0")"/lazy-restore-prog.py $MB </dev/null >/dev/null 2>&1 &
for i in $(seq 600); do [ -s /tmp/lazy/ready ] && break; sleep 0.05; done
PID=$(cat /tmp/lazy/ready)
$CRIU dump -t $PID -D $D -o dump.log || { echo dump failed; tail $D/dump.log; exit 1; }
answer() { rm -f /tmp/lazy/answer; kill -USR1 $PID; for i in $(seq 100000); do [ -s /tmp/lazy/answer ] && return 0; sleep 0.001; done; return 1; }
now() { date +%s%N; }
for mode in eager lazy; do
  for i in $(seq $N); do
    t0=$(now)
    if [ $mode = eager ]; then
      $CRIU restore -D $D -d -o restore.log || { echo restore failed; tail $D/restore.log; exit 1; }
    else
      $CRIU lazy-pages -D $D -o lazy.log &
      LP=$!
      sleep 0.05
      t0=$(now)
      $CRIU restore -D $D -d --lazy-pages -o restore.log || { echo lazy restore failed; tail $D/restore.log $D/lazy.log; kill $LP; exit 1; }
    fi
    t1=$(now)
    answer || { echo no answer; exit 1; }
    t2=$(now)
    echo "$mode $MB MiB: restore returned $(( (t1-t0)/1000000 )) ms, first answer $(( (t2-t0)/1000000 )) ms"
    kill -9 $PID; while kill -0 $PID 2>/dev/null; do sleep 0.01; done
    [ $mode = lazy ] && wait $LP 2>/dev/null
  done
done
