#!/usr/bin/env bash
# The regenerated half of SmolLM2-135M-Instruct's training data: the target's own greedy answers (f32 GGUF
# in llama.cpp's server, 64 parallel slots on loopback: `engine=llamacpp`, ~110-130 answer tok/s on 2 cores against
# ~53 for HF generate) to ShareGPT (first two user turns), LeetCode statements, python-docstrings and GSM8K train;
# none of them is a test suite (MT-Bench, GSM8K test, HumanEval). The shards are gzipped JSONL written straight
# into datasets/regenerated/smollm2-135m-instruct/<source>/, the folder that is committed, so a new machine resumes
# from git: every shard done is skipped, and a killed run loses at most the shard in progress (~7 min).
# Rounds of a few shards per source keep the mix balanced however long a run lasts. Needs llama.cpp built once
# (`python -m draftsmith.models.engines.llamacpp build`).
#   (nohup nice -n 10 bash scripts/jobs/regenerate_smollm2_data.sh >> outputs/jobs/regenerate_smollm2.log 2>&1 &)
set -euo pipefail
OUT=${OUT:-datasets/regenerated/smollm2-135m-instruct}
COMMON="target=smollm2-135m-instruct engine=llamacpp dtype=float32 batch_size=64 shard_size=256 threads=2
  max_new_tokens=256 max_prompt_tokens=512 compress=true --no-progress"
regen() {  # name source [extra options]: at most SHARDS shards of one source; 1 when it has none left
  local name=$1 source=$2; shift 2
  local said
  if ! said=$(python -m draftsmith.data.regenerate $COMMON source="$source" output_dir="$OUT/$name" \
      max_shards="$SHARDS" "$@"); then
    echo "$(date +%H:%M) regeneration of $name failed; stopping (the shards written so far are kept)" >&2
    exit 1  # a failure is not progress: never loop on it
  fi
  echo "$(date +%H:%M) $said"
  case "$said" in *"wrote 0 shard(s)"*) return 1 ;; *) return 0 ;; esac
}
SHARDS=${SHARDS:-2}
while true; do
  progress=0
  regen sharegpt sharegpt max_turns=2 && progress=1
  regen leetcode leetcode max_turns=1 && progress=1
  regen python-docstrings python-docstrings max_turns=1 && progress=1
  regen gsm8k-train gsm8k:train max_turns=1 && progress=1
  [ "$progress" = 1 ] || break
done
echo "regeneration complete: $OUT"
