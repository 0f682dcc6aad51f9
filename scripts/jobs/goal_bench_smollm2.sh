#!/usr/bin/env bash
# Issue 17's goal bench for SmolLM2-135M at full size with the bundled drafter (models/bundled, 1800 steps)
# alone, in a cascade and in a union with prompt lookup: the same settings as results/dgf_smollm2_long/bench.md
# (compiled backend, 10 prompts per suite, MT-Bench both turns, GSM8K, HumanEval, 128 new tokens), which the
# union/cascade probe (results/union_probe_smollm2.md) ran on 4 prompts and two suites only. ~35 min on 2 cores,
# other jobs paused. Skips itself when its bench.json exists.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=results/goal_bench_smollm2
CHAIN3="dgf:depth=3,topk=1,budget=3"
METHODS="plain ngram dgf $CHAIN3 cascade union union:drafters=[($CHAIN3),ngram]"
[ -f $OUT/bench.json ] || scripts/jobs/quiet.sh python -m draftsmith.eval.bench \
  target=smollm2-135m-instruct threads=2 num_prompts=10 max_new_tokens=128 "suites=[mt-bench,gsm8k,humaneval]" \
  "methods=$METHODS" output_dir=$OUT
