#!/usr/bin/env bash
# The "toolkit's distilled student" row for SmolLM2-135M-Instruct in llama.cpp: a 6-layer student
# of the target (train/configs/distill_smollm2_student.yaml) distilled for at most BUDGET (default 12m; SIGTERM
# saves a checkpoint, then one more step at train.max_steps writes final/), then llama.cpp's bench on the goal
# bench's prompts (10 per suite, MT-Bench both turns, 128 new tokens, greedy, 2 threads, f32 target): plain,
# ngram-simple, the bundled EAGLE-3 drafter with its best setting (q8_0, drafts of up to 4, p_min 0.5) and the
# student as a draft-simple model (f32 and q8_0; drafts of 3, and of up to 8 with p_min 0.5). Other jobs are
# paused while it times. Results: results/llamacpp/smollm2_student6_float32_<cpu>.{json,md} and
# results/llamacpp/student_smollm2/ (training report).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/jobs/newest.sh
source scripts/jobs/budget.sh
CONFIG=train/configs/distill_smollm2_student.yaml
RUN=${RUN:-outputs/distill_smollm2/student6}
CPU=${CPU:-$(grep -m1 "model name" /proc/cpuinfo | grep -qi amd && echo epyc || echo xeon)}
OUT=results/llamacpp/smollm2_student6_float32_${CPU}.json
[ ! -f "$OUT" ] || { echo "$OUT exists (a committed result): move it away to rerun" >&2; exit 2; }
if [ ! -d "$RUN/final" ]; then
  distill_for_budget $CONFIG "$RUN" "${BUDGET:-12m}"
  if [ ! -d "$RUN/final" ]; then  # the budget stopped it after a checkpoint: one more step writes final/
    newest=$(newest_numbered "$RUN"/checkpoints/step_*)
    python train/distill.py --config $CONFIG output_dir="$RUN" --resume train.max_steps=$((10#${newest##*_} + 1)) \
      --no-progress
  fi
fi
python scripts/training_report.py "$RUN" --out results/llamacpp/student_smollm2/training --overwrite
STUDENT=$RUN/final
EAGLE3=exports/eagle3_smollm2_all_regen  # from the bundled drafter's fp32 source (the bundled copy is bf16)
[ -d "$EAGLE3" ] || python scripts/export.py dgf drafters/eagle3_smollm2_all_regen/loss_tokens_2400000 "$EAGLE3" \
  --layout speculators --target smollm2-135m-instruct
METHODS="ngram eagle3:$EAGLE3,n_max=4,type=q8_0,p_min=0.5 draft:$STUDENT,n_max=3 draft:$STUDENT,n_max=3,type=q8_0"
METHODS="$METHODS draft:$STUDENT,n_max=8,type=q8_0,p_min=0.5"
scripts/jobs/quiet.sh python -m draftsmith.eval.engines.llamacpp_bench target=smollm2-135m-instruct target_type=float32 \
  num_prompts=${NUM:-10} max_new_tokens=128 threads=2 "methods=$METHODS" pytorch_baselines=${BASELINES:-false} \
  output="$OUT"
