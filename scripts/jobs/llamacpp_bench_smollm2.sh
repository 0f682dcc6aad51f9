#!/usr/bin/env bash
# SmolLM2-135M-Instruct in llama.cpp (f32 and q8_0 GGUF), plain decoding against its n-gram modes, on the
# goal bench's prompts (10 per suite, MT-Bench both turns, GSM8K, HumanEval, 128 new tokens, greedy, 2 threads);
# the f32 run also times the toolkit's PyTorch plain baselines on the same prompts. Background data jobs are paused
# while it runs (scripts/jobs/quiet.sh). Results: results/llamacpp/smollm2_<type>_<cpu>.{json,md}.
#   bash scripts/jobs/llamacpp_bench_smollm2.sh
set -euo pipefail
CPU=${CPU:-$(grep -m1 "model name" /proc/cpuinfo | grep -qi amd && echo epyc || echo xeon)}
CONFIG=eval/configs/llamacpp_ngram_smollm2.yaml  # the protocol: prompts, methods, threads
for TYPE in float32 q8_0; do
  OUT=results/llamacpp/smollm2_${TYPE}_${CPU}.json
  [ -f "$OUT" ] && continue
  BASELINES=false; [ "$TYPE" = float32 ] && BASELINES=true
  scripts/jobs/quiet.sh python -m draftsmith.eval.engines.llamacpp_bench --config "$CONFIG" target_type=$TYPE \
    pytorch_baselines=$BASELINES output=$OUT
done
