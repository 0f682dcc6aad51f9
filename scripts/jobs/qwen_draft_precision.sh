#!/usr/bin/env bash
# Cheaper arithmetic for the drafter: Qwen2.5-Coder-1.5B-Instruct (fp32, eager) with the
# off-the-shelf 0.5B as a chain of 4 in float32, bfloat16 and dynamic int8, one lever at a time on the same prompts
# (NUM per suite, MT-Bench both turns), interleaved per prompt, on a quiet machine. The output is the target's
# greedy output in every case (the bench checks each prompt against plain). QUIET= runs it beside the background
# jobs instead of pausing them (timings then contended; the methods still interleave per prompt).
set -euo pipefail
CPU=${CPU:-$(grep -m1 "model name" /proc/cpuinfo | grep -qi amd && echo epyc || echo xeon)}
NUM=${NUM:-2}
OUT=${OUT:-results/qwen_draft_precision_$CPU}
CHAIN=lm-chain:budget=4
[ -f "$OUT/bench.json" ] || ${QUIET-scripts/jobs/quiet.sh} python -m draftsmith.eval.bench target=qwen2.5-coder-1.5b-instruct \
  draft=qwen2.5-coder-0.5b-instruct backend=eager threads=2 num_prompts=$NUM max_new_tokens=64 \
  "suites=[mt-bench,gsm8k,humaneval]" \
  "methods=plain $CHAIN $CHAIN,precision=bfloat16 $CHAIN,precision=int8" output_dir=$OUT
