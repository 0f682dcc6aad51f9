#!/usr/bin/env bash
# The CPU-trained PARD drafter (3 tokens from one forward) beside the off-the-shelf 0.5B
# as a chain of the same 3 tokens (3 forwards) and as the cheap chain that won the Qwen draft-cost study (up to 8, stop_below=0.3), every
# draft LM in PRECISION (default bfloat16; int8-weights on a CPU without AVX512-BF16, where bf16 is emulated) with its
# head sliced to the 32k draft vocabulary, on the 1.5B (fp32 target, compiled) with NUM prompts per suite of the goal
# bench (default 2), interleaved per prompt, other jobs paused. The target verifies in fp32: every output must equal
# plain greedy (the bench checks). Resumes from OUT/progress.jsonl. VS_WINNER=1 OUT=results/pard_qwen_cpu/bench_cascade:
# PARD alone and in the cascade with lookup, against the cheap chain in that cascade.
# MODEL: the merged PARD model; by default the committed adapter merged by
#   python scripts/export.py student drafters/pard_qwen_cpu exports/pard_qwen_cpu --dtype bfloat16
# (or a training run's own export, MODEL=outputs/pard_qwen/cpu_lora/final).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/jobs/qwen15_build.sh
PRECISION=${PRECISION:-bfloat16}
[ "$PRECISION" = bfloat16 ] && require_avx512_bf16
NUM=${NUM:-2}
OUT=${OUT:-results/pard_qwen_cpu/bench}
MODEL=${MODEL:-exports/pard_qwen_cpu}
[ -f "$MODEL/config.json" ] || { echo "error: no PARD drafter at $MODEL; merge the committed adapter with \
\`python scripts/export.py student drafters/pard_qwen_cpu $MODEL --dtype bfloat16\` (or set MODEL)" >&2; exit 2; }
VOCAB=drafters/qwen2.5-coder_vocab_32768
SAME="vocab=$VOCAB,precision=$PRECISION"
PARD="lm-parallel:budget=3,model=$MODEL,$SAME"
if [ "${VS_WINNER:-0}" = 1 ]; then
  # in the cascade with prompt lookup (the draft-cost study's winning form), PARD against the cheap chain, both in
  # PRECISION. The int8 chain with a graph per width does not fit beside them: with it the process filled 24 GB and
  # thrashed the page cache before its first prompt
  CHEAP="lm-chain:budget=8,stop_below=0.3,$SAME"
  METHODS="plain-compiled $PARD cascade:drafters=[(ngram:min_n=2),($CHEAP)] cascade:drafters=[(ngram:min_n=2),($PARD)]"
else  # the lever alone: the same 3 tokens from 1 forward against 3, and the cheap chain, all in PRECISION
  METHODS="plain-compiled lm-chain:budget=3,$SAME $PARD lm-chain:budget=8,stop_below=0.3,$SAME"
fi
build_qwen15
[ -f "$OUT"/bench.json ] || scripts/jobs/quiet.sh python -m draftsmith.eval.bench --config eval/configs/goal_bench_qwen15.yaml \
  "methods=$METHODS" output_dir="$OUT" num_prompts="${NUM:-10}"
