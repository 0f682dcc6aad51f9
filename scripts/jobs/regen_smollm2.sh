#!/usr/bin/env bash
# Issue 17 data budget: SmolLM2-135M-Instruct answers (greedy, first turn, <= 256 new tokens) to
# 2000 GSM8K-train, 1900 ShareGPT and 1166 python-docstrings prompts (5066 conversations), batched,
# resumable per shard: rerun the same command to continue after an interruption.
set -euo pipefail
OUT=${OUT:-outputs/regen/smollm2}
COMMON="target=smollm2-135m-instruct max_new_tokens=256 max_turns=1 batch_size=64 shard_size=128 threads=2"
python -m draftsmith.data.regenerate $COMMON source=gsm8k:train limit=2000 output_dir=$OUT/gsm8k --no-progress
python -m draftsmith.data.regenerate $COMMON source=python-docstrings output_dir=$OUT/code --no-progress
python -m draftsmith.data.regenerate $COMMON source=sharegpt limit=1900 output_dir=$OUT/sharegpt --no-progress
