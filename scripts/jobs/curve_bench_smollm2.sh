#!/usr/bin/env bash
# Issue 32's curve, measured: every committed point of a curve run (drafters/<run>/loss_tokens_<N>/) through the
# bundled decoder on the goal bench's prompts and settings (10 prompts per suite, MT-Bench both turns, GSM8K,
# HumanEval, 128 new tokens, compiled backend, fp32, both plain baselines in the same run), each point alone and
# the newest in a cascade with prompt lookup; then the table and plot (scripts/curve_report.py). Other jobs are
# paused while it times (scripts/jobs/quiet.sh). A bench.json that already measured every point is kept.
#   POINTS=drafters/eagle3_smollm2_human OUT=results/data_curve_smollm2 bash scripts/jobs/curve_bench_smollm2.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
POINTS=${POINTS:-drafters/eagle3_smollm2_human}
OUT=${OUT:-results/data_curve_smollm2}
NUM=${NUM:-10}
mapfile -t POINT_DIRS < <(ls -d "$POINTS"/loss_tokens_* | sort -t_ -k3 -n)
[ ${#POINT_DIRS[@]} -gt 0 ] || { echo "$POINTS: no loss_tokens_<N>/ points yet" >&2; exit 2; }
NEWEST=${POINT_DIRS[-1]}
METHODS="plain ngram"
for point in "${POINT_DIRS[@]}"; do METHODS="$METHODS dgf:path=$point"; done
METHODS="$METHODS cascade:drafters=[(ngram:min_n=2),(dgf:path=$NEWEST)]"
BENCH=$OUT/bench_$(basename "$NEWEST")
if [ ! -f "$BENCH/bench.json" ]; then
  scripts/jobs/quiet.sh python -m draftsmith.eval.bench target=smollm2-135m-instruct threads=2 num_prompts=$NUM \
    max_new_tokens=128 "suites=[mt-bench,gsm8k,humaneval]" "methods=$METHODS" output_dir="$BENCH"
fi
python scripts/curve_report.py "$POINTS" --bench "$BENCH/bench.json" --out "$OUT/curve" --overwrite  # the table follows the points
