#!/usr/bin/env bash
# The goal bench for Qwen2.5-Coder-1.5B-Instruct as eval/configs/goal_bench_qwen15.yaml declares it (fp32 target,
# compiled engine, 2 threads, NUM prompts per suite (10 unless set), MT-Bench both turns, GSM8K, HumanEval, 128 new
# tokens, both plain baselines, every output checked against plain): the 0.5B as a cheap chain (32k head slice, up
# to 8 tokens, stop_below 0.3) and in a cascade after prompt lookup. The 1.5B's compiled package is built first in a
# process of its own. Levers beside the protocol's methods:
#   CHAIN4=1 (default)  the off-the-shelf 0.5B as a chain of 4 with its full 151,936-token head (the "before" row)
#   INT8=1              the same chain and cascade with the 0.5B's weights in int8 on the batch-invariant kernels
#                       under float32 activations (`weights=int8`: a quarter of its weight stream; the AVX2 EPYC's
#                       choice); INT8=bfloat16 under bf16 activations (`precision=int8-weights`, for AVX512-BF16)
#   HF=1                HF's assisted generation with transformers' defaults for the assistant (up to 20 tokens a
#                       round, stopped by its confidence threshold)
# The bench writes progress.jsonl per conversation: a rerun with the same settings continues where it stopped
# (commit OUT to carry a partial run to the next machine). NUM=5 took 87 min on a 2-core AMD EPYC on the stock
# engine (target step 465 ms); NUM=10 takes about twice that.
#   NUM=5 CHAIN4=0 OUT=results/<study>/bench bash scripts/jobs/qwen_goal_bench.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/jobs/qwen15_build.sh
OUT=${OUT:-results/qwen_draft_cost/bench}
VOCAB=drafters/qwen2.5-coder_vocab_32768
[ -f $VOCAB/draft_vocab.safetensors ] || bash scripts/jobs/vocab_qwen.sh
EXTRA=()  # the protocol's methods (eval/configs/goal_bench_qwen15.yaml), plus the levers asked for
[ "${CHAIN4:-1}" = 1 ] && EXTRA+=("lm-chain:budget=4")
case "${INT8:-0}" in  # how the int8 chain stores the 0.5B (otherwise the protocol's chain)
  0) INT8_STORAGE= ;;
  1) INT8_STORAGE=weights=int8 ;;
  bfloat16) require_avx512_bf16; INT8_STORAGE=precision=int8-weights ;;
  *) echo "error: INT8=$INT8: give 1 (float32 activations) or bfloat16" >&2; exit 2 ;;
esac
if [ -n "$INT8_STORAGE" ]; then
  INT8_CHAIN="lm-chain:budget=8,vocab=$VOCAB,stop_below=0.3,$INT8_STORAGE"
  EXTRA+=("$INT8_CHAIN" "cascade:drafters=[(ngram:min_n=2), ($INT8_CHAIN)]")
fi
[ "${HF:-0}" = 1 ] && EXTRA+=("hf-assisted")
build_qwen15
if [ ${#EXTRA[@]} -gt 0 ]; then
  METHODS=$(python -c "import json,yaml,sys; print(json.dumps(yaml.safe_load(open('eval/configs/goal_bench_qwen15.yaml'))['methods'] + sys.argv[1:]))" "${EXTRA[@]}")
  set -- "methods=$METHODS"
fi
[ -f "$OUT"/bench.json ] || scripts/jobs/quiet.sh python -m draftsmith.eval.bench --config eval/configs/goal_bench_qwen15.yaml \
  output_dir="$OUT" num_prompts="${NUM:-10}" "$@"
