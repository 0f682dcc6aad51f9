#!/usr/bin/env bash
# The steps lever and the bundled drafter: continue the SmolLM2 drafter (outputs/dgf_smollm2_final/final,
# from scripts/jobs/train_smollm2_final.sh) for 800 more steps on the same feature caches and draft vocabulary
# (train/configs/dgf_smollm2_long.yaml) -> report -> goal bench beside the 1000-step drafter and prompt lookup
# (compiled, 10 prompts per suite, MT-Bench round-robin over its 8 categories and both turns, 128 new tokens,
# background jobs paused) -> the bundled bf16 drafter (the shape with the best headline speedup) -> the README's
# first command timed on a fresh cache. Every step resumes or skips when done: rerun after an interruption.
set -euo pipefail
CACHES="outputs/features/smollm2_final_gsm8k + outputs/features/smollm2_final_code"
CACHES="$CACHES + outputs/features/smollm2_final_sharegpt + outputs/features/smollm2_final_sharegpt2"
RESUME=""; [ -d outputs/dgf_smollm2_long/checkpoints ] && RESUME="--resume"
[ -d outputs/dgf_smollm2_long/final ] || OMP_NUM_THREADS=2 accelerate launch --num_processes 1 --num_machines 1 \
  --mixed_precision no --dynamo_backend no train/dgf.py --config train/configs/dgf_smollm2_long.yaml \
  "data.feature_cache=$CACHES" drafter.draft_vocab=outputs/vocab/smollm2_final_8192 drafter.head=slice $RESUME \
  --no-progress
[ -f results/dgf_smollm2_long/training.md ] || python scripts/training_report.py outputs/dgf_smollm2_long \
  --out results/dgf_smollm2_long/training
OLD=outputs/dgf_smollm2_final/final
NEW=outputs/dgf_smollm2_long/final
METHODS="plain ngram dgf:path=$OLD,depth=2,topk=1,budget=2 dgf:path=$NEW,depth=2,topk=1,budget=2"
METHODS="$METHODS dgf:path=$NEW,depth=3,topk=1,budget=3 dgf:path=$NEW,depth=3,topk=2,budget=5"
[ -f results/dgf_smollm2_long/bench.json ] || scripts/jobs/quiet.sh python -m draftsmith.eval.bench \
  target=smollm2-135m-instruct threads=2 num_prompts=10 max_new_tokens=128 "suites=[mt-bench,gsm8k,humaneval]" \
  "methods=$METHODS" output_dir=results/dgf_smollm2_long
BEST=$(python -c "import json; s=json.load(open('results/dgf_smollm2_long/bench.json'))['summary']; \
print(max((m for m in s if m.startswith('dgf:path=$NEW')), key=lambda m: s[m]['headline_speedup']))")
BUNDLE=models/bundled/smollm2-135m-instruct-dgf
[ -d $BUNDLE ] || python scripts/export.py dgf $NEW $BUNDLE layout=dgf dtype=bfloat16 \
  target=smollm2-135m-instruct bench=results/dgf_smollm2_long/bench.json "bench_method=$BEST"
[ -f results/readme_first_command.md ] || scripts/jobs/quiet.sh bash scripts/jobs/readme_first_command.sh
