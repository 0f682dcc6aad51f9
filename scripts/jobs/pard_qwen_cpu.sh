#!/usr/bin/env bash
# Issue 35 lever 2 at CPU budget (train/configs/pard_qwen_cpu.yaml): the 0.5B adapted by LoRA into a parallel (PARD)
# draft model of 3 tokens a forward for the 1.5B, for at most BUDGET (default 80m). The budget stops it by SIGTERM
# after a checkpoint; rerun on the same machine and it continues where it stopped. Then export the newest state with
#   python train/distill.py --config train/configs/pard_qwen_cpu.yaml --resume train.max_steps=<its step>
# and summarize with `python scripts/training_report.py outputs/pard_qwen/cpu_lora --out results/pard_qwen_cpu/training`.
set -euo pipefail
CONFIG=train/configs/pard_qwen_cpu.yaml
OUT=${OUT:-outputs/pard_qwen/cpu_lora}
RESUME=""
[ -d "$OUT/checkpoints" ] && RESUME=--resume
rc=0
timeout -s TERM "${BUDGET:-80m}" python train/distill.py --config $CONFIG output_dir="$OUT" $RESUME --no-progress || rc=$?
[ $rc -eq 0 ] || [ $rc -eq 124 ]  # 124: the budget ended the run after a checkpoint
