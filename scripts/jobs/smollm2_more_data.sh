#!/usr/bin/env bash
# The data lever for SmolLM2: more chat and code answers (ShareGPT past the first 2400 prompts, the
# LeetCode statements) -> their features -> the 1800-step drafter continued on all caches
# (train/configs/dgf_smollm2_more.yaml) -> report -> goal bench beside the bundled (1800-step) drafter, same
# settings as results/dgf_smollm2_long/bench.md, each drafter also in a cascade / union with prompt lookup. About 3 h of regeneration at ~53 answer tok/s, then ~20 min of
# features, ~1.5 h of training and ~40 min of bench on the 2-core CPU: two 3-hour runs; every step resumes or
# skips when done, so rerun it. Re-bundling (scripts/export.py ... models/bundled/...) is a decision of its own
# on the bench's result, not this script's.
#   (nohup nice -n 15 bash scripts/jobs/smollm2_more_data.sh >> outputs/jobs/smollm2_more.log 2>&1 &)
# Needs the earlier runs' outputs (outputs/regen/smollm2/{gsm8k,code,sharegpt,sharegpt2}, their feature caches,
# outputs/dgf_smollm2_long/final, outputs/vocab/smollm2_final_8192); they were lost with the checkout on 2026-11-25
# (results/dgf_smollm2_more.md), so a rerun starts with scripts/jobs/train_smollm2_final.sh and train_smollm2_long.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
R=outputs/regen/smollm2
COMMON="target=smollm2-135m-instruct max_new_tokens=256 max_turns=1 batch_size=64 shard_size=128 threads=2"
python -m draftsmith.data.regenerate $COMMON max_prompt_tokens=384 source=sharegpt skip=2400 limit=2000 \
  output_dir=$R/sharegpt3 --no-progress
python -m draftsmith.data.regenerate $COMMON max_prompt_tokens=384 source=leetcode output_dir=$R/leetcode \
  --no-progress
python scripts/regen_report.py $R/gsm8k $R/code $R/sharegpt $R/sharegpt2 $R/sharegpt3 $R/leetcode \
  --out results/regen_smollm2_more --overwrite
for PART in sharegpt3 leetcode; do
  python -m draftsmith.data.features target=smollm2-135m-instruct source=conversations:$R/$PART \
    hidden_layers=[-1] topk_logits=32 max_length=384 threads=2 output_dir=outputs/features/smollm2_final_$PART \
    --no-progress
done
CACHES="outputs/features/smollm2_final_gsm8k + outputs/features/smollm2_final_code"
CACHES="$CACHES + outputs/features/smollm2_final_sharegpt + outputs/features/smollm2_final_sharegpt2"
CACHES="$CACHES + outputs/features/smollm2_final_sharegpt3 + outputs/features/smollm2_final_leetcode"
RESUME=""; [ -d outputs/dgf_smollm2_more/checkpoints ] && RESUME="--resume"
[ -d outputs/dgf_smollm2_more/final ] || OMP_NUM_THREADS=2 accelerate launch --num_processes 1 --num_machines 1 \
  --mixed_precision no --dynamo_backend no train/dgf.py --config train/configs/dgf_smollm2_more.yaml \
  "data.feature_cache=$CACHES" drafter.draft_vocab=outputs/vocab/smollm2_final_8192 drafter.head=slice $RESUME \
  --no-progress
[ -f results/dgf_smollm2_more/training.md ] || python scripts/training_report.py outputs/dgf_smollm2_more \
  --out results/dgf_smollm2_more/training
OLD=outputs/dgf_smollm2_long/final
NEW=outputs/dgf_smollm2_more/final
OLD2="dgf:path=$OLD,depth=2,topk=1,budget=2"
NEW2="dgf:path=$NEW,depth=2,topk=1,budget=2"
# The drafters alone, then with prompt lookup (eval/decode/drafters/union.py; outputs/probe/union2: the cascade was the
# fastest of five combinations on 4 prompts per suite): the cascade for the old and the new drafter, the union.
METHODS="plain ngram $OLD2 $NEW2 dgf:path=$NEW,depth=3,topk=2,budget=5"
METHODS="$METHODS cascade:drafters=[(ngram:min_n=2),($OLD2)] cascade:drafters=[(ngram:min_n=2),($NEW2)]"
METHODS="$METHODS union:drafters=[($NEW2),ngram]"
[ -f results/dgf_smollm2_more/bench.json ] || scripts/jobs/quiet.sh python -m draftsmith.eval.bench --config eval/configs/goal_bench_smollm2.yaml \
  "methods=$METHODS" output_dir=results/dgf_smollm2_more num_prompts="${NUM:-10}"
