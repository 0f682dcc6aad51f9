#!/usr/bin/env bash
# Measurements of the Qwen pair, 2-core CPU, each step on a quiet machine (quiet.sh pauses the
# background data jobs): T(w) curves eager vs compiled, fp32 vs bf16, for the 0.5B and the 1.5B; one
# verification forward of the 1.5B profiled; the 1.5B with the 0.5B as drafter (chain and tree) against
# both plain baselines and HF assisted generation, compiled backend, fp32.
set -euo pipefail
Q=scripts/jobs/quiet.sh
for size in 0.5b 1.5b; do
  [ -f results/latency/qwen$size.json ] || $Q python -m draftsmith.eval.latency target=qwen2.5-coder-$size-instruct \
    "backends=[eager,compiled]" "dtypes=[float32,bfloat16]" threads=2 output=results/latency/qwen$size.json
done
[ -f results/latency/forward_profile_qwen1.5b.json ] || $Q python -m draftsmith.eval.forward_profile \
  target=qwen2.5-coder-1.5b-instruct width=8 threads=2 output=results/latency/forward_profile_qwen1.5b.json
$Q python -m draftsmith.eval.bench target=qwen2.5-coder-1.5b-instruct draft=qwen2.5-coder-0.5b-instruct \
  backend=compiled threads=2 turns=1 num_prompts=3 max_new_tokens=64 "suites=[mt-bench,gsm8k]" \
  "methods=plain hf-assisted lm-chain:budget=4 lm-tree:depth=4,topk=3,budget=16" output_dir=results/archive/compiled_qwen
