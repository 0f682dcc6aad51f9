#!/usr/bin/env bash
# Issue 17 data budget: SmolLM2-135M-Instruct answers (greedy, first turn, <= 256 new tokens) to
# 2000 GSM8K-train, 2500 ShareGPT and 1165 python-docstrings prompts (5665 conversations), batched,
# resumable per shard: rerun the same command to continue after an interruption.
set -euo pipefail
OUT=${OUT:-outputs/regen/smollm2}
COMMON="--model smollm2-135m-instruct --max-new-tokens 256 --max-turns 1 --batch-size 64 --shard-size 128 --num-threads 2 --no-progress"
python -m draftsmith.data.regenerate $COMMON --source gsm8k:train --limit 2000 --output-dir $OUT/gsm8k
python -m draftsmith.data.regenerate $COMMON --source python-docstrings --output-dir $OUT/code
python -m draftsmith.data.regenerate $COMMON --source sharegpt --limit 2500 --output-dir $OUT/sharegpt
