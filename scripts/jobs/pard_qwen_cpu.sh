#!/usr/bin/env bash
# Issue 35 lever 2 at CPU budget (train/configs/pard_qwen_cpu.yaml): the 0.5B adapted by LoRA into a parallel (PARD)
# draft model of 3 tokens a forward for the 1.5B, for at most BUDGET (default 80m). The budget stops it by SIGTERM
# after a checkpoint; rerun on the same machine and it continues where it stopped. Then export the newest state with
#   python train/distill.py --config train/configs/pard_qwen_cpu.yaml --resume train.max_steps=<its step>
# and summarize with `python scripts/training_report.py outputs/pard_qwen/cpu_lora --out results/pard_qwen_cpu/training`.
set -euo pipefail
source "$(dirname "$0")/budget.sh"
distill_for_budget train/configs/pard_qwen_cpu.yaml "${OUT:-outputs/pard_qwen/cpu_lora}" "${BUDGET:-80m}"
