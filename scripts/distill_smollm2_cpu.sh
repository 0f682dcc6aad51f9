#!/usr/bin/env bash
# CPU-feasible real distillation run + side-by-side bench, one locked job (~12 min on the shared 2-core CPU):
#   stage 1: SmolLM2-135M-Instruct's top-32 logits (float32) over the conversations it regenerated itself
#            (outputs/regen_smollm2_gsm8k [+ outputs/regen_smollm2_sharegpt when complete]; for token-level KD
#            wrong GSM8K answers are kept: the student should imitate the target, right or wrong)
#   stage 2: train/distill.py with train/configs/distill_smollm2_cpu.yaml (every-2-layers student, full FT, FKL)
#   stage 3: eval.bench, the untrained every-2-layers copy (student=every2) vs the distilled one (draft=<dir>),
#            chain and tree, GSM8K-test and MT-Bench, float32
#   flock /tmp/draftsmith_cpu.lock timeout 1000 env OMP_NUM_THREADS=2 bash scripts/distill_smollm2_cpu.sh > outputs/distill_smollm2/run.log 2>&1
set -euo pipefail
OUT=outputs/distill_smollm2
mkdir -p $OUT
python - <<PY
import json, time
from pathlib import Path
from data.features import FeatureCacheConfig, build_feature_cache
from data.regenerate import load_regenerated, merged_index

choice = Path("$OUT/data_choice.json")
if choice.exists():
    dirs = json.loads(choice.read_text())["dirs"]
else:
    dirs = ["outputs/regen_smollm2_gsm8k"]
    extra = Path("outputs/regen_smollm2_sharegpt")
    if extra.is_dir() and merged_index(extra).get("complete"):
        dirs.append(str(extra))
convs = [c for d in dirs for c in load_regenerated(d)]
stats = {"dirs": dirs, "conversations": len(convs),
         "gsm8k_marked_wrong_kept": sum(1 for c in convs if c.meta["regenerated"].get("correct") is False)}
choice.write_text(json.dumps(stats, indent=2))
print(stats, flush=True)
t0 = time.perf_counter()
res = build_feature_cache(FeatureCacheConfig(model="smollm2-135m-instruct", source=None, output_dir="$OUT/cache_top32",
                                             hidden_layers=(-1,), topk_logits=32, max_length=384, shard_tokens=8192,
                                             dtype="float32", storage_dtype="float32", num_threads=2, progress=False),
                          records=convs)
print(res, "seconds", round(time.perf_counter() - t0, 1), flush=True)
PY
WANDB_MODE=offline python train/distill.py --config train/configs/distill_smollm2_cpu.yaml --resume
D=$OUT/run/final
for suite in ${SUITES:-gsm8k mt-bench}; do
  python -m draftsmith.eval.bench --target smollm2-135m-instruct --dtype float32 --suite $suite --num-prompts ${P:-3} \
    --max-new-tokens 64 --threads 2 \
    --methods plain lm-chain:k=4,student=every2 lm-chain:k=4,draft=$D lm-tree:depth=4,topk=2,budget=8,student=every2 \
              lm-tree:depth=4,topk=2,budget=8,draft=$D \
    --out results/distill_smollm2_bench_$suite.json
done
