#!/usr/bin/env bash
# The toolkit's EAGLE-3 drafter for SmolLM2-135M-Instruct in llama.cpp (--spec-type
# draft-eagle3), against llama.cpp's plain decoding and its best n-gram mode, on the goal bench's prompts (10 per
# suite, MT-Bench both turns, GSM8K, HumanEval, 128 new tokens, greedy, 2 threads), f32 and q8_0 targets. The
# drafter is a committed curve point (POINT, default the newest of drafters/eagle3_smollm2_human), exported in the
# speculators layout and converted by llama.cpp's own converter with the target given. Other jobs are paused while
# it times (scripts/jobs/quiet.sh). Results: results/llamacpp/smollm2_eagle3_<N>_<type>_<cpu>.{json,md}.
# The PyTorch plain baselines of these prompts are in smollm2_float32_<cpu>.json (BASELINES=true times them again).
#   bash scripts/jobs/llamacpp_eagle3_smollm2.sh            TYPES="float32" N_MAX="3 6" to narrow it
#   POINT=drafters/eagle3_smollm2_human_then_regen/loss_tokens_1000000 LABEL=human10M_regen1M bash ...
set -euo pipefail
cd "$(dirname "$0")/../.."
CPU=${CPU:-$(grep -m1 "model name" /proc/cpuinfo | grep -qi amd && echo epyc || echo xeon)}
source scripts/jobs/newest.sh
POINT=${POINT:-$(newest_numbered drafters/eagle3_smollm2_human/loss_tokens_*)}
TYPES=${TYPES:-float32 q8_0}
N_MAX=${N_MAX:-3 6}
NAME=$(basename "$POINT")
LABEL=${LABEL:-${NAME#loss_tokens_}}  # names the results; give one where POINT is not a human curve point
EXPORT=exports/eagle3_smollm2_$LABEL
[ -d "$EXPORT" ] || python scripts/export.py dgf "$POINT" "$EXPORT" layout=speculators target=smollm2-135m-instruct
METHODS="ngram"
for n in $N_MAX; do METHODS="$METHODS eagle3:$EXPORT,n_max=$n"; done
for TYPE in $TYPES; do
  OUT=results/llamacpp/smollm2_eagle3_${LABEL}_${TYPE}_${CPU}.json
  [ -f "$OUT" ] && continue
  scripts/jobs/quiet.sh python -m draftsmith.eval.engines.llamacpp_bench target=smollm2-135m-instruct target_type=$TYPE \
    num_prompts=${NUM:-10} max_new_tokens=128 threads=2 "methods=$METHODS" pytorch_baselines=${BASELINES:-false} \
    output=$OUT
done
