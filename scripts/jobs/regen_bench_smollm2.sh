#!/usr/bin/env bash
# Regenerated data on the goal bench (10 prompts per suite, MT-Bench both turns, GSM8K, HumanEval, 128 new
# tokens, compiled backend, fp32, both plain baselines, other jobs paused): in one run,
#   - the 10M human point trained on on 1M tokens of the target's own answers (drafters/eagle3_smollm2_human_then_regen)
#     as chains of 3 and 5 and in a cascade with prompt lookup, beside the 10M human point and the bundled drafter;
#   - regenerated-only against human-only at equal tokens (0.25M and 1M, drafters/eagle3_smollm2_regen_only).
# Every drafter runs as a chain of 3 unless named. Skips itself when its bench.json exists. ~60 min on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-results/regenerated_smollm2/bench}
CHAIN3="depth=3,topk=1,budget=3"
NEW=drafters/eagle3_smollm2_human_then_regen/loss_tokens_1000000
HUMAN=drafters/eagle3_smollm2_human
REGEN=drafters/eagle3_smollm2_regen_only
METHODS="plain ngram dgf:$CHAIN3 dgf:path=$HUMAN/loss_tokens_10000000,$CHAIN3 dgf:path=$NEW,$CHAIN3"
METHODS="$METHODS dgf:path=$NEW,depth=5,topk=1,budget=5 cascade:drafters=[(ngram:min_n=2),(dgf:path=$NEW,$CHAIN3)]"
for tokens in 250000 1000000; do
  METHODS="$METHODS dgf:path=$HUMAN/loss_tokens_$tokens,$CHAIN3 dgf:path=$REGEN/loss_tokens_$tokens,$CHAIN3"
done
[ -f "$OUT"/bench.json ] || scripts/jobs/quiet.sh python -m draftsmith.eval.bench --config eval/configs/goal_bench_smollm2.yaml \
  "methods=$METHODS" output_dir="$OUT" num_prompts="${NUM:-10}"
