#!/usr/bin/env bash
# Run a timing command on a quiet machine: pause (SIGSTOP) the background data jobs of this checkout
# (data.regenerate / data.features / train recipes) for its duration, including ones a job script starts
# while the command runs (checked every 2 s), and continue them (SIGCONT) afterwards, even on failure.
set -uo pipefail
PATTERN="draftsmith.data.(regenerate|features)|train/(dgf|medusa|distill).py"
STOPPED=$(mktemp)
pause_all() { for pid in $(pgrep -f "$PATTERN"); do kill -STOP "$pid" 2>/dev/null && echo "$pid" >> "$STOPPED"; done; }
pause_all
( while sleep 2; do pause_all; done ) &
WATCHER=$!
trap 'kill $WATCHER 2>/dev/null; for pid in $(sort -u "$STOPPED"); do kill -CONT "$pid" 2>/dev/null; done; rm -f "$STOPPED"' EXIT
"$@"
