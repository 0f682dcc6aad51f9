#!/usr/bin/env bash
# The drafter on the kinds of prompt its training mix under-represents (translation,
# summarization, extraction, QA over a given text: the `breadth` source, never trained on), with the goal bench's
# settings (10 prompts per kind, 128 new tokens, compiled backend, fp32, both plain baselines, interleaved per
# prompt): plain, prompt lookup, the drafter alone and the cascade of both. Other jobs pause while it times.
# BESIDE=<another drafter> adds that drafter alone (same tree) to the same run, for a side-by-side comparison.
#   POINT=drafters/eagle3_smollm2_human/loss_tokens_10000000 bash scripts/jobs/breadth_bench_smollm2.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/jobs/newest.sh
POINT=${POINT:-$(newest_numbered drafters/eagle3_smollm2_human/loss_tokens_*)}
OUT=${OUT:-results/breadth_smollm2}
NUM=${NUM:-10}
TREE=${TREE:-depth=3,topk=1,budget=3}  # the curve bench's tree (a chain of 3)
BESIDE_METHOD=${BESIDE:+dgf:path=$BESIDE,$TREE}
METHODS="plain ngram $BESIDE_METHOD dgf:path=$POINT,$TREE cascade:drafters=[(ngram:min_n=2),(dgf:path=$POINT,$TREE)]"
scripts/jobs/quiet.sh python -m draftsmith.eval.bench target=smollm2-135m-instruct threads=2 num_prompts=$NUM \
  max_new_tokens=128 "suites=[breadth:translation,breadth:summarization,breadth:extraction,breadth:qa]" \
  "methods=$METHODS" output_dir="$OUT"
