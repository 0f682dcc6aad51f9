# Sourced by the Qwen2.5-Coder-1.5B jobs. `build_qwen15` builds the 1.5B's compiled package (7 GB) in a process of
# its own before a bench (built inside the bench beside the 0.5B it needs more than 24 GB, and the bench is killed);
# a no-op where the cache has it. `require_avx512_bf16` stops a job whose bf16 draft LMs would be emulated, and
# slower, on a CPU without AVX512-BF16 (results/qwen_draft_cost.md).
require_avx512_bf16() {
  grep -qw avx512_bf16 /proc/cpuinfo || { echo "error: this CPU has no AVX512-BF16; run it on one that has" >&2; exit 2; }
}
build_qwen15() {
  python -m draftsmith.eval.latency target=qwen2.5-coder-1.5b-instruct "backends=[compiled]" "widths=[1]" repeats=1 \
    threads=2 output=outputs/latency_qwen15_build.json --overwrite > /dev/null
}
