#!/usr/bin/env bash
# The llama.cpp bench's Qwen rows: Qwen2.5-Coder-1.5B-Instruct in llama.cpp (q4_k_m, then f32) with llama.cpp's own modes:
# n-gram lookup and the off-the-shelf 0.5B as a draft model (q8_0; the target verifies in its own type, so the
# drafter's type never changes the output), with fixed-length drafts and with llama.cpp's per-token confidence stop
# (p_min: --spec-draft-p-min), the analogue of this toolkit's stop_below. NUM prompts per suite (MT-Bench both
# turns), 128 new tokens, 2 threads, on a quiet machine (scripts/jobs/quiet.sh pauses the background jobs).
# Needs `python scripts/fetch_models.py --all` and the llama.cpp build. Each output is skipped once written.
#   TYPES=float32 LABEL=pmin bash scripts/jobs/llamacpp_bench_qwen.sh    (~30 min at NUM=3 on the AMD EPYC)
set -euo pipefail
cd "$(dirname "$0")/../.."
CPU=${CPU:-$(grep -m1 "model name" /proc/cpuinfo | grep -qi amd && echo epyc || echo xeon)}
NUM=${NUM:-3}
DRAFT=draft:qwen2.5-coder-0.5b-instruct,type=q8_0
METHODS=${METHODS:-"ngram $DRAFT $DRAFT,p_min=0.75 $DRAFT,n_max=8,p_min=0.5"}
LABEL=${LABEL:+_$LABEL}
COMMON="target=qwen2.5-coder-1.5b-instruct num_prompts=$NUM max_new_tokens=128 threads=2 pytorch_baselines=false"
for TYPE in ${TYPES:-q4_k_m float32}; do
  OUT=results/llamacpp/qwen1.5b_${TYPE}${LABEL}_${CPU}.json
  [ -f "$OUT" ] && continue
  scripts/jobs/quiet.sh python -m draftsmith.eval.engines.llamacpp_bench $COMMON target_type=$TYPE "methods=$METHODS" \
    output=$OUT
done
