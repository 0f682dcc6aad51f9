# Sourced by the job scripts: `smollm2_goal_bench OUT METHODS [key=value ...]` runs the goal bench for
# SmolLM2-135M-Instruct (10 prompts per suite unless NUM says otherwise, MT-Bench both turns, GSM8K, HumanEval, 128
# new tokens, compiled backend, fp32, both plain baselines, other jobs paused) into OUT, resuming from its
# progress.jsonl; it does nothing when OUT/bench.json exists.
smollm2_goal_bench() {
  local out=$1 methods=$2
  shift 2
  [ -f "$out/bench.json" ] || scripts/jobs/quiet.sh python -m draftsmith.eval.bench target=smollm2-135m-instruct \
    threads=2 num_prompts="${NUM:-10}" max_new_tokens=128 "suites=[mt-bench,gsm8k,humaneval]" "methods=$methods" \
    output_dir="$out" "$@"
}
