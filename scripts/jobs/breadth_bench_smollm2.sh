#!/usr/bin/env bash
# The held-out breadth bench (eval/configs/breadth_bench_smollm2.yaml: translation, summarization, extraction, QA
# over a given text, never trained on; the goal bench's settings) with other jobs paused while it times.
# POINT=<a drafter directory> measures that drafter (a chain of 3, alone and after lookup) instead of the bundled one;
# BESIDE=<another drafter> adds it alone to the same run, for a side-by-side comparison.
#   POINT=drafters/eagle3_smollm2_human/loss_tokens_10000000 bash scripts/jobs/breadth_bench_smollm2.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-results/breadth_smollm2}
TREE=depth=3,topk=1,budget=3  # the config's tree (a chain of 3)
ARGS=()
if [ -n "${POINT:-}${BESIDE:-}" ]; then
  DRAFTER=dgf:${POINT:+path=$POINT,}$TREE
  ARGS+=("methods=ngram ${BESIDE:+dgf:path=$BESIDE,$TREE} $DRAFTER cascade:drafters=[(ngram:min_n=2),($DRAFTER)]")
fi
scripts/jobs/quiet.sh python -m draftsmith.eval.bench --config eval/configs/breadth_bench_smollm2.yaml threads=2 \
  "${ARGS[@]}" output_dir="$OUT"
