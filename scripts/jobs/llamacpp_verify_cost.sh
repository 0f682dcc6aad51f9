#!/usr/bin/env bash
# In one command: what a verify batch costs llama.cpp against one decoding step, per GGUF type
# of the target (the price of every speculative round there). `llama-bench` (the pinned build) runs the target's GGUF
# on batches of 1, 2, 3, 4 and 8 tokens (`-p`), TRIALS times each, `threads` threads, flash attention as each
# FLASH setting says; the table gives ms per batch and each batch's cost in single steps. Other jobs paused.
#   TYPES="float32 bfloat16 q8_0" OUT=results/llamacpp/verify_cost bash scripts/jobs/llamacpp_verify_cost.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
TARGET=${TARGET:-smollm2-135m-instruct}
TYPES=${TYPES:-float32 bfloat16 q8_0}
FLASH=${FLASH:-off on}
TRIALS=${TRIALS:-15}
OUT=${OUT:-results/llamacpp/verify_cost}
mkdir -p "$OUT"
bench=$(python -c 'from draftsmith.models.engines import llamacpp; print(llamacpp.tool("llama-bench"))')
for type in $TYPES; do
  gguf=$(python -c "import sys; from draftsmith.models.engines import llamacpp, zoo
print(llamacpp.cached_gguf(zoo.resolve_model_path(sys.argv[1]), sys.argv[1], sys.argv[2]))" "$TARGET" "$type")
  for flash in $FLASH; do
    scripts/jobs/quiet.sh "$bench" -m "$gguf" -t 2 -p 1,2,3,4,8 -n 0 -r "$TRIALS" -fa "$flash" -o json > "$OUT/${TARGET}_${type}_fa-${flash}.json"
  done
done
python scripts/jobs/llamacpp_verify_cost_table.py "$OUT"/*.json | tee "$OUT/README.md"
