#!/usr/bin/env bash
# The drafter ablation, SmolLM2-135M-Instruct: every variant trains on the same cache for the same steps
# (train/configs/dgf_ablation_smollm2.yaml), then one bench compares them side by side.
# Data first: scripts/jobs/ablation_data_smollm2.sh. Resumable: a finished variant is skipped.
set -euo pipefail
OUT=outputs/ablation/smollm2
V32=outputs/vocab/smollm2_32768
V8=outputs/vocab/smollm2_8192
declare -A VARIANTS=(
  [full-l1-m1]="drafter.feature_layer=-1"
  [v32k-l1-m1]="drafter.draft_vocab=$V32 drafter.head=slice"
  [v8k-l1-m1]="drafter.draft_vocab=$V8 drafter.head=slice"
  [v8k-l3linear-m1]="drafter.draft_vocab=$V8 drafter.head=slice drafter.multi_layer=true drafter.layer_fusion=linear"
  [v8k-l3gated-m1]="drafter.draft_vocab=$V8 drafter.head=slice drafter.multi_layer=true drafter.layer_fusion=gated"
  [v8k-l3linear-m2]="drafter.draft_vocab=$V8 drafter.head=slice drafter.multi_layer=true drafter.layer_fusion=linear drafter.num_blocks=2"
  [v8k-l3-eagle3-m1]="drafter.draft_vocab=$V8 drafter.head=own drafter.multi_layer=true drafter.fusion=eagle3"
)
ORDER="full-l1-m1 v32k-l1-m1 v8k-l1-m1 v8k-l3linear-m1 v8k-l3gated-m1 v8k-l3linear-m2 v8k-l3-eagle3-m1"
for NAME in $ORDER; do
  [ -d $OUT/$NAME/final ] && continue
  RESUME=""; [ -d $OUT/$NAME/checkpoints ] && RESUME="--resume"
  OMP_NUM_THREADS=2 accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no train/dgf.py \
    --config train/configs/dgf_ablation_smollm2.yaml output_dir=$OUT/$NAME logging.run_name=ablation-$NAME \
    ${VARIANTS[$NAME]} $RESUME --no-progress
done
METHODS="plain plain-compiled"
for NAME in $ORDER; do METHODS="$METHODS dgf:path=$OUT/$NAME/final"; done
python -m draftsmith.eval.bench target=smollm2-135m-instruct backend=eager threads=2 turns=1 num_prompts=5 \
  max_new_tokens=64 "suites=[gsm8k,mt-bench]" "methods=[${METHODS// /,}]" output_dir=results/archive/ablation_vocab_smollm2
