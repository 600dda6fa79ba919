#!/bin/bash
# CRIU's zdtm static tests: plain CRIU (host flavor) against DeltaBox. See README.md.
#   run.sh CRIU_SRC DELTABOX_BIN DELTABOX_SOCKET [select|plain|deltabox|report|all] [TEST...]
# CRIU_SRC: an extracted CRIU source tree with test/zdtm/lib and test/zdtm/static built.
# Writes to $OUT (default: the current directory). A phase skips tests already in its .tsv
# (delete the file to run them again). CRIU=path overrides /opt/deltabox/criu/sbin/criu.
set -euo pipefail
[ $# -ge 3 ] || { sed -n 2,6p "$0"; exit 2; }
export OUT="${OUT:-$PWD}"
export ZDTM_AS_ROOT="${ZDTM_AS_ROOT:-1}"   # see harness.py: plain CRIU here lacks CAP_SYS_RESOURCE
exec python3 "$(dirname "$0")/harness.py" "$@"
