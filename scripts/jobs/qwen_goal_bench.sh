#!/usr/bin/env bash
# The goal bench for Qwen2.5-Coder-1.5B-Instruct (fp32 target, compiled backend, 2 threads): the
# goal bench's prompts (NUM prompts per suite, MT-Bench both turns, GSM8K, HumanEval, 128 new tokens), both
# plain baselines (HF eager `generate` = plain, plain-compiled) in the same run, every output checked against
# plain greedy. The draft-cost levers of the 0.5B drafter, one at a time:
#   lm-chain:budget=4                       the off-the-shelf 0.5B as before (full 151,936-token head)
#   $CHEAP                                  its head sliced to the committed 32k draft vocabulary and a dynamic
#                                           chain length (stop_below), up to 8 tokens
#   cascade [ngram min_n=2, $CHEAP]         prompt lookup first, the cheap chain otherwise
# The bench writes progress.jsonl per conversation: a rerun with the same settings continues where it
# stopped (commit the folder to carry a partial run to the next session; it then reports resumed rows).
# NUM=5 took 87 min on the 2-core AMD EPYC of 2026-11-26 (a slow day: target step 465 ms); NUM=10 takes about
# twice that, HF=1 (HF assisted generation) about a fifth more: split it over sessions by committing OUT.
#   NUM=10 HF=1 OUT=results/qwen_draft_cost/bench bash scripts/jobs/qwen_goal_bench.sh
# CHAIN4=0 leaves out the chain of 4 (the lever's "before" row, measured at NUM=5): the goal run of 2026-11-26
# (the first study) is   NUM=10 HF=1 CHAIN4=0 OUT=results/qwen_draft_cost/bench bash scripts/jobs/qwen_goal_bench.sh
# HF=1's row is HF's assisted generation with transformers' defaults for the assistant: up to 20 tokens a round,
# stopped by its confidence threshold (0.4 to start, adapted per call when scikit-learn is installed).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/jobs/qwen15_goal_bench.sh
NUM=${NUM:-10}
OUT=${OUT:-results/qwen_draft_cost/bench}
STOP=${STOP:-0.3}
VOCAB=drafters/qwen2.5-coder_vocab_32768
[ -f $VOCAB/draft_vocab.safetensors ] || bash scripts/jobs/vocab_qwen.sh
CHEAP="lm-chain:budget=8,vocab=$VOCAB,stop_below=$STOP"
METHODS="plain-compiled $CHEAP cascade:drafters=[(ngram:min_n=2),($CHEAP)]"
[ "${CHAIN4:-1}" = 1 ] && METHODS="plain-compiled lm-chain:budget=4 ${METHODS#plain-compiled }"
[ "${HF:-0}" = 1 ] && METHODS="$METHODS hf-assisted"
qwen15_goal_bench "$OUT" "$METHODS"
