#!/bin/sh
# One set-up step as one line: `scripts/quietly.sh "installing torch (CPU build)" CMD ARGS...`
# prints "installing torch (CPU build) ... " at once, the seconds so far every 20 s while the
# command runs (a large download is never silent for long), and the seconds it took when it ends.
# What the command prints (pip's progress, its build backend's warnings) goes to a log shown only
# if it fails, with the command's exit status.
what=$1
shift
printf '%s ... ' "$what"
start=$(date +%s)
log=$(mktemp)
"$@" >"$log" 2>&1 &
pid=$!
ticks=0
while kill -0 "$pid" 2>/dev/null; do
  sleep 1
  ticks=$((ticks + 1))
  if [ $((ticks % 20)) -eq 0 ] && kill -0 "$pid" 2>/dev/null; then
    printf '%s s ... ' "$(( $(date +%s) - start ))"
  fi
done
if wait "$pid"; then
  echo "$(( $(date +%s) - start )) s"
  rm -f "$log"
else
  status=$?
  echo "failed (exit $status):"
  cat "$log"
  rm -f "$log"
  exit "$status"
fi
