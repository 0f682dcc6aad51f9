# Sourced by the job scripts: `qwen15_goal_bench OUT METHODS` runs the goal bench for Qwen2.5-Coder-1.5B-Instruct
# (fp32 target, the 0.5B as draft model, compiled backend, 2 threads, NUM prompts per suite (10 unless set), MT-Bench
# both turns, GSM8K, HumanEval, 128 new tokens, both plain baselines, other jobs paused) into OUT, resuming from its
# progress.jsonl; it does nothing when OUT/bench.json exists. The 1.5B's compiled package (7 GB) is built first in a
# process of its own: built inside the bench beside the 0.5B it needs more than 24 GB and the bench is killed
# That build is a no-op where the cache has it. `require_avx512_bf16` stops a job whose bf16 draft LMs
# would be emulated, and slower, on a CPU without AVX512-BF16 (results/qwen_draft_cost.md).
require_avx512_bf16() {
  grep -qw avx512_bf16 /proc/cpuinfo || { echo "error: this CPU has no AVX512-BF16; run it on one that has" >&2; exit 2; }
}
qwen15_goal_bench() {
  local out=$1 methods=$2
  [ -f "$out/bench.json" ] && return 0
  python -m draftsmith.eval.latency target=qwen2.5-coder-1.5b-instruct "backends=[compiled]" "widths=[1]" repeats=1 \
    threads=2 output=outputs/latency_qwen15_build.json --overwrite > /dev/null
  scripts/jobs/quiet.sh python -m draftsmith.eval.bench target=qwen2.5-coder-1.5b-instruct \
    draft=qwen2.5-coder-0.5b-instruct backend=compiled threads=2 num_prompts="${NUM:-10}" max_new_tokens=128 \
    "suites=[mt-bench,gsm8k,humaneval]" "methods=$methods" output_dir="$out"
}
