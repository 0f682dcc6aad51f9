#!/usr/bin/env bash
# The ablation's data (SmolLM2-135M-Instruct): draft vocabularies ranked on the target's own GSM8K
# answers, and one offline feature cache that every variant trains on (layers 2, 15, 27 = EAGLE-3's
# low/mid/high of 30 layers, and -1 = the final normed state for single-layer variants and soft labels).
set -euo pipefail
REGEN=outputs/regen/smollm2/gsm8k
for SIZE in 32768 8192; do
  [ -f outputs/vocab/smollm2_${SIZE}/draft_vocab.safetensors ] || \
    python -m draftsmith.data.draft_vocab target=smollm2-135m-instruct sources=conversations:$REGEN size=$SIZE \
      output=outputs/vocab/smollm2_${SIZE}
done
python -m draftsmith.data.features target=smollm2-135m-instruct source=conversations:$REGEN limit=1000 \
  hidden_layers=[2,15,27,-1] max_length=384 threads=2 output_dir=outputs/features/smollm2_gsm8k_l4 --no-progress
