#!/usr/bin/env bash
# The GSM8K goal (tau >= 3.0) through the tree the decoder verifies rather than the drafter's training: the
# bundled SmolLM2 drafter on the goal bench's 10 GSM8K questions (128 new tokens, compiled backend, fp32, both plain
# baselines, interleaved per prompt, other jobs paused) as chains of 3 and 4, a dynamic chain of up to 6, and
# dynamic trees (EAGLE-2 style: topk children per expanded node, the budget best nodes verified in one forward).
# tau, per-depth acceptance and what each costs (draft ms per round, speedup) side by side.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-results/gsm8k_tau_smollm2}
METHODS="plain dgf:depth=3,topk=1,budget=3 dgf:depth=4,topk=1,budget=4 dgf:depth=6,topk=1,budget=6,stop_below=0.3"
METHODS="$METHODS dgf:depth=5,topk=2,budget=10 dgf:depth=6,topk=4,budget=16 dgf:depth=8,topk=4,budget=32"
[ -f "$OUT/bench.json" ] || scripts/jobs/quiet.sh python -m draftsmith.eval.bench target=smollm2-135m-instruct \
  threads=2 num_prompts="${NUM:-10}" max_new_tokens=128 "suites=[gsm8k]" "methods=$METHODS" output_dir="$OUT"
