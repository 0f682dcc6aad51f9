#!/usr/bin/env bash
# The CPU work in order, each part resuming where it stopped: SmolLM2 (data -> drafter -> bench ->
# bundled drafter -> the README's first command timed), then the Qwen pair. Run in the background:
#   (nohup nice -n 15 bash scripts/jobs/train_and_bench_smollm2_then_qwen.sh >> outputs/jobs/train_and_bench.log 2>&1 &)
set -euo pipefail
bash scripts/jobs/train_smollm2_final.sh
bash scripts/jobs/train_smollm2_long.sh
bash scripts/jobs/train_qwen_pair.sh
