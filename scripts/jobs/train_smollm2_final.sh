#!/usr/bin/env bash
# SmolLM2: regenerated data -> draft vocabulary -> feature caches -> >= 1 h of training -> bench
# (scripts/jobs/train_smollm2_long.sh continues the drafter and ships it).
# Every step resumes: rerun the script after an interruption. DRAFTER: the ablation's best variant
# (single-layer DGF, 8k draft vocabulary, frozen sliced head: equal tau at a third of the draft step).
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/jobs/regen_smollm2.sh
R=outputs/regen/smollm2
python scripts/regen_report.py $R/gsm8k $R/code $R/sharegpt $R/sharegpt2 --out results/regen_smollm2 --overwrite
SOURCES="conversations:$R/gsm8k conversations:$R/code conversations:$R/sharegpt conversations:$R/sharegpt2"
VOCAB=outputs/vocab/smollm2_final_8192
[ -f $VOCAB/draft_vocab.safetensors ] || python -m draftsmith.data.draft_vocab target=smollm2-135m-instruct \
  "sources=$SOURCES" size=8192 output=$VOCAB
CACHES=""
for PART in gsm8k code sharegpt sharegpt2; do
  python -m draftsmith.data.features target=smollm2-135m-instruct source=conversations:$R/$PART \
    hidden_layers=[-1] max_length=384 threads=2 output_dir=outputs/features/smollm2_final_$PART --no-progress
  CACHES="${CACHES:+$CACHES + }outputs/features/smollm2_final_$PART"
done
DRAFTER=${DRAFTER:-"drafter.draft_vocab=$VOCAB drafter.head=slice"}
RESUME=""; [ -d outputs/dgf_smollm2_final/checkpoints ] && RESUME="--resume"
[ -d outputs/dgf_smollm2_final/final ] || OMP_NUM_THREADS=2 accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no \
  train/dgf.py --config train/configs/dgf_smollm2_final.yaml "data.feature_cache=$CACHES" $DRAFTER $RESUME --no-progress
[ -f results/archive/dgf_smollm2_final/training.md ] || python scripts/training_report.py outputs/dgf_smollm2_final --out results/archive/dgf_smollm2_final/training --overwrite
# Chains and small trees: compiled T(4)/T(1) = 1.37 but T(8)/T(1) = 1.97 and T(16)/T(1) = 3.2 on this CPU
# (results/latency/smollm2.md), so Dovetail's 16-node tree cannot pay here.
F=outputs/dgf_smollm2_final/final
TREES="dgf:path=$F,depth=2,topk=1,budget=2 dgf:path=$F,depth=3,topk=1,budget=3 dgf:path=$F,depth=4,topk=1,budget=4"
TREES="$TREES dgf:path=$F,depth=3,topk=2,budget=5 dgf:path=$F,depth=4,topk=4,budget=8"
[ -f results/archive/dgf_smollm2_final/bench.json ] || scripts/jobs/quiet.sh python -m draftsmith.eval.bench --config eval/configs/goal_bench_smollm2.yaml \
  "methods=plain ngram $TREES" output_dir=results/archive/dgf_smollm2_final num_prompts="${NUM:-10}"
