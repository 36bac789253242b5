#!/bin/sh
# One set-up step as one line: `scripts/quietly.sh "installing torch (CPU build)" CMD ARGS...`
# prints "installing torch (CPU build) ... " at once and the seconds it took when it ends. What
# the command prints (pip's progress, its build backend's warnings) goes to a log shown only if
# it fails, with the command's exit status.
what=$1
shift
printf '%s ... ' "$what"
start=$(date +%s)
log=$(mktemp)
if "$@" >"$log" 2>&1; then
  echo "$(( $(date +%s) - start )) s"
  rm -f "$log"
else
  status=$?
  echo "failed (exit $status):"
  cat "$log"
  rm -f "$log"
  exit "$status"
fi
