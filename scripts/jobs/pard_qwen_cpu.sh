#!/usr/bin/env bash
# The PARD drafter at CPU budget (train/configs/pard_qwen_cpu.yaml): the 0.5B adapted by LoRA into a parallel (PARD)
# draft model of 3 tokens a forward for the 1.5B, for at most BUDGET (default 80m). The budget stops it by SIGTERM
# after a checkpoint; rerun on the same machine and it continues where it stopped. Then export the newest state with
#   python train/distill.py --config train/configs/pard_qwen_cpu.yaml --resume train.max_steps=<its step>
# and summarize with `python scripts/training_report.py outputs/pard_qwen/cpu_lora --out results/pard_qwen_cpu/training`.
# Arguments are overrides of the config. On a new machine (no checkpoints), continue the committed adapter rather than
# start again: `bash scripts/jobs/pard_qwen_cpu.sh lora.adapter=drafters/pard_qwen_cpu lora.adapter_samples_seen=240`
# (its 60 steps x 4 sequences; the data order goes on from there, AdamW's moments restart). The export writes
# final/adapter/, the adapter alone, which replaces drafters/pard_qwen_cpu/'s two weight files.
set -euo pipefail
source "$(dirname "$0")/budget.sh"
distill_for_budget train/configs/pard_qwen_cpu.yaml "${OUT:-outputs/pard_qwen/cpu_lora}" "${BUDGET:-80m}" "$@"
