#!/usr/bin/env bash
# Issue 17: the goal bench of the continued SmolLM2 drafter (scripts/jobs/train_smollm2_long.sh) beside the
# 1000-step one and prompt lookup: compiled, 10 prompts per suite (MT-Bench round-robin over its 8 categories,
# both turns), 128 new tokens, interleaved per prompt, background jobs paused (quiet.sh).
set -euo pipefail
OLD=outputs/dgf_smollm2_final/final
NEW=outputs/dgf_smollm2_long/final
METHODS="plain ngram dgf:path=$OLD,depth=2,topk=1,budget=2 dgf:path=$NEW,depth=2,topk=1,budget=2"
METHODS="$METHODS dgf:path=$NEW,depth=3,topk=1,budget=3 dgf:path=$NEW,depth=3,topk=2,budget=5"
[ -f results/dgf_smollm2_long/bench.json ] || scripts/jobs/quiet.sh python -m draftsmith.eval.bench \
  target=smollm2-135m-instruct threads=2 num_prompts=10 max_new_tokens=128 "suites=[mt-bench,gsm8k,humaneval]" \
  "methods=$METHODS" output_dir=results/dgf_smollm2_long
