#!/usr/bin/env bash
# The goal bench (10 prompts per suite, MT-Bench both turns, GSM8K, HumanEval, 128 new tokens, compiled
# backend, fp32, both plain baselines, other jobs paused) for the bundled drafter's dynamic depth: the chain of 3
# it ships with against a chain of up to 6 that stops once the drafter's probability of the chain so far falls
# below STOP (`stop_below`, default 0.3), alone and in a cascade after prompt lookup. ~23 min on 2 cores; skips
# itself when its bench.json exists.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-results/dynamic_depth_smollm2/bench}
CHAIN3="dgf:depth=3,topk=1,budget=3"
DYNAMIC="dgf:depth=6,topk=1,budget=6,stop_below=${STOP:-0.3}"
METHODS="plain $CHAIN3 $DYNAMIC cascade:drafters=[(ngram:min_n=2),($DYNAMIC)]"
[ -f "$OUT"/bench.json ] || scripts/jobs/quiet.sh python -m draftsmith.eval.bench --config eval/configs/goal_bench_smollm2.yaml \
  "methods=$METHODS" output_dir="$OUT" num_prompts="${NUM:-10}"
