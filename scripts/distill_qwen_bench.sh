#!/usr/bin/env bash
# Side-by-side bench of the original Qwen2.5-Coder-0.5B-Instruct draft (--draft) and the distilled student
# (draft=<dir>) for the Qwen2.5-Coder-1.5B-Instruct target, chain and tree, GSM8K-test and MT-Bench, bf16.
#   flock /tmp/draftsmith_cpu.lock timeout 1150 env OMP_NUM_THREADS=2 bash scripts/distill_qwen_bench.sh > outputs/distill_qwen/bench.log 2>&1
# (about 11 minutes per suite on the shared 2-core CPU: run one suite per locked job with SUITES=gsm8k, SUITES=mt-bench)
set -euo pipefail
D=${D:-outputs/distill_qwen/run/final}
P=${P:-3}
for suite in ${SUITES:-gsm8k mt-bench}; do
  python -m draftsmith.eval.bench --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --dtype bfloat16 \
    --suite $suite --num-prompts $P --max-new-tokens 64 --threads 2 \
    --methods plain lm-chain:k=4 lm-chain:k=4,draft=$D lm-tree:depth=4,topk=2,budget=8 \
              lm-tree:depth=4,topk=2,budget=8,draft=$D \
    --out results/distill_qwen_bench_$suite.json
done
