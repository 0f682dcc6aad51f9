#!/usr/bin/env bash
# A pruned student at CPU budget (train/configs/distill_qwen_pruned.yaml): 8 of Qwen2.5-Coder-0.5B's 24 layers, healed
# toward the 1.5B's distribution (online bf16 teacher) on human-written answers, with held-out top-1 agreement
# against answer tokens seen. First the unpruned 0.5B's agreement on the same held-out records (the reference: the
# evaluation before one step at a negligible learning rate), then the pruned run for at most BUDGET (default 45m; it
# stops on SIGTERM after a checkpoint and continues where it stopped when rerun on the same machine).
# Summarize with `python scripts/training_report.py outputs/distill_qwen/pruned8 --out
#   results/pruned_student_qwen/training` (results/pruned_student_qwen/README.md).
set -euo pipefail
source "$(dirname "$0")/budget.sh"
CONFIG=train/configs/distill_qwen_pruned.yaml
OUT=${OUT:-outputs/distill_qwen/pruned8}
REF=${OUT}_reference
if [ ! -f "$REF/metrics.jsonl" ]; then
  python train/distill.py --config $CONFIG output_dir="$REF" student.init=pretrained student.layer_ids=null \
    train.max_steps=1 eval.every_steps=0 optim.lr=1e-12 optim.warmup_steps=0 logging.tracker=none logging.run_name=null --overwrite --no-progress
fi
distill_for_budget $CONFIG "$OUT" "${BUDGET:-45m}"
