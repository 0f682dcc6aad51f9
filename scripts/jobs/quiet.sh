#!/usr/bin/env bash
# Run a timing command on a quiet machine: pause (SIGSTOP) the background data jobs of this checkout
# (data.regenerate and its llama-server / data.features / every train recipe) for its duration, including
# ones a job script starts while the command runs (checked every 2 s), and continue them (SIGCONT) afterwards,
# even on failure or when this script is killed (TERM/INT/HUP). The command's own processes are never paused,
# so it may itself be a training or data job (a step-time measurement).
set -uo pipefail
PATTERN="draftsmith.data.(regenerate|features)|train/[a-z_]+\.py|llama.cpp/[^ ]*/llama-server"
STOPPED=$(mktemp)
ME=$$
is_mine() {  # pid descends from this script
  local pid=$1
  while [ -n "$pid" ] && [ "$pid" -gt 1 ]; do
    [ "$pid" = "$ME" ] && return 0
    pid=$(ps -o ppid= -p "$pid" 2>/dev/null | tr -d ' ')
  done
  return 1
}
pause_all() {
  for pid in $(pgrep -f "$PATTERN"); do
    is_mine "$pid" || { kill -STOP "$pid" 2>/dev/null && echo "$pid" >> "$STOPPED"; }
  done
}
resume_all() {
  kill "$WATCHER" 2>/dev/null
  wait "$WATCHER" 2>/dev/null
  for pid in $(sort -u "$STOPPED"); do kill -CONT "$pid" 2>/dev/null; done
  rm -f "$STOPPED"
}
pause_all
( while sleep 2; do pause_all; done ) &
WATCHER=$!
trap resume_all EXIT
"$@" &  # waited for in the background: a signal to this script is handled at once, not after the command
CHILD=$!
trap 'kill -TERM "$CHILD" 2>/dev/null; exit 143' TERM HUP
trap 'kill -INT "$CHILD" 2>/dev/null; exit 130' INT
wait "$CHILD"
