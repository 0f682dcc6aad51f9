# Sourced by the job scripts: `distill_for_budget CONFIG OUT BUDGET [key=value ...]` runs train/distill.py on CONFIG
# into OUT for at most BUDGET (timeout's syntax: 45m, 2h), continuing from OUT's checkpoints when it has some. The
# budget's SIGTERM makes the run save a checkpoint and stop; that ends the function normally (timeout's 124), any
# other failure fails it with the run's status.
distill_for_budget() {
  local config=$1 out=$2 budget=$3
  shift 3
  local resume=() rc=0
  if [ -d "$out/checkpoints" ]; then resume=(--resume); fi
  timeout -s TERM "$budget" python train/distill.py --config "$config" output_dir="$out" "${resume[@]}" "$@" \
    --no-progress || rc=$?
  [ $rc -eq 0 ] || [ $rc -eq 124 ] || return $rc
}
