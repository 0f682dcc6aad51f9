#!/usr/bin/env bash
# The goal bench for SmolLM2-135M at full size with the bundled drafter (models/bundled, 1800 steps)
# alone, in a cascade and in a union with prompt lookup: the same settings as results/dgf_smollm2_long/bench.md
# (compiled backend, 10 prompts per suite, MT-Bench both turns, GSM8K, HumanEval, 128 new tokens), which the
# union/cascade probe (results/union_probe_smollm2.md) ran on 4 prompts and two suites only. ~21 min on 2 cores,
# other jobs paused. Skips itself when its bench.json exists.
#   DTYPE=bfloat16 bash scripts/jobs/goal_bench_smollm2.sh -> results/goal_bench_smollm2_bf16: the same in bf16.
#   On the Intel Xeon of 2026-11-25 (AVX512-BF16) that was NOT lossless: every speculative method diverged from
#   plain-compiled bf16 greedy within 7 prompts (results/goal_bench_smollm2_bf16/mismatch.log; the bf16 forward
#   over w tokens is not row-for-row identical to w one-token forwards). It reproduces that finding.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/jobs/smollm2_goal_bench.sh
DTYPE=${DTYPE:-float32}
OUT=results/goal_bench_smollm2; [ "$DTYPE" = float32 ] || OUT=${OUT}_bf16
[ "$DTYPE" = float32 ] || [ "$DTYPE" = bfloat16 ] || { echo "DTYPE=$DTYPE: use float32 or bfloat16" >&2; exit 2; }
CHAIN3="dgf:depth=3,topk=1,budget=3"
METHODS="plain ngram dgf $CHAIN3 cascade union union:drafters=[($CHAIN3),ngram]"
smollm2_goal_bench "$OUT" "$METHODS" dtype=$DTYPE
