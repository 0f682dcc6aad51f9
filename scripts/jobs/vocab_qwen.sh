#!/usr/bin/env bash
# Issue 16: draft vocabularies for the Qwen2.5-Coder pair (one tokenizer), ranked on answers the 1.5B has
# not regenerated yet (GSM8K-train references, ShareGPT answers; the code prompts carry no answer): training-free
# sliced heads for the 0.5B LM drafter.
set -euo pipefail
for SIZE in 32768 8192; do
  python -m draftsmith.data.draft_vocab target=qwen2.5-coder-1.5b-instruct size=$SIZE \
    "sources=[gsm8k:train,sharegpt]" limit=3000 output=outputs/vocab/qwen_${SIZE}
done
