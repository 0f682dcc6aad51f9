#!/usr/bin/env bash
# Issue 34's Qwen rows: Qwen2.5-Coder-1.5B-Instruct in llama.cpp (q4_k_m, then f32) with llama.cpp's own modes:
# n-gram lookup and the off-the-shelf 0.5B as a draft model (q8_0). NUM prompts per suite (MT-Bench both turns),
# 128 new tokens, 2 threads, on a quiet machine (scripts/jobs/quiet.sh pauses the background jobs meanwhile).
# Needs `python scripts/fetch_models.py --all` and the llama.cpp build. Each output is skipped once written.
set -euo pipefail
CPU=${CPU:-$(grep -m1 "model name" /proc/cpuinfo | grep -qi amd && echo epyc || echo xeon)}
NUM=${NUM:-3}
METHODS="ngram draft:qwen2.5-coder-0.5b-instruct,type=q8_0"
COMMON="target=qwen2.5-coder-1.5b-instruct num_prompts=$NUM max_new_tokens=128 threads=2 pytorch_baselines=false"
for TYPE in ${TYPES:-q4_k_m float32}; do
  OUT=results/llamacpp/qwen1.5b_${TYPE}_${CPU}.json
  [ -f "$OUT" ] && continue
  scripts/jobs/quiet.sh python -m draftsmith.eval.llamacpp_bench $COMMON target_type=$TYPE "methods=$METHODS" \
    output=$OUT
done
