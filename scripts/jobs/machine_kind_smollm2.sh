#!/usr/bin/env bash
# Every measurement the engine and drafter-family studies keep per machine kind (Intel Xeon, AMD EPYC Zen 4, AMD
# EPYC with AVX2 only), for SmolLM2-135M-Instruct, in priority order: the engine's roofline and goal benches first,
# then the other engines side by side, then the one table of every drafter family and seed policy (their best
# settings, alone and after lookup, in one run), then each family's own study. A step is skipped when its output exists,
# so a later run on a machine of the same kind continues from the committed results where the last one stopped. Every
# timing step runs quiet (scripts/jobs/quiet.sh pauses this checkout's background data and training jobs).
#   bash scripts/jobs/machine_kind_smollm2.sh             # every step not yet done, in order
#   bash scripts/jobs/machine_kind_smollm2.sh list        # the steps, their outputs, which are done
#   ONLY="roofline_float32 goal_float32" bash scripts/jobs/machine_kind_smollm2.sh   # those steps only
#   COMMIT=1 bash scripts/jobs/machine_kind_smollm2.sh    # commit each step's outputs as it finishes
# Outputs: results/roofline/<kind>_<precision>.json, results/engine_kernels_<short>/, results/drafter_families_<short>/
# (<kind> from `python -m draftsmith.eval.documents`; <short>: xeon, zen4, epyc_avx2). On a fresh machine run
# `bash scripts/install.sh` first; the engine steps build llama.cpp and install OpenVINO when they are missing
# (~20 min together), and each precision's compiled target is built on its first use (~5 min).
set -euo pipefail
cd "$(dirname "$0")/../.."
MODE=${1:-run}
KIND=$(python -m draftsmith.eval.documents)
case $KIND in
  intel_xeon) SHORT=xeon ;;
  amd_epyc_zen4) SHORT=zen4 ;;
  amd_epyc_avx2) SHORT=epyc_avx2 ;;
  *) SHORT=$KIND ;;
esac
BF16=$(grep -q -w avx512_bf16 /proc/cpuinfo && echo 1 || echo 0)  # the bf16 steps only where the CPU computes in it
AMX=$(grep -q -w amx_bf16 /proc/cpuinfo && echo 1 || echo 0)  # the AMX steps where it has the tiles
ROOF=results/roofline/$KIND
ENGINE=results/engine_kernels_$SHORT
FAMILIES=results/drafter_families_$SHORT
MEDUSA=drafters/medusa1_smollm2_human/loss_tokens_10000000
MEDUSA_REGEN=drafters/medusa1_smollm2_human_then_regen/loss_tokens_1000000  # the 10M heads continued on the target's answers
ZEN4_ARCA=results/drafter_families_zen4/arca_profile_medusa1_10m  # + .json / _measured.json: what the configs name
EAGLE3=drafters/eagle3_smollm2_all_regen/loss_tokens_2400000  # the bundled drafter's fp32 source
BENCH="python -m draftsmith.eval.bench"
export WANDB_MODE=offline HF_HUB_OFFLINE=1

engines() {  # llama.cpp and OpenVINO, once per machine
  python -m draftsmith.models.engines.llamacpp build
  python -m draftsmith.models.engines.openvino install
}

exports() {  # the drafters as the other engines load them, once per machine (exports/ is not committed)
  [ -d exports/eagle3_smollm2_all_regen ] || python scripts/export.py dgf $EAGLE3 exports/eagle3_smollm2_all_regen \
    --layout speculators --target smollm2-135m-instruct
  [ -d exports/eagle3_smollm2_all_regen_sglang ] || python scripts/export.py dgf $EAGLE3 \
    exports/eagle3_smollm2_all_regen_sglang --layout sglang --target smollm2-135m-instruct
  [ -d exports/dflash_smollm2_4m ] || python scripts/export.py dflash drafters/dflash_smollm2_human/loss_tokens_4000000 \
    exports/dflash_smollm2_4m
  [ -d exports/student6_smollm2_4m ] || python -m draftsmith.models.student expand \
    drafters/student6_smollm2_human/loss_tokens_4000000 exports/student6_smollm2_4m
}

quiet() { scripts/jobs/quiet.sh "$@"; }

with_kind_profile() {  # bench config $1, which names the Zen 4's ARCA profile $2, with this kind's own profile $4
  local config source=$1 zen4=$2 own=${4:-$FAMILIES/arca_profile_medusa1_10m.json}  # (default: of the 10M heads); output $3
  grep -q "arca:$zen4" "$source" || { echo "error: $source no longer names $zen4: mend the runner" >&2; return 2; }
  config=$(mktemp --suffix .yaml)
  sed "s#arca:$zen4#arca:$own#" "$source" > "$config"
  quiet $BENCH --config "$config" output_dir="$3"
}

# name | output (done when it exists; "-": a set-up step, a no-op when done) | needs bf16 (1), AMX (amx) or not (0) |
# command
STEPS=(
  "roofline_float32|$ROOF""_float32.json|0|quiet python -m draftsmith.eval.roofline medusa=$MEDUSA output=$ROOF""_float32.json"
  "roofline_w8a8|$ROOF""_w8a8.json|0|quiet python -m draftsmith.eval.roofline medusa=$MEDUSA compile.weights=w8a8 output=$ROOF""_w8a8.json"
  "roofline_bfloat16|$ROOF""_bfloat16.json|1|quiet python -m draftsmith.eval.roofline medusa=$MEDUSA dtype=bfloat16 output=$ROOF""_bfloat16.json"
  "goal_float32|$ENGINE/goal_bench/bench.json|0|quiet $BENCH --config eval/configs/goal_bench_smollm2.yaml output_dir=$ENGINE/goal_bench"
  "goal_w8a8|$ENGINE/goal_bench_w8a8/bench.json|0|quiet $BENCH --config eval/configs/goal_bench_w8a8_smollm2.yaml output_dir=$ENGINE/goal_bench_w8a8"
  "goal_bfloat16|$ENGINE/goal_bench_bfloat16/bench.json|1|quiet $BENCH --config eval/configs/goal_bench_smollm2.yaml dtype=bfloat16 output_dir=$ENGINE/goal_bench_bfloat16"
  "goal_bfloat16_amx|$ENGINE/goal_bench_bfloat16_amx_two_plains/bench.json|amx|quiet $BENCH --config eval/configs/goal_bench_bfloat16_amx_smollm2.yaml output_dir=$ENGINE/goal_bench_bfloat16_amx_two_plains"
  "goal_cells|$ENGINE/goal_cells/bench.json|0|quiet $BENCH --config eval/configs/goal_cells_smollm2.yaml output_dir=$ENGINE/goal_cells"
  "tree_sizes_int8|$ENGINE/tree_sizes_int8/bench.json|0|quiet $BENCH --config eval/configs/tree_sizes_int8_smollm2.yaml output_dir=$ENGINE/tree_sizes_int8"
  "draft_sizes_int8|$ENGINE/draft_sizes_int8/bench.json|0|quiet $BENCH --config eval/configs/draft_sizes_int8_smollm2.yaml output_dir=$ENGINE/draft_sizes_int8"
  "engines|-|0|engines"
  "llamacpp_f32_plain|$ENGINE/engines/llamacpp_f32_plain_interleaved.json|0|quiet python -m draftsmith.eval.engines.llamacpp_bench methods=plain max_new_tokens=128 num_prompts=10 output=$ENGINE/engines/llamacpp_f32_plain_interleaved.json"
  "openvino_f32_plain|$ENGINE/engines/openvino_f32_plain_interleaved.json|0|quiet python -m draftsmith.eval.engines.openvino_bench methods=plain precision=f32 max_new_tokens=128 num_prompts=10 output=$ENGINE/engines/openvino_f32_plain_interleaved.json"
  "exports|-|0|exports"
  "llamacpp_q8_0_vs_w8a8|$ENGINE/engines/llamacpp_q8_0_vs_w8a8.json|0|quiet python -m draftsmith.eval.engines.llamacpp_bench target_type=q8_0 \"methods=plain ngram eagle3:exports/eagle3_smollm2_all_regen,n_max=3\" pytorch_weights=w8a8 pytorch_methods=[cascade] max_new_tokens=128 num_prompts=10 output=$ENGINE/engines/llamacpp_q8_0_vs_w8a8.json"
  "openvino_bf16_vs_bf16|$ENGINE/engines/openvino_bf16_vs_bf16.json|1|quiet python -m draftsmith.eval.engines.openvino_bench --config eval/configs/openvino_bf16_smollm2.yaml output=$ENGINE/engines/openvino_bf16_vs_bf16.json"
  "long_context_256|$ENGINE/long_context/latency_ctx256.json|0|quiet python -m draftsmith.eval.latency backends=[compiled] widths=[1,4,8] context_tokens=256 compile.capacity=2176 output=$ENGINE/long_context/latency_ctx256.json"
  "long_context_2000|$ENGINE/long_context/latency_ctx2000.json|0|quiet python -m draftsmith.eval.latency backends=[compiled] widths=[1,4,8] context_tokens=2000 compile.capacity=2176 output=$ENGINE/long_context/latency_ctx2000.json"
  "arca_profile|$FAMILIES/arca_profile_medusa1_10m.json|0|quiet python -m draftsmith.eval.arca_profile drafter=medusa:$MEDUSA acceptance=measured output=$FAMILIES/arca_profile_medusa1_10m.json"
  "arca_profile_regen|$FAMILIES/arca_profile_medusa1_regen_int8.json|0|quiet python -m draftsmith.eval.arca_profile drafter=medusa:$MEDUSA_REGEN,weights=int8 \"backends=[compiled]\" acceptance=measured output=$FAMILIES/arca_profile_medusa1_regen_int8.json"
  "families_table_latest|$FAMILIES/families_table_latest/bench.json|0|with_kind_profile eval/configs/families_table_latest_smollm2.yaml results/drafter_families_zen4/arca_profile_medusa1_regen_int8.json $FAMILIES/families_table_latest $FAMILIES/arca_profile_medusa1_regen_int8.json"
  "families_table_dflash40m|$FAMILIES/families_table_dflash40m/bench.json|0|with_kind_profile eval/configs/families_table_dflash40m_smollm2.yaml results/drafter_families_zen4/arca_profile_medusa1_regen_int8.json $FAMILIES/families_table_dflash40m $FAMILIES/arca_profile_medusa1_regen_int8.json"
  "medusa_weights|$FAMILIES/medusa_weights/bench.json|0|with_kind_profile eval/configs/medusa_weights_smollm2.yaml $ZEN4_ARCA""_greedy_int8_rows.json $FAMILIES/medusa_weights"
  "medusa_regen|$FAMILIES/medusa_regen/bench.json|0|quiet $BENCH --config eval/configs/medusa_regen_smollm2.yaml output_dir=$FAMILIES/medusa_regen"
  "student_regen|$FAMILIES/student_regen/bench.json|0|quiet $BENCH --config eval/configs/student_regen_smollm2.yaml output_dir=$FAMILIES/student_regen"
  "dflash_regen|$FAMILIES/dflash_regen/bench.json|0|quiet $BENCH --config eval/configs/dflash_regen_smollm2.yaml output_dir=$FAMILIES/dflash_regen"
  "dflash_regen_more|$FAMILIES/dflash_regen_more/bench.json|0|quiet $BENCH --config eval/configs/dflash_regen_more_smollm2.yaml output_dir=$FAMILIES/dflash_regen_more"
  "dflash_trims|$FAMILIES/dflash_trims/bench.json|0|quiet $BENCH --config eval/configs/dflash_trims_smollm2.yaml output_dir=$FAMILIES/dflash_trims"
  "dflash_nodes|$FAMILIES/dflash_nodes/bench.json|0|quiet $BENCH --config eval/configs/dflash_nodes_smollm2.yaml output_dir=$FAMILIES/dflash_nodes"
  "dflash_regen_1750k|$FAMILIES/dflash_regen_1750k/bench.json|0|quiet $BENCH --config eval/configs/dflash_regen_1750k_smollm2.yaml output_dir=$FAMILIES/dflash_regen_1750k"
  "dflash_prior|$FAMILIES/dflash_prior/bench.json|0|quiet $BENCH --config eval/configs/dflash_prior_smollm2.yaml output_dir=$FAMILIES/dflash_prior"
  "dflash_context|$FAMILIES/dflash_context/bench.json|0|quiet $BENCH --config eval/configs/dflash_context_smollm2.yaml output_dir=$FAMILIES/dflash_context"
  "context_rerank|$FAMILIES/context_rerank/bench.json|0|quiet $BENCH --config eval/configs/context_rerank_smollm2.yaml output_dir=$FAMILIES/context_rerank"
  "dflash_deeper_rerank|$FAMILIES/dflash_deeper_rerank/bench.json|0|quiet $BENCH --config eval/configs/dflash_deeper_rerank_smollm2.yaml output_dir=$FAMILIES/dflash_deeper_rerank"
  "dflash_40m|$FAMILIES/dflash_40m/bench.json|0|quiet $BENCH --config eval/configs/dflash_40m_smollm2.yaml output_dir=$FAMILIES/dflash_40m"
  "dflash_regen_half|$FAMILIES/dflash_regen_half/bench.json|0|quiet $BENCH --config eval/configs/dflash_regen_half_smollm2.yaml output_dir=$FAMILIES/dflash_regen_half"
  "dflash_regen_three_quarters|$FAMILIES/dflash_regen_three_quarters/bench.json|0|quiet $BENCH --config eval/configs/dflash_regen_three_quarters_smollm2.yaml output_dir=$FAMILIES/dflash_regen_three_quarters"
  "dflash_deeper_three_quarters|$FAMILIES/dflash_deeper_three_quarters/bench.json|0|quiet $BENCH --config eval/configs/dflash_deeper_three_quarters_smollm2.yaml output_dir=$FAMILIES/dflash_deeper_three_quarters"
  "dflash_depth_five|$FAMILIES/dflash_depth_five/bench.json|0|quiet $BENCH --config eval/configs/dflash_depth_five_smollm2.yaml output_dir=$FAMILIES/dflash_depth_five"
  "lookup_settings|$FAMILIES/lookup_settings/bench.json|0|quiet $BENCH --config eval/configs/lookup_settings_smollm2.yaml output_dir=$FAMILIES/lookup_settings"
  "lookup_combined|$FAMILIES/lookup_combined/bench.json|0|quiet $BENCH --config eval/configs/lookup_combined_smollm2.yaml output_dir=$FAMILIES/lookup_combined"
  "lookup_bundled|$FAMILIES/lookup_bundled/bench.json|0|quiet $BENCH --config eval/configs/lookup_bundled_smollm2.yaml output_dir=$FAMILIES/lookup_bundled"
  "lookup_longer|$FAMILIES/lookup_longer/bench.json|0|quiet $BENCH --config eval/configs/lookup_longer_smollm2.yaml output_dir=$FAMILIES/lookup_longer"
  "student_activations|$FAMILIES/student_activations/bench.json|0|quiet $BENCH --config eval/configs/student_activations_smollm2.yaml output_dir=$FAMILIES/student_activations"
  "dflash_budget|$FAMILIES/dflash_budget/bench.json|0|quiet $BENCH --config eval/configs/dflash_budget_smollm2.yaml output_dir=$FAMILIES/dflash_budget"
  "medusa_bench|$FAMILIES/medusa_bench/bench.json|0|quiet $BENCH --config eval/configs/medusa_bench_smollm2.yaml output_dir=$FAMILIES/medusa_bench"
  "block_student_bench|$FAMILIES/block_student_bench/bench.json|0|quiet $BENCH --config eval/configs/block_student_bench_smollm2.yaml output_dir=$FAMILIES/block_student_bench"
  "student_draft_cost|$FAMILIES/student_draft_cost/bench.json|0|quiet $BENCH --config eval/configs/student_draft_cost_smollm2.yaml output_dir=$FAMILIES/student_draft_cost"
  "student_budget|$FAMILIES/student_budget/bench.json|0|quiet $BENCH --config eval/configs/student_budget_smollm2.yaml output_dir=$FAMILIES/student_budget"
  "dflash_draft_cost|$FAMILIES/dflash_draft_cost/bench.json|0|quiet $BENCH --config eval/configs/dflash_draft_cost_smollm2.yaml output_dir=$FAMILIES/dflash_draft_cost"
  "dflash_compiled|$FAMILIES/dflash_compiled/bench.json|0|quiet $BENCH --config eval/configs/dflash_compiled_smollm2.yaml output_dir=$FAMILIES/dflash_compiled"
  "seed_policies|$FAMILIES/seed_policies/bench.json|0|with_kind_profile eval/configs/seed_policies_smollm2.yaml $ZEN4_ARCA.json $FAMILIES/seed_policies"
  "policies_after_lookup|$FAMILIES/policies_after_lookup/bench.json|0|with_kind_profile eval/configs/policies_after_lookup_smollm2.yaml $ZEN4_ARCA""_measured.json $FAMILIES/policies_after_lookup"
  "trees|$FAMILIES/trees/bench.json|0|quiet $BENCH --config eval/configs/trees_smollm2.yaml output_dir=$FAMILIES/trees"
  "trees_keep_above|$FAMILIES/trees_keep_above/bench.json|0|quiet $BENCH --config eval/configs/trees_keep_above_smollm2.yaml output_dir=$FAMILIES/trees_keep_above"
  "llamacpp_blocks|$FAMILIES/llamacpp_blocks/bench.json|0|exports && quiet python -m draftsmith.eval.engines.llamacpp_bench --config eval/configs/llamacpp_blocks_smollm2.yaml output=$FAMILIES/llamacpp_blocks/bench.json"
  "sampling|$ENGINE/sampling_bench/bench.json|0|quiet $BENCH --config eval/configs/sampling_bench_smollm2.yaml output_dir=$ENGINE/sampling_bench"
)

chosen() {  # step $1 is in ONLY (or ONLY is empty)
  [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]
}

echo "machine kind: $KIND (results under $ENGINE, $FAMILIES, $ROOF""_*)"
for step in "${STEPS[@]}"; do
  IFS='|' read -r name output needs command <<< "$step"
  chosen "$name" || continue
  if [ "$needs" = 1 ] && [ "$BF16" = 0 ]; then state="not-here (no AVX-512 BF16)"
  elif [ "$needs" = amx ] && [ "$AMX" = 0 ]; then state="not-here (no AMX)"
  elif [ "$output" = - ]; then state=set-up
  elif [ -e "$output" ]; then state=done
  else state=to-do; fi
  if [ "$MODE" = list ] || [ "$state" = done ] || [ "${state%% *}" = not-here ]; then
    printf '%-22s %-9s %s\n' "$name" "${state%% *}" "$output"
    continue
  fi
  echo "== $name -> $output ($(date -u +%H:%M))"
  start=$SECONDS
  [ "$output" = - ] || mkdir -p "$(dirname "$output")"
  eval "$command"
  echo "== $name done in $(((SECONDS - start) / 60)) min"
  if [ -n "${COMMIT:-}" ] && [[ $output == results/* ]]; then
    folder=$(dirname "$output")
    git add "$folder" && git commit -q -m "$name on the $KIND ($SHORT): scripts/jobs/machine_kind_smollm2.sh" -- "$folder"
  fi
done
