#!/usr/bin/env bash
# Issue 17's goal bench for SmolLM2-135M in bfloat16: the same methods and prompts as goal_bench_smollm2.sh
# (fp32). On a CPU with AVX512-BF16 (the Intel Xeon of 2026-11-25) the compiled bf16 forward is ~1.4x faster
# than fp32 at one token and scales better with width; on AVX2 CPUs (the AMD EPYC of earlier sessions) bf16
# has no hardware support. Lossless here means: every method reproduces plain greedy decoding of the bf16
# target through the same compiled forward. ~30 min on 2 cores, other jobs paused. Skips itself when done.
# Result (2026-11-25, Xeon): NOT lossless. Every speculative method diverged from plain-compiled bf16 greedy within
# the first 7 prompts (results/goal_bench_smollm2_bf16/mismatch.log): the bf16 forward over w tokens is not row-for-row
# identical to w one-token forwards. Kept to reproduce that finding, not as a way to get speed.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=results/goal_bench_smollm2_bf16
CHAIN3="dgf:depth=3,topk=1,budget=3"
METHODS="plain ngram dgf cascade union union:drafters=[($CHAIN3),ngram]"
[ -f $OUT/bench.json ] || scripts/jobs/quiet.sh python -m draftsmith.eval.bench \
  target=smollm2-135m-instruct dtype=bfloat16 threads=2 num_prompts=10 max_new_tokens=128 \
  "suites=[mt-bench,gsm8k,humaneval]" "methods=$METHODS" output_dir=$OUT
