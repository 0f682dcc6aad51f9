#!/usr/bin/env bash
# Issue 17, the steps lever: continue the SmolLM2 drafter (outputs/dgf_smollm2_final/final) for 800 more steps
# on the same feature caches and draft vocabulary (train/configs/dgf_smollm2_long.yaml), then its report.
# Resumes: rerun after an interruption. Run after scripts/jobs/train_smollm2_final.sh.
set -euo pipefail
CACHES="outputs/features/smollm2_final_gsm8k + outputs/features/smollm2_final_code"
CACHES="$CACHES + outputs/features/smollm2_final_sharegpt + outputs/features/smollm2_final_sharegpt2"
RESUME=""; [ -d outputs/dgf_smollm2_long/checkpoints ] && RESUME="--resume"
[ -d outputs/dgf_smollm2_long/final ] || OMP_NUM_THREADS=2 accelerate launch --num_processes 1 --num_machines 1 \
  --mixed_precision no --dynamo_backend no train/dgf.py --config train/configs/dgf_smollm2_long.yaml \
  "data.feature_cache=$CACHES" drafter.draft_vocab=outputs/vocab/smollm2_final_8192 drafter.head=slice $RESUME \
  --no-progress
python scripts/training_report.py outputs/dgf_smollm2_long --out results/dgf_smollm2_long/training --overwrite
