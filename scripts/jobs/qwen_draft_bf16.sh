#!/usr/bin/env bash
# Cheaper draft arithmetic on a CPU with AVX512-BF16 (the Intel Xeon, or the Zen 4 AMD EPYC):
# Qwen2.5-Coder-1.5B-Instruct (fp32 target, compiled) with the off-the-shelf 0.5B as the winning cheap chain (32k
# sliced head, up to 8 tokens, stop_below=0.3), its draft LM compiled in float32 against bfloat16, one lever at a
# time on the same prompts (NUM per suite, MT-Bench both turns, GSM8K, HumanEval, 128 new tokens), interleaved per
# prompt, other jobs paused. Resumes from OUT/progress.jsonl (on a CPU of the same ISA only). The target verifies
# in fp32, so every output must equal plain greedy (the bench checks).
# Weight-only int8 (bf16 activations): PRECISIONS="bfloat16 int8-weights" CASCADE=1
#   CASCADE_PRECISIONS="bfloat16 int8-weights" NUM=3 OUT=results/qwen_draft_int8/bench bash scripts/jobs/qwen_draft_bf16.sh
# HF_ASSISTED=1 adds HF assisted generation with the same 0.5B in fp32 (the peer users run), in the same table. With
#   the int8 per-width chain beside it the process outgrows 24 GB and pages: there, run HF assisted in a
#   bench of its own (results/qwen_draft_int8/README.md has the command).
# Refuses to run where the CPU has no bf16 arithmetic (there it is emulated, and slower: results/qwen_draft_cost.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/jobs/qwen15_build.sh
require_avx512_bf16
NUM=${NUM:-2}
OUT=${OUT:-results/qwen_draft_bf16/bench}
VOCAB=drafters/qwen2.5-coder_vocab_32768
CHEAP="lm-chain:budget=8,vocab=$VOCAB,stop_below=${STOP:-0.3}"
# PRECISIONS: the draft LM's arithmetic, one chain row each (float32 is the chain as it is);
# CASCADE=1 adds, per CASCADE_PRECISIONS, the draft-cost study's winning method: prompt lookup first, else that chain
PRECISIONS=${PRECISIONS:-float32 bfloat16}
METHODS="plain-compiled"
for precision in $PRECISIONS; do
  if [ "$precision" = float32 ]; then METHODS="$METHODS $CHEAP"; else METHODS="$METHODS $CHEAP,precision=$precision"; fi
done
if [ "${CASCADE:-0}" = 1 ]; then
  for precision in ${CASCADE_PRECISIONS:-bfloat16}; do
    METHODS="$METHODS cascade:drafters=[(ngram:min_n=2),($CHEAP,precision=$precision)]"
  done
fi
if [ "${HF_ASSISTED:-0}" = 1 ]; then METHODS="$METHODS hf-assisted"; fi
build_qwen15
[ -f "$OUT"/bench.json ] || scripts/jobs/quiet.sh python -m draftsmith.eval.bench --config eval/configs/goal_bench_qwen15.yaml \
  "methods=$METHODS" output_dir="$OUT" num_prompts="${NUM:-10}"
