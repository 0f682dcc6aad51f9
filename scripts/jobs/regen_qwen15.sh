#!/usr/bin/env bash
# Issue 17 item 4: Qwen2.5-Coder-1.5B-Instruct's own answers (greedy, first turn, <= 256 new tokens) for
# the distilled 0.5B student and the 1.5B's feature drafter: GSM8K train, python-docstrings code and
# ShareGPT prompts, batched, resumable per shard (rerun to continue). CPU budget: ~15-20 tok/s batched,
# so each part is sized for about an hour; raise the limits in later sessions (or run it on a device).
# Code/ShareGPT prompts over 384 tokens are dropped (the training windows; one long prompt makes its whole
# left-padded batch that long).
set -euo pipefail
OUT=${OUT:-outputs/regen/qwen15}
COMMON="target=qwen2.5-coder-1.5b-instruct max_new_tokens=256 max_turns=1 batch_size=16 shard_size=32 threads=2"
python -m draftsmith.data.regenerate $COMMON source=gsm8k:train limit=320 output_dir=$OUT/gsm8k --no-progress
python -m draftsmith.data.regenerate $COMMON max_prompt_tokens=384 source=python-docstrings limit=160 output_dir=$OUT/code --no-progress
python -m draftsmith.data.regenerate $COMMON max_prompt_tokens=384 source=sharegpt limit=320 output_dir=$OUT/sharegpt --no-progress
