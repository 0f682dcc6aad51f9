#!/usr/bin/env bash
# CPU-budget distillation of Qwen2.5-Coder-0.5B-Instruct toward Qwen2.5-Coder-1.5B-Instruct.
#   stage 1: the 1.5B target's top-32 logits over N GSM8K-train answers it wrote itself
#            (outputs/regen_qwen15_gsm8k, data.regenerate; wrong final answers dropped), or over the
#            gold GSM8K-train answers when that regeneration is not available
#            (stored in float32: bf16-rounded logits put a ~0.06 nat FKL floor under a perfect student)
#   stage 2: LoRA forward-KL training of the 0.5B student on the cache (train/configs/distill_qwen_cpu.yaml)
# Both stages resume when rerun. Usage (shared 2-core CPU: under the lock, with a timeout):
#   flock /tmp/draftsmith_cpu.lock timeout 1150 env OMP_NUM_THREADS=2 bash scripts/distill_qwen_cpu.sh > outputs/distill_qwen/train.log 2>&1
set -euo pipefail
N=${N:-32}
OUT=outputs/distill_qwen
mkdir -p $OUT
python - <<PY
import json, logging, time
from pathlib import Path
from data.features import FeatureCacheConfig, build_feature_cache
from data.regenerate import CHECKERS, load_regenerated
from data.sources import load_source

logging.basicConfig(level=logging.INFO)
regen = Path("outputs/regen_qwen15_gsm8k")
choice = Path("$OUT/data_choice.json")
if choice.exists():  # a rerun keeps the first run's choice (the cache plan must not change)
    kind = json.loads(choice.read_text())["kind"]
else:
    try:
        kind = "regenerated" if load_regenerated(regen, require_complete=True) else "gold"
    except Exception as err:
        print("regenerated data unavailable:", err)
        kind = "gold"
if kind == "regenerated":
    convs = load_regenerated(regen)
    wrong = [c for c in convs if CHECKERS[c.source](c) is False]
    convs = [c for c in convs if CHECKERS[c.source](c) is not False]
    stats = {"kind": kind, "source": str(regen), "regenerated": len(convs) + len(wrong), "wrong_dropped": len(wrong)}
else:
    convs = load_source("gsm8k:train", limit=$N)
    stats = {"kind": kind, "source": "gsm8k:train (gold answers)"}
convs = convs[:$N]
stats["used"] = len(convs)
choice.write_text(json.dumps(stats, indent=2))
print(stats)
t0 = time.perf_counter()
res = build_feature_cache(FeatureCacheConfig(model="qwen2.5-coder-1.5b-instruct", source=None,
                                             output_dir="$OUT/cache_top32", hidden_layers=(-1,), topk_logits=32,
                                             max_length=320, shard_tokens=2048, dtype="float32", storage_dtype="float32", num_threads=2,
                                             progress=False), records=convs)
print(res, "seconds", round(time.perf_counter() - t0, 1))
PY
WANDB_MODE=offline python train/distill.py --config train/configs/distill_qwen_cpu.yaml --resume
