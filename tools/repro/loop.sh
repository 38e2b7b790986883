#!/usr/bin/env bash
# Run tools/repro/ddp_accum_exit.py N times with the given arguments (each run bounded by `timeout`) and tally.
# usage: tools/repro/loop.sh N PYTHON [script args...]
set -u
n=$1; py=$2; shift 2
ok=0; bad=0
for i in $(seq "$n"); do
  out=$(timeout 300 "$py" "$(dirname "$0")/ddp_accum_exit.py" "$@" 2>&1)
  rc=$?
  line=$(printf '%s\n' "$out" | tail -1)
  if [ "$rc" = 0 ]; then ok=$((ok+1)); else bad=$((bad+1)); fi
  echo "run $i rc=$rc $(date -u +%H:%M:%S) $line"
done
echo "TALLY args=[$*] runs=$n ok=$ok not_ok=$bad"
