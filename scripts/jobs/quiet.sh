#!/usr/bin/env bash
# Run a timing command on a quiet machine: pause (SIGSTOP) the background data jobs of this checkout
# (data.regenerate / data.features) for its duration, continue them (SIGCONT) afterwards, even on failure.
set -uo pipefail
PIDS=$(pgrep -f "draftsmith.data.(regenerate|features)" || true)
[ -n "$PIDS" ] && kill -STOP $PIDS
trap '[ -n "$PIDS" ] && kill -CONT $PIDS' EXIT
"$@"
