#!/usr/bin/env bash
# The goal bench for SmolLM2-135M-Instruct as eval/configs/goal_bench_smollm2.yaml declares it (10 prompts per
# suite, MT-Bench both turns, GSM8K, HumanEval, 128 new tokens, compiled engine, both plain baselines, every output
# checked against plain), other jobs paused while it times. Skips itself when its bench.json exists; a rerun
# continues from its progress.jsonl.
#   OUT=results/<study>/goal_bench bash scripts/jobs/goal_bench_smollm2.sh
#   DTYPE=bfloat16 or WEIGHTS=int8 for the other precisions (lossless against that target's own plain decoding);
#   a w8a8 target has its own protocol (its drafters in fp32 or int8): eval/configs/goal_bench_w8a8_smollm2.yaml
set -euo pipefail
cd "$(dirname "$0")/../.."
DTYPE=${DTYPE:-float32}
WEIGHTS=${WEIGHTS:-model}
OUT=${OUT:-outputs/goal_bench_smollm2_${DTYPE}_${WEIGHTS}}
[ -f "$OUT"/bench.json ] || scripts/jobs/quiet.sh python -m draftsmith.eval.bench --config eval/configs/goal_bench_smollm2.yaml \
  output_dir="$OUT" num_prompts="${NUM:-10}" dtype="$DTYPE" compile.weights="$WEIGHTS"
