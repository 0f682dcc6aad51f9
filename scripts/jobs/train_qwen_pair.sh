#!/usr/bin/env bash
# The Qwen2.5-Coder pair on the 2-core CPU: the 1.5B's own answers -> one 1.5B pass over them
# (last normed hidden state + top-32 logits) -> a 1.5B feature drafter (dgf) and the distilled 0.5B student
# (forward KL on the stored logits) -> bench against the original 0.5B, HF assisted generation and both plain
# baselines, compiled fp32. Every step resumes: rerun after an interruption. Run after the SmolLM2 job.
set -euo pipefail
bash scripts/jobs/regen_qwen15.sh
R=outputs/regen/qwen15
T=qwen2.5-coder-1.5b-instruct
python scripts/regen_report.py $R/gsm8k $R/code $R/sharegpt --out results/regen_qwen15 --overwrite
VOCAB=outputs/vocab/qwen15_final_32768
# Token frequencies only: the 1.5B's few answers plus SmolLM2's 5,203 regenerated conversations (same prompt
# sources), counted with the Qwen tokenizer, rank the 32k draft tokens better than ~200 answers alone.
S=outputs/regen/smollm2
SMOL="conversations:$S/gsm8k,conversations:$S/code,conversations:$S/sharegpt,conversations:$S/sharegpt2"
[ -f $VOCAB/draft_vocab.safetensors ] || python -m draftsmith.data.draft_vocab target=$T \
  "sources=[conversations:$R/gsm8k,conversations:$R/code,conversations:$R/sharegpt,$SMOL]" size=32768 output=$VOCAB
CACHES=""
for PART in gsm8k code sharegpt; do
  python -m draftsmith.data.features target=$T source=conversations:$R/$PART hidden_layers=[-1] topk_logits=32 \
    max_length=384 threads=2 output_dir=outputs/features/qwen15_final_$PART --no-progress
  CACHES="${CACHES:+$CACHES + }outputs/features/qwen15_final_$PART"
done
export OMP_NUM_THREADS=2
LAUNCH="accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no"
RESUME=""; [ -d outputs/dgf_qwen15_final/checkpoints ] && RESUME="--resume"
$LAUNCH train/dgf.py --config train/configs/dgf_qwen15_final.yaml "data.feature_cache=$CACHES" \
  drafter.draft_vocab=$VOCAB drafter.head=slice $RESUME --no-progress
python scripts/training_report.py outputs/dgf_qwen15_final --out results/qwen_pair_final/training_dgf --overwrite
RESUME=""; [ -d outputs/distill_qwen_final/checkpoints ] && RESUME="--resume"
$LAUNCH train/distill.py --config train/configs/distill_qwen_final.yaml "data.feature_cache=$CACHES" $RESUME \
  --no-progress
python scripts/training_report.py outputs/distill_qwen_final --out results/qwen_pair_final/training_student --overwrite
D=outputs/dgf_qwen15_final/final
S=outputs/distill_qwen_final/final
# Two bench runs, each with both plain baselines on the same prompts: all seven methods in one process hold
# ~26 GB (the 1.5B eager + its compiled package 14.2 GB, each 0.5B eager + compiled 5 GB, the drafter 2.3 GB)
# and thrashed the 24 GB machine (0.3 tok/s for HF generate), so the trained drafters run beside plain in one
# run and the training-free references (the original 0.5B, HF assisted generation) in the other.
BENCH="python -m draftsmith.eval.bench target=$T backend=compiled threads=2 turns=1 num_prompts=3 max_new_tokens=64"
SUITES="suites=[mt-bench,gsm8k,humaneval]"
METHODS="plain lm-chain:budget=4,model=$S dgf:path=$D,depth=4,topk=1,budget=4 dgf:path=$D,depth=4,topk=4,budget=8"
scripts/jobs/quiet.sh $BENCH "$SUITES" "methods=$METHODS" output_dir=results/qwen_pair_final/bench_trained
scripts/jobs/quiet.sh $BENCH draft=qwen2.5-coder-0.5b-instruct "$SUITES" "methods=plain hf-assisted lm-chain:budget=4" \
  output_dir=results/qwen_pair_final/bench_original
