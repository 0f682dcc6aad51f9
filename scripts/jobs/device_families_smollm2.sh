#!/usr/bin/env bash
# The drafter families for SmolLM2 on a lent GPU (the `device` tool), on the acceptance-vs-data curve's data (the
# same records, order, batch and schedule as on the CPU, the target in the loop); fp32, no TF32, no tracker (W&B is
# not installed there):
#   train   Medusa-1 (train/configs/medusa_smollm2_curve.yaml) for MEDUSA1_S seconds with snapshots up to 40M loss
#           tokens, then Medusa-2 (joint LoRA on the target) to 1M. An H200: ~33k loss tokens/s (10.9M in 330 s).
#   blocks  the runs FAMILIES names, in order: the DFlash drafter (train/configs/dflash_smollm2_curve.yaml) for
#           DFLASH_S seconds (~20k tokens/s in fp32), the distilled 6-layer student
#           (train/configs/distill_smollm2_curve.yaml, lean bf16 snapshots) for STUDENT_S (~25k tokens/s in fp32).
#           Each run resumes from its committed resume point where the payload carried one (drafters/<run>/resume,
#           in .dev/c4 and .dev/c5) and packs into $OUT a lean resume point (weights in bf16, no moments), every
#           snapshot's held-out figures, its metrics and log; DFlash's newest snapshot too (bf16). The other
#           snapshots come back by `snapshots_out NAME COUNT` in calls of their own (a call brings back at most
#           64 MiB); a pack over what the call can still bring back waits on the machine for `pending_out`.
#           An H200 under bf16 autocast: DFlash ~37k loss tokens/s, the student ~25k (the full target's forward,
#           the teacher, dominates its step: autocast gains it nothing).
#           MIXED_PRECISION=bf16: the forwards under autocast (accelerate's mixed precision), AdamW in fp32.
#           medusa1 in FAMILIES: Medusa-1 on from its resume point (drafters/medusa1_smollm2_human/resume, in
#           .dev/c4) for MEDUSA1_S seconds toward its 40M snapshot, packed in float32 (the heads are 4 MB).
#
# A call carries at most 64 MiB with the tracked tree, so drafters/ and results/ leave the index for the calls
# (`slim`; `unpack` puts them back) and the GGUF travels in three parts, one call each, on one warm machine:
#   here:   bash scripts/jobs/device_families_smollm2.sh payload    # .dev/c1 .dev/c2 .dev/c3 (.dev/c4 .dev/c5)
#   here:   bash scripts/jobs/device_families_smollm2.sh slim       # untracks drafters/ results/ (not committed)
#   device: bash scripts/jobs/device_curve_smollm2.sh setup         # carry .dev/c1: install, the GGUF's 1st part
#   device: bash scripts/jobs/device_families_smollm2.sh second     # carry .dev/c2: its 2nd part
#   device: bash scripts/jobs/device_families_smollm2.sh second     # carry .dev/c4, then .dev/c5 (where payload
#                                                                   # made them): DFlash's and the student's resume
#                                                                   # points (24 + 41 MB: one call each)
#   device: bash scripts/jobs/device_families_smollm2.sh train      # carry .dev/c3: the 3rd part and the records;
#                                                                   # converts the target, trains, packs into $OUT
#           (or `blocks`, then `snapshots_out NAME COUNT` without carry)
#   here:   bash scripts/jobs/device_families_smollm2.sh unpack DIR # DIR: the train call's files_at; -> drafters/
# The long runs (DFlash and the student toward 40M loss tokens, several passes over the mix) go on across lent
# machines from the resume points that unpack commits: `payload` puts them into .dev/c4 and .dev/c5, `second` stages
# them on the device, `blocks` resumes from them.
# Rehearsal here (after setup, `second` and convert with DEVICE=cpu STATE=/tmp/rehearse OUT=/tmp/out):
#   DEVICE=cpu MEDUSA1_S=100 MEDUSA2_S=60 MEDUSA1_AT="[2000,4000]" MEDUSA2_AT="[2000]" \
#   OVERRIDES="data.max_length=64 data.max_heldout=4" bash scripts/jobs/device_families_smollm2.sh train
set -euo pipefail
source "$(dirname "$0")/newest.sh"
STAGE=${1:?stage: payload | slim | second | train | blocks | pending_out | snapshots_out NAME COUNT | unpack DIR}
CONFIG=train/configs/medusa_smollm2_curve.yaml
# where each run's results are committed (the 4M fp32 DFlash and student runs stay in ..._human), and the carry
# that takes a long run's resume point to the device
declare -A KEEPS=([medusa1]=drafters/medusa1_smollm2_human [medusa2]=drafters/medusa2_smollm2_human
                  [dflash]=drafters/dflash_smollm2_human_long [student]=drafters/student6_smollm2_human_long)
declare -A RESUME_CARRIES=([dflash]=.dev/c4 [medusa1]=.dev/c4 [student]=.dev/c5)  # DFlash's run is complete (40M)
DFLASH_S=${DFLASH_S:-280}  # wall-clock budget of the DFlash drafter (SIGTERM then saves a checkpoint)
DFLASH_AT=${DFLASH_AT:-[250000,1000000,4000000,10000000,20000000,40000000]}
STUDENT_S=${STUDENT_S:-220}  # of the distilled student (6 of the 30 layers, lean bf16 snapshots)
STUDENT_AT=${STUDENT_AT:-[250000,1000000,4000000,10000000,20000000,40000000]}
FAMILIES=${FAMILIES:-dflash student}  # the blocks stage's runs, in order (medusa1: Medusa-1 on from its resume point)
MIXED_PRECISION=${MIXED_PRECISION:-no}  # bf16: accelerate's autocast around the forwards (AdamW's state fp32)
DEVICE=${DEVICE:-cuda}
MEDUSA1_S=${MEDUSA1_S:-330}  # wall-clock budget of Medusa-1; SIGTERM then saves a checkpoint
MEDUSA2_S=${MEDUSA2_S:-150}  # of Medusa-2 (it stops by itself at its last snapshot)
MEDUSA1_AT=${MEDUSA1_AT:-[250000,1000000,4000000,10000000,20000000,40000000]}
MEDUSA2_AT=${MEDUSA2_AT:-[250000,1000000]}
read -r -a EXTRA <<< "${OVERRIDES:-}"  # key=value overrides of both runs (a rehearsal: data.max_length=64 ...)
STATE=${STATE:-/tmp/draftsmith_device}  # outside the checkout: the tool re-syncs the tree between calls
SLIM_EXCLUDE=$'/drafters/\n/results/\n/models/bundled/*/dgf.safetensors'
export DRAFTSMITH_CACHE=$STATE/cache PYTHONPATH=$STATE/site PYTHONUNBUFFERED=1

pack_run() {  # snapshots, a lean resume point, metrics and log of run $1 -> $OUT/$2.tar.gz.*
  local run=$1 name=$2 newest keep=()
  newest=$(newest_numbered "$run"/checkpoints/step_*)
  # from /tmp: `python -m` puts the working directory first on the path, and the checkout's draftsmith/ folder
  # (without the subpackages) would shadow the linked package
  [ -z "$newest" ] || (cd /tmp && python3 -m draftsmith.train.checkpoints lean "$OLDPWD/$newest" "$OLDPWD/$run/resume" > /dev/null)
  for item in snapshots resume metrics.jsonl train_config.yaml train.log; do [ -e "$run/$item" ] && keep+=("$item"); done
  tar -C "$run" -cf - "${keep[@]}" | gzip -1 | split -b 15m - "$OUT/$name.tar.gz."
}

device_yaml() {  # config $1 with the device's differences (device, packed records, no tracker) -> $2
  sed -e "s/^device: cpu/device: $DEVICE/" -e "s|^  source: .*|  source: \"records:$STATE/records.npz\"|" \
      -e 's/^  run_name: .*/  tracker: none/' "$1" > "$2"
}

stage_inputs() {  # the GGUF's last part, the converted target (once) and the records, on the device
  cp .dev/c3/gguf.part.* "$STATE/" 2>/dev/null || true
  [ -f "$DRAFTSMITH_CACHE/models/smollm2-135m-instruct/model.safetensors" ] || bash "$(dirname "$0")/device_curve_smollm2.sh" convert
  cp .dev/c3/records.npz "$STATE/records.npz"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
}

run_recipe() {  # NAME SECONDS RECIPE CONFIG [key=value ...]: outputs/NAME trained until done or SIGTERM; log kept
  local name=$1 seconds=$2 recipe=$3 config=$4 resume=()
  shift 4
  mkdir -p "outputs/$name"
  # the committed resume point, where the payload carried one and this machine has not gone on from it already
  local point; point=$(newest_numbered "$STATE/${name}_resume"/step_*)  # staged by `second`
  if [ -d "outputs/$name/checkpoints" ]; then resume=(--resume); elif [ -n "$point" ]; then resume=(--resume-from "$point"); fi
  ACCELERATE_MIXED_PRECISION=$MIXED_PRECISION timeout -k 20 -s TERM "$seconds" python3 "$recipe" --config "$config" \
    output_dir="outputs/$name" "$@" "${EXTRA[@]}" "${resume[@]}" --no-progress > "outputs/$name.log" 2>&1 || true
  { grep -v "step .* loss" "outputs/$name.log" | tail -8; grep "step .* loss" "outputs/$name.log" | tail -2; } || true
  cp "outputs/$name.log" "outputs/$name/train.log"
}

train_medusa1() {  # Medusa-1 (train and blocks): on from its resume point where one is staged, until done or SIGTERM
  run_recipe medusa1 "$MEDUSA1_S" train/medusa.py "$STATE/medusa.yaml" "train.snapshots_at_loss_tokens=$MEDUSA1_AT" \
    train.checkpoint_every=500
}

snapshot_names() {  # run $1's snapshot folders by name, in token order; the newest $2 of them (all when unset)
  by_number "$1"/snapshots/loss_tokens_* | tail -n "${2:-+1}" | xargs -r -n1 basename
}

bf16_snapshots() {  # run $1's snapshots named by the rest, weights rounded to bfloat16 in place
  local run=$1 snap; shift
  for snap in "$@"; do (cd /tmp && python3 -m draftsmith.models.artifacts to_bfloat16 "$OLDPWD/$run/snapshots/$snap"); done
}

pack_family() {  # run $1 -> $STATE/packs/$2.tar.gz.*: a lean resume point, every snapshot's held-out figures, the
  # metrics and log, and the newest $3 snapshots, weights in bf16 (a 4th argument float32: as trained, for runs as
  # small as Medusa's heads); `deliver` moves it into $OUT
  local run=$1 name=$2 count=$3 dtype=${4:-bfloat16} newest snaps snap keep=(metrics.jsonl train_config.yaml train.log)
  newest=$(newest_numbered "$run"/checkpoints/step_*)
  [ -z "$newest" ] || (cd /tmp && python3 -m draftsmith.train.checkpoints lean "$OLDPWD/$newest" "$OLDPWD/$run/resume" \
    "$dtype" > /dev/null)
  [ -d "$run/resume" ] && keep+=(resume)
  snaps=$(snapshot_names "$run" "$count")
  [ "$dtype" = float32 ] || bf16_snapshots "$run" $snaps
  for snap in $snaps; do keep+=("snapshots/$snap"); done
  for snap in $(snapshot_names "$run"); do
    [[ " $snaps " == *" $snap "* ]] || keep+=("snapshots/$snap/snapshot.json")
  done
  mkdir -p "$STATE/packs" && rm -f "$STATE/packs/$name".tar.gz.*
  tar -C "$run" -cf - $(cd "$run" && ls -d "${keep[@]}" 2>/dev/null) | gzip -1 | split -b 15m - "$STATE/packs/$name.tar.gz."
}

deliver() {  # the packs in $STATE/packs into $OUT, whole and in the order packed, while they fit what a call
  # brings back (8 files, 64 MiB); what is left waits there for `pending_out` (a call of its own)
  local pack files size used count
  used=$(du -cm "$OUT" | tail -1 | cut -f1); count=$(ls "$OUT" | wc -l)  # what this call's earlier packs hold
  for pack in $(ls -tr "$STATE"/packs/*.tar.gz.aa 2>/dev/null); do
    files=$(ls "${pack%.aa}".*); size=$(du -cm $files | tail -1 | cut -f1)
    if [ $((used + size)) -le 62 ] && [ $((count + $(echo $files | wc -w))) -le 8 ]; then
      mv $files "$OUT/"; used=$((used + size)); count=$((count + $(echo $files | wc -w)))
    else
      echo "$(basename "${pack%.tar.gz.aa}"): left for pending_out (this call brings back ${used} MiB)"
    fi
  done
}

case "$STAGE" in
payload)
  PART_MB=34 bash "$(dirname "$0")/device_curve_smollm2.sh" payload_gguf
  [ -f .dev/curve_records.npz ] || (cd /tmp && env -u DRAFTSMITH_CACHE -u PYTHONPATH python -m draftsmith.data.records \
    pack "sharegpt + gsm8k:train + python-source" "$OLDPWD/.dev/curve_records.npz" --target smollm2-135m-instruct \
    --max-length 1024)
  cp .dev/curve_records.npz .dev/c3/records.npz
  rm -rf "${RESUME_CARRIES[@]}"
  for name in "${!RESUME_CARRIES[@]}"; do  # the long runs' committed resume points, each into its run's carry
    point=$(newest_numbered "${KEEPS[$name]}"/resume/step_*)
    carry=${RESUME_CARRIES[$name]}
    [ -z "$point" ] || { mkdir -p "$carry/${name}_resume" && cp -r "$point" "$carry/${name}_resume/"; }
  done
  du -sh .dev/c?  # each with the slim tree (~6 MiB) under a call's 64 MiB
  ;;
second)  # what this call carries (the GGUF's 2nd part; the long runs' resume points) out of the checkout
  mkdir -p "$STATE"  # (re-synced between calls)
  cp .dev/c2/gguf.part.* "$STATE/" 2>/dev/null || true
  for carry in $(printf '%s\n' "${RESUME_CARRIES[@]}" | sort -u); do  # two runs may share a carry
    for point in "$carry"/*_resume; do [ -d "$point" ] && rm -rf "$STATE/$(basename "$point")" && cp -r "$point" "$STATE/"; done
  done
  ls "$STATE"
  ;;
slim)  # the calls' tree under 64 MiB: untracked and ignored (.git/info/exclude); unpack tracks them again
  git rm -r -q --cached drafters results models/bundled/*/dgf.safetensors
  printf '%s\n' "$SLIM_EXCLUDE" >> .git/info/exclude
  git ls-files -z | du -ch --files0-from=- | tail -1
  ;;
train)
  device_yaml "$CONFIG" "$STATE/medusa.yaml"
  stage_inputs
  train_medusa1
  pack_run outputs/medusa1 medusa1
  run_recipe medusa2 "$MEDUSA2_S" train/medusa.py "$STATE/medusa.yaml" medusa2.enabled=true \
    "train.snapshots_at_loss_tokens=$MEDUSA2_AT" train.checkpoint_every=500
  pack_run outputs/medusa2 medusa2
  ls -la "$OUT"
  ;;
blocks)  # the runs FAMILIES names (dflash, student, medusa1), each on from its resume point, each packed as it stops
  device_yaml "$CONFIG" "$STATE/medusa.yaml"
  device_yaml train/configs/dflash_smollm2_curve.yaml "$STATE/dflash.yaml"
  device_yaml train/configs/distill_smollm2_curve.yaml "$STATE/student.yaml"
  stage_inputs
  for family in $FAMILIES; do
    case "$family" in
    dflash) run_recipe dflash "$DFLASH_S" train/dflash.py "$STATE/dflash.yaml" "train.snapshots_at_loss_tokens=$DFLASH_AT"
            pack_family outputs/dflash dflash 1; deliver ;;
    student) run_recipe student "$STUDENT_S" train/distill.py "$STATE/student.yaml" \
               "train.snapshots_at_loss_tokens=$STUDENT_AT" export.lean=true export.dtype=bfloat16 train.checkpoint_every=100000
             pack_family outputs/student student 0; deliver ;;  # its snapshot (42 MB) by snapshots_out
    medusa1) train_medusa1
             pack_family outputs/medusa1 medusa1 1 float32; deliver ;;
    *) echo "error: FAMILIES: unknown run $family (dflash student medusa1)" >&2; exit 2 ;;
    esac
  done
  ls -la "$OUT"
  ;;
pending_out)  # the packs blocks left behind (over what its call could bring back)
  deliver
  ls -la "$OUT"
  ;;
snapshots_out)  # NAME COUNT: run NAME's newest COUNT snapshots (bf16), in a call of their own
  name=${2:?snapshots_out NAME COUNT}
  count=${3:?snapshots_out NAME COUNT}
  snaps=$(snapshot_names "outputs/$name" "$count")
  bf16_snapshots "outputs/$name" $snaps
  tar -C "outputs/$name" -cf - $(for snap in $snaps; do echo "snapshots/$snap"; done) | gzip -1 | split -b 15m - "$OUT/$name.tar.gz."
  ls -la "$OUT"
  ;;
unpack)
  from=${2:?unpack DIR: the folder holding the files of the train call}
  git reset -q  # drafters/ and results/ tracked again (slim)
  grep -vxF -f <(printf '%s\n' "$SLIM_EXCLUDE") .git/info/exclude > .git/info/exclude.new || true
  mv .git/info/exclude.new .git/info/exclude
  for name in "${!KEEPS[@]}"; do  # every run the table names, whose pack this call brought back
    [ -n "$(ls "$from"/$name.tar.gz.* 2>/dev/null)" ] || continue
    rm -rf ".dev/$name" && mkdir -p ".dev/$name" && cat "$from"/$name.tar.gz.* | gunzip | tar -C ".dev/$name" -xf -
    keep=${KEEPS[$name]}
    mkdir -p "$keep"
    for snap in .dev/$name/snapshots/loss_tokens_*; do  # weights (a snapshot.json alone: its figures, below)
      [ -n "$(ls "$snap"/*.safetensors 2>/dev/null)" ] && cp -rn "$snap" "$keep/"
    done
    python3 - "$keep/snapshots.json" ".dev/$name/snapshots" <<'PY'  # every snapshot's held-out figures, one file
import json, sys
from pathlib import Path
out = Path(sys.argv[1]); table = json.loads(out.read_text()) if out.exists() else {}
for f in Path(sys.argv[2]).glob("*/snapshot.json"):
    table[f.parent.name] = json.loads(f.read_text())
out.write_text(json.dumps(dict(sorted(table.items(), key=lambda kv: int(kv[0].rsplit("_", 1)[1]))), indent=1) + "\n")
PY
    [ -d ".dev/$name/resume" ] && rm -rf "$keep/resume" && cp -r ".dev/$name/resume" "$keep/resume"
    if [ -f ".dev/$name/train.log" ]; then  # a resumed run's metrics and log go on after the committed ones
      if grep -q "resumed from" ".dev/$name/train.log" && [ -f "$keep/metrics.jsonl" ]; then
        # only the steps after the committed ones: a run resumed on the same machine wrote on in its own file
        added=$(python3 - "$keep/metrics.jsonl" ".dev/$name/metrics.jsonl" <<'PY'
import json, sys
kept = open(sys.argv[1]).read().splitlines()
last = max((json.loads(line)["step"] for line in kept if line.strip()), default=-1)
new = [line for line in open(sys.argv[2]).read().splitlines() if line.strip() and json.loads(line)["step"] > last]
open(sys.argv[1], "a").write("".join(line + "\n" for line in new))
print(len(new))
PY
)
        # the log goes on only when its run added steps: the same files unpacked twice leave it as it was
        if [ "$added" -gt 0 ]; then cat ".dev/$name/train.log" >> "$keep/train.log"; fi
      else
        cp ".dev/$name/metrics.jsonl" ".dev/$name/train.log" "$keep/"
      fi
    fi
    ls "$keep"
  done
  ;;
*) echo "unknown stage $STAGE: payload | slim | second | train | blocks | pending_out | snapshots_out NAME COUNT | unpack DIR" >&2; exit 2 ;;
esac
