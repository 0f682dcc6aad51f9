#!/usr/bin/env bash
# The bundled EAGLE-3 drafter (10M human + 1M regenerated tokens) trained one more pass over
# all 2.57M regenerated tokens on an H100 (drafters/eagle3_smollm2_all_regen/loss_tokens_2400000), on the goal
# bench (10 prompts per suite, MT-Bench both turns, GSM8K, HumanEval, 128 new tokens, compiled backend, fp32, both
# plain baselines, interleaved per prompt, other jobs paused), beside the bundled drafter and prompt lookup.
# Chains of 3 and 4, and the cascade with lookup. Resumes from OUT/progress.jsonl; skips itself when bench.json exists.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-results/all_regen_smollm2/bench}
NEW=${NEW:-drafters/eagle3_smollm2_all_regen/loss_tokens_2400000}
BUNDLED=models/bundled/smollm2-135m-instruct-eagle3
CHAIN3="depth=3,topk=1,budget=3"
CHAIN4="depth=4,topk=1,budget=4"
METHODS="plain ngram dgf:path=$BUNDLED,$CHAIN3 dgf:path=$NEW,$CHAIN3 dgf:path=$NEW,$CHAIN4"
METHODS="$METHODS cascade:drafters=[(ngram:min_n=2),(dgf:path=$BUNDLED,$CHAIN3)]"
METHODS="$METHODS cascade:drafters=[(ngram:min_n=2),(dgf:path=$NEW,$CHAIN3)]"
[ -f "$OUT"/bench.json ] || scripts/jobs/quiet.sh python -m draftsmith.eval.bench --config eval/configs/goal_bench_smollm2.yaml \
  "methods=$METHODS" output_dir="$OUT" num_prompts="${NUM:-10}"
