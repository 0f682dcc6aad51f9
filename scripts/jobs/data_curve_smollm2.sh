#!/usr/bin/env bash
# The acceptance-vs-data curve (train/configs/dgf_smollm2_curve.yaml; RECIPE=medusa with
# CONFIG=train/configs/medusa_smollm2_curve.yaml RUN=outputs/curve_smollm2_medusa KEEP=drafters/curve_smollm2_medusa
# for Medusa heads on the same data): one pass over human-written
# answers scored by the target in the loop, a snapshot of the drafter at 0.1M, 0.25M, 1M, 4M and 10M loss-bearing
# tokens. ~150 loss tokens/s on 2 cores (the target's forward dominates), so 10M takes several machines in turn: the
# job runs until it is stopped and every SYNC_S seconds copies new snapshots, and a lean resume point of the newest
# checkpoint (weights, step, data position, schedule, RNG; no optimizer moments), into the committed
# drafters/curve_smollm2_human/. A new machine resumes from there (AdamW's moments restart; logged).
#   (nohup nice -n 5 bash scripts/jobs/data_curve_smollm2.sh >> outputs/jobs/data_curve_smollm2.log 2>&1 &)
# Commit drafters/ after each sync you want to keep (git add drafters && git commit).
# OVERRIDES="key=value ..." trains a variant of CONFIG (results/architecture_ablation_smollm2/README.md, at 1M).
set -euo pipefail
source "$(dirname "$0")/newest.sh"
RUN=${RUN:-outputs/curve_smollm2_human}
KEEP=${KEEP:-drafters/curve_smollm2_human}
SYNC_S=${SYNC_S:-600}
CONFIG=${CONFIG:-train/configs/dgf_smollm2_curve.yaml}
RECIPE=${RECIPE:-dgf}  # the train/<recipe>.py that CONFIG configures
read -r -a EXTRA <<< "${OVERRIDES:-}"  # key=value overrides of CONFIG (an ablation variant), e.g. drafter.layer_fusion=gated
mkdir -p "$KEEP"
sync_outputs() {  # snapshots -> $KEEP/loss_tokens_<N>/ (once each), newest checkpoint -> $KEEP/resume/
  for snap in "$RUN"/snapshots/loss_tokens_*; do
    [ -f "$snap/snapshot.json" ] && [ ! -d "$KEEP/$(basename "$snap")" ] && cp -r "$snap" "$KEEP/" \
      && echo "$(date +%H:%M) kept $KEEP/$(basename "$snap")"
  done
  newest=$(newest_numbered "$RUN"/checkpoints/step_*)
  if [ -n "$newest" ] && [ ! -d "$KEEP/resume/$(basename "$newest")" ]; then
    python -m draftsmith.train.checkpoints lean "$newest" "$KEEP/resume" > /dev/null \
      && echo "$(date +%H:%M) resume point $KEEP/resume/$(basename "$newest")"
  fi
  return 0
}
if ls -d "$RUN"/checkpoints/step_* > /dev/null 2>&1; then
  RESUME=(--resume)
elif ls -d "$KEEP"/resume/step_* > /dev/null 2>&1; then
  RESUME=(--resume-from "$(ls -d "$KEEP"/resume/step_* | tail -1)")
else
  RESUME=()
fi
OMP_NUM_THREADS=2 accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no \
  "train/$RECIPE.py" --config "$CONFIG" output_dir="$RUN" "${RESUME[@]}" "${EXTRA[@]}" --no-progress &
TRAIN=$!
trap 'kill $TRAIN 2>/dev/null; wait $TRAIN 2>/dev/null; sync_outputs' TERM INT
while kill -0 $TRAIN 2>/dev/null; do
  sleep "$SYNC_S" & SLEEPER=$!
  wait -n $TRAIN $SLEEPER || true  # wakes when the training ends, not up to SYNC_S later
  kill $SLEEPER 2>/dev/null || true
  sync_outputs
done
wait $TRAIN || true
sync_outputs
echo "$(date +%H:%M) curve job ended"
