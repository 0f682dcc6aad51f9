#!/usr/bin/env bash
# The acceptance-vs-data curve, measured: every committed point of a curve run (drafters/<run>/loss_tokens_<N>/) through the
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
MIN_TOKENS=${MIN_TOKENS:-250000}  # the curve's points: 0.25M, 1M, 4M, 10M (0.1M only warms the run up)
# One tree for every point, the shape that pays on a 2-core CPU: a chain of 3 (Dovetail's default 7/10/16 tree,
# which the points' held-out tau uses, costs 7 drafter forwards and 16 verified nodes a round: 0.3-0.5x plain here)
TREE=${TREE:-depth=3,topk=1,budget=3}
NEWEST_TREES=${NEWEST_TREES:-depth=5,topk=1,budget=5}  # further shapes for the newest point only
mapfile -t POINT_DIRS < <(for d in "$POINTS"/loss_tokens_*; do n=${d##*_}; [ "$n" -ge "$MIN_TOKENS" ] && echo "$n $d"; done \
  | sort -n | cut -d' ' -f2)
[ ${#POINT_DIRS[@]} -gt 0 ] || { echo "$POINTS: no loss_tokens_<N>/ points yet" >&2; exit 2; }
NEWEST=${POINT_DIRS[-1]}
METHODS="plain ngram"
for point in "${POINT_DIRS[@]}"; do METHODS="$METHODS dgf:path=$point,$TREE"; done
for tree in $NEWEST_TREES; do METHODS="$METHODS dgf:path=$NEWEST,$tree"; done
METHODS="$METHODS cascade:drafters=[(ngram:min_n=2),(dgf:path=$NEWEST,$TREE)]"
BENCH=$OUT/bench_$(basename "$NEWEST")
[ -f "$BENCH"/bench.json ] || scripts/jobs/quiet.sh python -m draftsmith.eval.bench --config eval/configs/goal_bench_smollm2.yaml \
  "methods=$METHODS" output_dir="$BENCH" num_prompts="${NUM:-10}"
python scripts/curve_report.py "$POINTS" --bench "$BENCH/bench.json" --out "$OUT/curve" --overwrite  # the table follows the points
