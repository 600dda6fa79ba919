#!/usr/bin/env bash
# scripts/start-daemon.sh: build bin/deltabox (scripts/build.sh) and (re)start the daemon on the default
# socket, in the background, logging to /var/log/deltabox.log.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PATH=$PATH:/usr/local/go/bin
bash scripts/build.sh
PIDFILE=/run/deltabox/daemon.pid
mkdir -p /run/deltabox
if [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
	kill "$(cat "$PIDFILE")"
	for _ in $(seq 1 100); do kill -0 "$(cat "$PIDFILE")" 2>/dev/null || break; sleep 0.1; done
fi
nohup bin/deltabox daemon >>/var/log/deltabox.log 2>&1 &
echo $! >"$PIDFILE"
for _ in $(seq 1 100); do
	if bin/deltabox ls >/dev/null 2>&1; then
		echo "daemon running (pid $(cat "$PIDFILE"), log /var/log/deltabox.log)"
		exit 0
	fi
	sleep 0.1
done
echo "the daemon did not start; last lines of /var/log/deltabox.log:" >&2
tail -20 /var/log/deltabox.log >&2
exit 1
