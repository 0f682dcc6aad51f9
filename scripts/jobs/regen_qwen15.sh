#!/usr/bin/env bash
# Qwen2.5-Coder-1.5B-Instruct's own answers (greedy, first turn, <= 256 new tokens) for
# the distilled 0.5B student and the 1.5B's feature drafter: GSM8K train, python-docstrings code and
# ShareGPT prompts, batched, resumable per shard (rerun to continue). Measured on the 2-core CPU at batch 32
# (results/archive/regen_qwen15.md): GSM8K 18.0 answer tok/s, code 11.5, ShareGPT 7.7 (short answers wait in the batch
# for its longest); 187 conversations, 39k answer tokens in 0.8 h. The limits fit one 3-hour run together
# with features, both trainings and the bench; raise them in later runs (or run it on a device).
# Code/ShareGPT prompts over 384 tokens are dropped (the training windows; one long prompt makes its whole
# left-padded batch that long).
set -euo pipefail
OUT=${OUT:-outputs/regen/qwen15}
COMMON="target=qwen2.5-coder-1.5b-instruct max_new_tokens=256 max_turns=1 batch_size=32 shard_size=32 threads=2"
python -m draftsmith.data.regenerate $COMMON source=gsm8k:train limit=96 output_dir=$OUT/gsm8k --no-progress
python -m draftsmith.data.regenerate $COMMON max_prompt_tokens=384 source=python-docstrings limit=64 output_dir=$OUT/code --no-progress
python -m draftsmith.data.regenerate $COMMON max_prompt_tokens=384 source=sharegpt limit=32 output_dir=$OUT/sharegpt --no-progress
