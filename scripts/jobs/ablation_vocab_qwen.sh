#!/usr/bin/env bash
# The draft-vocabulary ablation, Qwen2.5-Coder-1.5B target with the 0.5B as a training-free LM drafter: full vocabulary
# vs a sliced 32k / 8k head (draft vocabularies from scripts/jobs/vocab_qwen.sh), chain and tree, fp32,
# eager backend (the 1.5B's compiled packages hold a 6 GB weight copy per bucket).
set -euo pipefail
V32=outputs/vocab/qwen_32768
V8=outputs/vocab/qwen_8192
METHODS="plain lm-chain:budget=4 lm-chain:budget=4,vocab=$V32 lm-chain:budget=4,vocab=$V8"
METHODS="$METHODS lm-tree:depth=4,topk=3,budget=16 lm-tree:depth=4,topk=3,budget=16,vocab=$V8"
python -m draftsmith.eval.bench target=qwen2.5-coder-1.5b-instruct draft=qwen2.5-coder-0.5b-instruct \
  backend=eager threads=2 turns=1 num_prompts=2 max_new_tokens=64 "suites=[gsm8k,mt-bench]" \
  "methods=$METHODS" output_dir=results/archive/ablation_vocab_qwen
