#!/usr/bin/env bash
# The draft vocabulary of the Qwen2.5-Coder pair (one tokenizer), for the training-free
# sliced head of the 0.5B LM drafter (`lm-chain:...,vocab=drafters/qwen2.5-coder_vocab_32768`). Ranked, with
# the Qwen tokenizer, on answers kept out of the test suites: SmolLM2's regenerated pool (ShareGPT, GSM8K
# train, docstrings and LeetCode prompts), GSM8K-train references, ShareGPT answers and permissively licensed
# Python source; 4,000 records per source (~1 min on 2 cores). Committed output; skips itself when present.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=drafters/qwen2.5-coder_vocab_32768
[ -f $OUT/draft_vocab.safetensors ] || python -m draftsmith.data.draft_vocab target=qwen2.5-coder-1.5b-instruct \
  size=32768 "report_sizes=[8192,16384,32768,49152,65536]" limit=4000 output=$OUT \
  "sources=[conversations:datasets/regenerated/smollm2-135m-instruct/pool_bf16,gsm8k:train,sharegpt,python-source]"
