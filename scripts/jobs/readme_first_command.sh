#!/usr/bin/env bash
# The README's first command as a fresh machine runs it: an empty draftsmith cache (DRAFTSMITH_CACHE in a
# scratch directory: the model converted again, every compiled graph built again), timed from the start of
# install.sh to the end of the bench; the bench's table and the wall time go to results/readme_first_command.md.
# (pip finds the package and its dependencies installed already: the pip part is not what a new machine pays.)
set -euo pipefail
SCRATCH=$(mktemp -d /tmp/draftsmith_fresh.XXXXXX)
trap 'rm -rf "$SCRATCH"' EXIT
OUT=${OUT:-results/readme_first_command.md}  # OUT=... keeps another machine's file
START=$(date +%s)
DRAFTSMITH_CACHE=$SCRATCH bash scripts/install.sh > "$SCRATCH/install.log" 2>&1
AFTER_INSTALL=$(date +%s)
DRAFTSMITH_CACHE=$SCRATCH python -m draftsmith.eval.bench 2>&1 | grep -v "Loading weights" > "$SCRATCH/bench.txt"
END=$(date +%s)
{
  echo "# The README's first command on a fresh cache"
  echo
  echo "\`bash scripts/install.sh && python -m draftsmith.eval.bench\` with an empty \`DRAFTSMITH_CACHE\`"
  echo "(model conversion and every compiled graph built in the run; packages already installed),"
  echo "$(nproc) cores ($(lscpu | sed -n 's/^Model name: *//p'), $(python -c 'from draftsmith.eval.documents import cpu_isa; print(cpu_isa())')), $(date -u +%F)."
  echo "Wall time: install $((AFTER_INSTALL - START)) s, bench $((END - AFTER_INSTALL)) s, total $((END - START)) s."
  echo
  echo '```'
  cat "$SCRATCH/bench.txt"
  echo '```'
} > $OUT
echo "wrote $OUT (total $((END - START)) s)"
