"""Side-by-side benchmark: plain decoding, HF assisted generation and our decoder with each drafter.

    python -m draftsmith.eval.bench target=qwen2.5-coder-1.5b-instruct draft=qwen2.5-coder-0.5b-instruct \\
        suites="mt-bench gsm8k" num_prompts=8 max_new_tokens=128 \\
        methods="plain hf-assisted lm-chain lm-tree:depth=4,topk=3 ngram" output_dir=results/bench_qwen

Per prompt, every method runs back to back (interleaved, after one warm-up prompt), on the same
prompt tokens and the same number of new tokens, in an order that changes per prompt turn so that each method
follows each other one equally often (what ran before a method changes its speed: `carryover_balanced`). `plain` is HF `generate(do_sample=False)`; its
tokens are the reference every other method must reproduce at temperature 0 (a mismatch is
printed loudly and recorded; `strict=true` makes it fatal). speedup = plain wall time / method wall
time summed over prompts; the per-prompt ratios give a 95% confidence interval. Methods: see
`eval.bench.methods` (`--help` lists them with their options).

Suites: `mt-bench` (both turns by default, `turns=1` for first turns only), `gsm8k` (a sample of the
test set drawn with `seed`), `humaneval`, or any `data.sources` spec (`jsonl:/path/prompts.jsonl`,
...). `num_prompts` is per suite. MT-Bench turn 2: the prompt is the chat template over [question 1,
the target's *plain greedy* answer to question 1, question 2], the same for every method. The
warm-up run uses a fixed prompt, so adding a suite never changes another's sample.

Temperature > 0: outputs are random, so they are not compared token by token; `plain` is HF
`generate(do_sample=True, top_k=0, top_p=1)` (torch seeded per prompt), our methods use speculative
sampling (distributed exactly as the target's sampling: tests/test_decoder_sampling.py), and the
speedup is a ratio of tokens/s.

Outputs in `output_dir` (refused when it holds a finished run, unless --overwrite): progress.jsonl
(each conversation's results as it finishes; a re-run of the same config continues from it), bench.json
(config, machine, summary with per-suite/per-category/per-turn breakdowns, per-prompt rows with
every method's tokens, policy state), bench.md (tables), PNG plots (eval.report), and with
`wandb=true` a W&B run (offline when there is no network).
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from draftsmith.config import (ConfigError, Unread, check_config, command_parser, config_to_dict, option,
                               parse_command, refuse_unread, section)
from draftsmith.data.chat import prompt_ids
from draftsmith.errors import UserError, exit_with
from draftsmith.eval.bench.build_context import require_invariant_kernels
from draftsmith.eval.bench.progress import Progress
from draftsmith.eval.decode.decoder import BUDGET_LIMIT, PREFIX_CACHE, DecodeConfig, DecodeStats, Method
from draftsmith.eval.decode.drafters.base import check_types
from draftsmith.eval.documents import cpu_isa, cpu_model, memory_stall_seconds
from draftsmith.eval.bench.methods import (PLAIN, PLAIN_COMPILED, BuildContext, MethodSpec, build_method, check_labels,
                                          lookup, methods_help, parse_method)
from draftsmith.eval.prompts import (PromptSettings, category_of, check_suites, num_turns, select_conversations,
                                    turn_input_ids)
from draftsmith.eval.bench.report import format_table, log_wandb, write_plots
from draftsmith.fileio import atomic_write, refuse_folder_of_runs
from draftsmith.models.bundled import DEFAULT_TARGET, has_bundled_drafter
from draftsmith.models.compiled import CompileSettings, compile_unread
from draftsmith.models.kernels import KernelIsa, kernels_on, loaded_isa
from draftsmith.models.engine import Backend, sync
from draftsmith.models.precision import weight_count
from draftsmith.models.target import TargetModel, dtype_name, resolve_dtype

# The plain baseline each backend's methods must reproduce token for token at temperature 0.
REFERENCE = {Backend.EAGER: PLAIN, Backend.COMPILED: PLAIN_COMPILED}
WARMUP_MESSAGES = [{"role": "user", "content": "Write two sentences about the sea."}]
RESULTS_FILE = "bench.json"


def uses_compiled(config: "BenchConfig") -> bool:
    """Whether the run measures anything on the compiled engine (its backend, or a method that picks it)."""
    return config.backend is Backend.COMPILED or any(lookup(spec.name).may_compile for spec in config.methods)


def default_methods(target: str) -> list[MethodSpec]:
    """plain, prompt lookup (training-free) and the drafter bundled for the target if any (trained here), alone
    and in the cascade (lookup on a repeated 3-gram, else the drafter); the compiled backend adds plain-compiled."""
    specs = ["plain", "ngram"] + (["dgf", "cascade"] if has_bundled_drafter(target) else [])
    return [parse_method(spec) for spec in specs]


@dataclass
class BenchConfig(PromptSettings):
    target: str = option(DEFAULT_TARGET, "the target: registry name, model directory, hub id or tiny:<family>")
    draft: str | None = option(None, "the draft LM that lm-chain / lm-tree / hf-assisted use by default")
    methods: list[MethodSpec] | None = option(None, "methods to compare (plain is always run); null: plain, "
                                              "ngram + dgf (the target's bundled drafter) where one is bundled")
    temperature: float = option(0.0, "0 = greedy (token-exact check); > 0 = sampling (tau, tokens/s)", ge=0)
    dtype: str = option("float32", "dtype of the target and the draft")
    device: str = option("cpu", "cpu | cuda | cuda:<i> | auto")
    threads: int = option(0, "torch CPU threads (0: torch's default)", ge=0)
    budget_limit: int = option(BUDGET_LIMIT, "the largest tree a drafter may propose (+ the root: the largest "
                                             "bucket)", ge=0)
    prefix_cache: bool = option(PREFIX_CACHE, "our methods start each prompt from their KV cache of the last one "
                                              "where the tokens agree (MT-Bench's second turn, the system prompt)")
    backend: Backend = option(Backend.COMPILED, "engine of our methods: compiled (static shapes, AOT-compiled "
                                                "graphs, cached on disk) or eager")
    compile: CompileSettings = section(CompileSettings, "the compiled backend's buckets, KV capacity, autotuning")
    kernel_isa: KernelIsa | None = option(None, "the batch-invariant kernels' instruction set for the run (null: the "
                                          "CPU's default or DRAFTSMITH_KERNEL_ISA's; avx512_amx: bf16 linear layers "
                                          "on AMX tiles); `plain-compiled:kernel_isa=<set>` times a plain baseline "
                                          "on another set in the same run")
    strict: bool = option(False, "stop at the first output that differs from plain greedy")
    output_dir: str | None = option(None, "where bench.json, bench.md and the plots go (null: print only)")
    plots: bool = option(True, "PNG plots in output_dir")
    wandb: bool = option(False, "log the run to W&B (offline when there is no network)")
    wandb_project: str = option("draftsmith-bench", "W&B project")

    def __post_init__(self):
        check_config(self)
        check_suites(self.suites)
        if self.methods is None:
            self.methods = default_methods(self.target)
        if PLAIN not in self.methods:
            self.methods.insert(0, PLAIN)  # the reference for losslessness and speedup
        if self.backend is Backend.COMPILED and PLAIN_COMPILED not in self.methods:
            self.methods.insert(1, PLAIN_COMPILED)  # the compiled methods' reference
        check_labels(self.methods)
        if self.kernel_isa is not None:
            require_invariant_kernels("kernel_isa", str(self.kernel_isa), Backend.COMPILED, self.compile)
        refuse_unread(self, compile_unread(lambda c: not uses_compiled(c), "read by backend=compiled or a method "
                                                                            "on the compiled engine")
                      + [Unread("kernel_isa", lambda c: not uses_compiled(c), "read by the compiled engine's kernels")])
        if self.backend is Backend.COMPILED and self.budget_limit + 1 > max(self.compile.buckets):
            raise ConfigError(f"budget_limit: {self.budget_limit} plus the root must fit the largest compiled bucket "
                              f"({max(self.compile.buckets)}); lower budget_limit or add a bucket")


# ---------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------


def machine_info(target: TargetModel) -> dict:
    info = {"platform": platform.platform(), "processor": cpu_model(), "isa": cpu_isa(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "device": str(target.device), "dtype": str(target.dtype)}
    if hasattr(os, "getloadavg"):
        info["load_average_at_start"] = os.getloadavg()
    if target.device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(target.device)
    if (isa := loaded_isa()) is not None:  # the compiled engine's kernels (DRAFTSMITH_KERNEL_ISA forces one)
        info["kernel_isa"] = isa
    return info


def memory_stalls(loop_start: float, stall_start: float | None) -> dict:
    """How long the timed loop ran in this process and, where the kernel reports it, how much of that the machine
    stalled on memory (report.py flags a run whose timings include paging)."""
    info = {"timed_loop_s": round(time.perf_counter() - loop_start, 1)}
    stall_end = memory_stall_seconds()
    if stall_start is not None and stall_end is not None:
        info["memory_stall_s"] = round(stall_end - stall_start, 1)
    return info


def timed_run(method: Method, target: TargetModel, config: DecodeConfig, input_ids: torch.Tensor):
    """(tokens, seconds, stats) of one method on one prompt (on its own kernels' instruction set, where it names
    one)."""
    with kernels_on(method.kernel_isa):
        decoder = method.make_decoder(target, config)
        sync(target.device)
        start = time.perf_counter()
        result = decoder.generate(input_ids.to(target.device))
        sync(target.device)
        return result.tokens, time.perf_counter() - start, result.stats


@dataclass
class BenchState:
    """Everything a run carries from prompt to prompt."""

    config: BenchConfig
    context: BuildContext
    methods: dict[MethodSpec, Method]
    decode: DecodeConfig
    runs: dict[MethodSpec, dict]
    rows: list

    def backend_of(self, method: Method) -> Backend:
        return method.backend or self.config.backend


def build_methods(config: BenchConfig, context: BuildContext) -> dict[MethodSpec, Method]:
    """The config's methods, plus the plain reference of every backend a method runs on (an `arca:` profile
    can pick the compiled engine in an eager run), references first."""
    methods = {spec: build_method(spec, context) for spec in config.methods}
    backends = {method.backend or config.backend for method in methods.values()}
    missing = [REFERENCE[b] for b in sorted(backends) if REFERENCE[b] not in methods]
    added = {spec: build_method(spec, context) for spec in missing}
    first = {spec: methods.pop(spec) for spec in REFERENCE.values() if spec in methods}
    return {**first, **added, **methods}


def check_lossless(state: BenchState, spec: MethodSpec, tokens: list[int], references: dict, where: str) -> None:
    """Compare a method's greedy tokens with the plain run of its own backend; a mismatch is loud. A plain baseline on
    other kernels computes in another order: where its tokens differ it is recorded quietly (the summary's
    other_kernels_differ), not as a lossless method's mismatch."""
    method = state.methods[spec]
    backend = state.backend_of(method)
    reference = references.get(backend)
    if state.config.temperature > 0 or reference is None or tokens == reference:
        return
    state.runs[spec]["mismatches"].append(where)
    if method.kernel_isa is not None:
        return
    tqdm.write(f"!!! MISMATCH: {spec} output differs from {REFERENCE[backend]} greedy on {where} !!!")
    if state.config.strict:
        raise UserError(f"{spec} is not lossless on {where} (strict=true)")


def carryover_balanced(count: int, turn: int) -> list[int]:
    """The order (indices into `count` methods) of prompt turn `turn`: Williams' balanced Latin square, its rows
    and their reverses taken in turn, so that over 2 x `count` turns each method runs right after each other one
    equally often (what ran before a method changes its speed: a compiled forward right after HF eager's
    `generate` runs ~15% slower, and a fixed order made plain-compiled always pay it)."""
    base = [0] + [(k + 1) // 2 if k % 2 else count - k // 2 for k in range(1, count)]
    row = turn % (2 * count) if count else 0
    order = [(index + row) % count for index in base]
    return order if row < count else order[::-1]


def run_prompt_turn(state: BenchState, suite: str, conv, answers: list[str], input_ids: torch.Tensor):
    """Every method on one prompt (turn len(answers) + 1), back to back in a balanced order; returns plain's
    tokens."""
    category, turn = category_of(suite, conv), len(answers) + 1
    row = {"id": conv.id, "suite": suite, "category": category, "turn": turn, "prompt_tokens": input_ids.shape[1]}
    if answers:
        row["history"] = list(answers)
    methods = list(state.methods.items())
    outcomes = {spec: timed_run(method, state.context.target_for(method), state.decode, input_ids)
                for spec, method in (methods[i] for i in carryover_balanced(len(methods), len(state.rows)))}
    references = {backend: outcomes[spec][0] for backend, spec in REFERENCE.items() if spec in outcomes}
    for spec in state.methods:
        tokens, seconds, stats = outcomes[spec]
        state.runs[spec]["runs"].append({"suite": suite, "category": category, "turn": turn, "seconds": seconds,
                                         "tokens": len(tokens), "stats": stats})
        check_lossless(state, spec, tokens, references, f"{conv.id} turn {turn}")
        row[str(spec)] = {"seconds": seconds, "new_tokens": len(tokens), "tokens": tokens,
                          "tokens_per_s": len(tokens) / seconds if seconds > 0 else 0.0,
                          "tau": stats.tau if stats else 1.0, "prefill_s": stats.prefill_s if stats else None,
                          "reused_tokens": stats.reused_tokens if stats else None}
    eager, compiled = references.get(Backend.EAGER), references.get(Backend.COMPILED)
    if state.config.temperature == 0 and len(references) == 2 and eager != compiled:
        row["compiled_vs_hf"] = first_difference(state.context.target, input_ids, eager, compiled)
    state.rows.append(row)
    return references.get(Backend.EAGER)


@torch.inference_mode()
def first_difference(target: TargetModel, input_ids: torch.Tensor, hf: list[int], compiled: list[int]) -> dict:
    """Where compiled greedy first leaves HF eager greedy, and the eager logit margin between the two
    tokens there (a near-tie rounded differently by another kernel has a tiny margin)."""
    position = next(i for i, (a, b) in enumerate(zip(hf + [-1], compiled + [-1])) if a != b)
    prefix = torch.cat([input_ids[0], torch.tensor(hf[:position], dtype=torch.long)])[None].to(target.device)
    logits = target.model(input_ids=prefix).logits[0, -1].float()
    hf_token = hf[position] if position < len(hf) else None
    compiled_token = compiled[position] if position < len(compiled) else None
    margin = None if None in (hf_token, compiled_token) else float(logits[hf_token] - logits[compiled_token])
    return {"position": position, "hf_token": hf_token, "compiled_token": compiled_token, "eager_logit_margin": margin}


def run_conversation(state: BenchState, suite: str, conv, bar) -> None:
    """Every turn of one conversation; turn k + 1 continues from plain greedy's answer to turn k."""
    answers: list[str] = []
    turns = num_turns(conv, state.config.turns)
    tokenizer = state.context.target.tokenizer
    for turn in range(1, turns + 1):
        input_ids = turn_input_ids(tokenizer, conv, answers)
        reference = run_prompt_turn(state, suite, conv, answers, input_ids)
        bar.update(1)
        row = state.rows[-1]
        bar.set_postfix_str(f"{suite} t{turn} " + " ".join(
            f"{spec.label if spec.text else spec.name}={row[str(spec)]['tokens_per_s']:.1f}" for spec in state.methods))
        if turn < turns:
            if state.config.temperature > 0 or reference is None:
                greedy = DecodeConfig(max_new_tokens=state.config.max_new_tokens)
                reference, _, _ = timed_run(state.methods[PLAIN], state.context.target, greedy, input_ids)
            answers.append(tokenizer.decode(reference, skip_special_tokens=True).strip())


# ---------------------------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------------------------


def mean_ci(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of a normal-approximation 95% interval."""
    if not values:
        return float("nan"), float("nan")
    if len(values) == 1:
        return values[0], float("nan")
    return statistics.fmean(values), 1.96 * statistics.stdev(values) / math.sqrt(len(values))


def _rate(run: dict) -> float:
    return run["tokens"] / run["seconds"] if run["seconds"] > 0 else float("nan")


def speedup_entry(runs: list[dict], baseline: list[dict], sampled: bool, total_s: float, tokens_per_s: float) -> dict:
    """Speedup against one baseline (runs[i] and baseline[i] are the same prompt). Greedy: the ratio of
    wall times (the same tokens); sampled: of tokens/s (outputs differ in length). The per-prompt
    ratios give the 95% interval."""
    if sampled:
        ratios = [_rate(run) / _rate(base) for run, base in zip(runs, baseline)]
        speedup = tokens_per_s / (sum(b["tokens"] for b in baseline) / sum(b["seconds"] for b in baseline))
    else:
        ratios = [base["seconds"] / run["seconds"] for run, base in zip(runs, baseline)]
        speedup = sum(b["seconds"] for b in baseline) / total_s
    mean, half = mean_ci(ratios)
    return {"speedup": speedup, "speedup_mean": mean, "speedup_ci95": half}


def aggregate(runs: list[dict], plain_runs: list[dict] | None, sampled: bool,
              compiled_runs: list[dict] | None = None, other_baselines: dict[str, list[dict]] | None = None) -> dict:
    """Totals of one method over some prompt runs, with its speedup against plain (HF eager), against
    plain-compiled when the run has it, and the headline speedup against the fastest of them and of the plain
    baselines on other kernels (`other_baselines`: label -> runs)."""
    total_s = sum(run["seconds"] for run in runs)
    total_tokens = sum(run["tokens"] for run in runs)
    stats = DecodeStats()
    for run in runs:
        if run["stats"] is not None:
            stats.merge(run["stats"])
    forwards = stats.verify_forwards
    entry = {"tokens_per_s": total_tokens / total_s if total_s > 0 else 0.0, "seconds": total_s,
             "new_tokens": total_tokens, "prompts": len(runs), "tau": stats.tau if forwards else None,
             "depth_acceptance": {str(k): v for k, v in stats.depth_acceptance.items()},
             "tree_tokens_per_round": stats.tree_tokens / forwards if forwards else None,
             "prefill_s": stats.prefill_s, "reused_tokens": stats.reused_tokens, "draft_s": stats.draft_s,
             "verify_s": stats.verify_s, "other_s": stats.other_s,
             "draft_ms_per_round": stats.draft_ms_per_round if forwards else None,
             "verify_ms_by_width": {str(w): ms for w, ms in stats.verify_ms_by_width.items()},
             "verify_rounds_by_width": {str(w): n for w, n in sorted(stats.verify_width_rounds.items())}}
    if plain_runs:
        entry.update(speedup_entry(runs, plain_runs, sampled, total_s, entry["tokens_per_s"]))
        plain_tokens = sum(run["tokens"] for run in plain_runs)
        step_ms = 1000 * sum(run["seconds"] for run in plain_runs) / max(plain_tokens, 1)
        entry["target_step_ms"] = step_ms  # one plain decoding step of the target
        if entry["draft_ms_per_round"] is not None:
            entry["draft_step_ratio"] = entry["draft_ms_per_round"] / step_ms
    add_headline(entry, runs, plain_runs, compiled_runs, sampled, total_s, other_baselines or {})
    return entry


def add_headline(entry: dict, runs: list[dict], plain_runs, compiled_runs, sampled: bool, total_s: float,
                 other_baselines: dict[str, list[dict]]) -> None:
    """speedup_compiled (vs plain-compiled) and the headline: the speedup against the fastest baseline."""
    if not plain_runs:
        return
    entry.update(headline_baseline=str(PLAIN), headline_speedup=entry["speedup"])
    if compiled_runs:
        versus = speedup_entry(runs, compiled_runs, sampled, total_s, entry["tokens_per_s"])
        entry.update(speedup_compiled=versus["speedup"], speedup_compiled_ci95=versus["speedup_ci95"])
    rate = lambda rs: sum(r["tokens"] for r in rs) / max(sum(r["seconds"] for r in rs), 1e-12)  # noqa: E731
    baselines = {str(PLAIN_COMPILED): compiled_runs, **other_baselines} if compiled_runs else other_baselines
    fastest = rate(plain_runs)
    for label, baseline in baselines.items():
        if rate(baseline) > fastest:
            fastest = rate(baseline)
            versus = speedup_entry(runs, baseline, sampled, total_s, entry["tokens_per_s"])
            entry.update(headline_baseline=label, headline_speedup=versus["speedup"])


def add_verify_ratios(entry: dict, step_runs: list[dict] | None) -> None:
    """verify_step_ratio_by_width: the in-loop cost of a verify of w tokens over the same backend's plain step in
    the loop (its verify of one token), the decode loop's T(w)/T(1)."""
    stats = DecodeStats()
    for run in step_runs or []:
        if run["stats"] is not None:
            stats.merge(run["stats"])
    step_ms = stats.verify_ms_by_width.get(1)
    if step_ms:
        entry["verify_step_ratio_by_width"] = {w: ms / step_ms for w, ms in entry["verify_ms_by_width"].items()}


GROUPS = {"by_suite": "suite", "by_category": "category", "by_turn": "turn"}


def method_budget(method: Method, spec: MethodSpec) -> int | None:
    """The draft nodes per round the method ran with (its drafter's, which may come from its export), else the
    spec's `budget` option where it has one."""
    if method.drafter is not None and method.drafter.budget is not None:
        return method.drafter.budget
    return spec.options.budget if spec.has_option("budget") else None


def summarize(state: BenchState) -> dict:
    sampled = state.config.temperature > 0
    plain_runs = state.runs[PLAIN]["runs"]
    compiled = state.runs.get(PLAIN_COMPILED, {}).get("runs")
    others = {str(spec): state.runs[spec]["runs"] for spec, method in state.methods.items()
              if method.kernel_isa is not None}  # plain baselines on other kernels
    summary = {}
    for spec, record in state.runs.items():
        runs = record["runs"]
        entry = aggregate(runs, plain_runs, sampled, compiled, others)
        backend = state.backend_of(state.methods[spec])
        entry.update(mismatches=record["mismatches"], family=spec.family(),
                     budget=method_budget(state.methods[spec], spec), backend=backend)
        if (isa := state.methods[spec].kernel_isa) is not None:  # not a lossless method: another arithmetic
            entry.update(kernel_isa=isa, mismatches=[], other_kernels_differ=record["mismatches"])
        step_runs = state.runs.get(REFERENCE[backend], {}).get("runs")  # one plain step of the same backend
        if step_runs and entry["draft_ms_per_round"] is not None:
            entry["target_step_ms"] = 1000 * sum(r["seconds"] for r in step_runs) / max(
                sum(r["tokens"] for r in step_runs), 1)
            entry["draft_step_ratio"] = entry["draft_ms_per_round"] / entry["target_step_ms"]
        add_verify_ratios(entry, step_runs)
        for group, key in GROUPS.items():
            entry[group] = {}
            for value in dict.fromkeys(run[key] for run in runs):
                index = [i for i, run in enumerate(runs) if run[key] == value]
                entry[group][str(value)] = aggregate([runs[i] for i in index], [plain_runs[i] for i in index],
                                                     sampled, [compiled[i] for i in index] if compiled else None,
                                                     {label: [other[i] for i in index] for label, other in
                                                      others.items()})
        if spec == PLAIN:
            for sub in [entry, *(sub for group in GROUPS for sub in entry[group].values())]:
                sub["tau"] = 1.0
        summary[str(spec)] = entry  # the document's key: the spec's canonical text
    return summary


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


def precision_note(dtype: torch.dtype, config: "BenchConfig") -> str | None:
    """What a reduced-precision target means for the lossless check (None in fp32, and None on the compiled backend's
    batch-invariant kernels, where a verify is row for row what one-token steps compute in every precision)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return None
    if config.compile.runs_invariant_kernels(config.backend):
        return None
    return (f"note: {dtype_name(dtype)} without the batch-invariant kernels: a forward over w tokens is not "
            "row-for-row identical to w one-token forwards, and near-ties can flip the argmax, so speculative "
            "outputs may differ from plain greedy (each difference is reported as a MISMATCH); backend=compiled "
            "with compile.kernels=invariant is lossless in every precision")


def load_target(config: BenchConfig, target: TargetModel | None) -> TargetModel:
    """The run's target (the draft model is loaded when a method first reads it: BuildContext)."""
    if config.threads:
        torch.set_num_threads(config.threads)
    return target or TargetModel.from_pretrained(config.target, dtype=config.dtype, device=config.device)


def check_sizes(config: BenchConfig, target: TargetModel) -> None:
    """Sizes the target cannot hold are refused before any work starts, in one line naming the value and its limit:
    new tokens beyond the target's positions, or beyond the compiled engine's KV capacity."""
    positions = target.max_positions
    if positions is not None and config.max_new_tokens >= positions:
        raise ConfigError(f"max_new_tokens={config.max_new_tokens}: {target.name or 'the target'} has {positions} "
                          f"positions, prompt included; use fewer than {positions}")
    need = config.max_new_tokens + config.budget_limit + 1
    if config.backend is Backend.COMPILED and need > config.compile.capacity:
        raise ConfigError(f"max_new_tokens={config.max_new_tokens} with budget_limit={config.budget_limit} needs "
                          f"compile.capacity >= {need} plus the prompt; it is {config.compile.capacity}")


def prepare_engines(context: BuildContext, progress: bool) -> dict:
    """Compile (first run) or load every compiled engine's graphs before anything is timed; returns the
    seconds spent per model (reported on their own, never inside tokens/s)."""
    report = {}
    for engine in context.compiled_engines():
        if progress:
            print(f"[bench] compiled engine for {engine.what} "
                  f"({weight_count(engine.runs) / 1e6:.0f}M weights): buckets "
                  f"{list(engine.buckets)}, cache {engine.directory}", flush=True)
        engine.prepare()
        report[str(engine.directory.name)] = {"model_type": engine.what, "buckets": list(engine.buckets),
                                              "capacity": engine.capacity, **engine.build_seconds(),
                                              "compiled_buckets": sorted(engine.compile_s),
                                              "build_conditions": engine.build_conditions()}
    return report


def check_bench_parts(config, target, draft) -> None:
    """run_benchmark's arguments are the toolkit's types (one line naming the wrong one)."""
    check_types("run_benchmark: ", [
        ("config", config, BenchConfig, "BenchConfig(...)"),
        ("target", target, (TargetModel, type(None)), "a TargetModel or None (config.target is loaded)"),
        ("draft", draft, (TargetModel, type(None)), "a TargetModel or None (config.draft is loaded)")])


def run_benchmark(config: BenchConfig, target: TargetModel | None = None, draft: TargetModel | None = None,
                  progress: bool = True, overwrite: bool = False) -> dict:
    """Run every method on every prompt (and turn) of every suite, interleaved per prompt.

    `target` / `draft`: already-loaded TargetModels (e.g. tiny in-process models in tests); else
    loaded from config.target / config.draft. With an output_dir, each finished conversation is
    written to progress.jsonl and a re-run of the same config continues from it (eval.bench_progress)."""
    check_bench_parts(config, target, draft)
    with kernels_on(config.kernel_isa):
        return run_interleaved(config, target, draft, progress, overwrite)


def run_interleaved(config: BenchConfig, target: TargetModel | None, draft: TargetModel | None, progress: bool,
                    overwrite: bool) -> dict:
    """run_benchmark on the run's kernels."""
    if target is None:
        config.compile.check_dtype(resolve_dtype(config.dtype), [config.backend])
    saved = Progress.open(config.output_dir, config_to_dict(config), overwrite)
    records = [(suite, conv) for suite in config.suites  # before the target loads: a bad suite fails at once
               for conv in select_conversations(suite, config.num_prompts, config.seed)]
    target = load_target(config, target)
    check_sizes(config, target)
    note = precision_note(target.dtype, config)
    if progress and note:
        print(note, flush=True)
    context = BuildContext(target, draft, config.backend, config.compile, greedy=config.temperature == 0,
                           draft_name=config.draft if draft is None else None)
    methods = build_methods(config, context)
    context.check_draft_read()
    for method in methods.values():
        context.target_for(method)  # every engine exists before compiling
    compile_report = prepare_engines(context, progress)
    decode = DecodeConfig(max_new_tokens=config.max_new_tokens, budget_limit=config.budget_limit,
                          temperature=config.temperature, seed=config.seed, prefix_cache=config.prefix_cache)
    machine = machine_info(target)
    state = BenchState(config, context, methods, decode, {spec: {"runs": [], "mismatches": []} for spec in methods},
                       [])
    warmup_ids = torch.tensor([prompt_ids(target.tokenizer, WARMUP_MESSAGES)])
    for method in methods.values():  # warm-up: allocator, kernels, lazy imports
        timed_run(method, context.target_for(method), decode, warmup_ids)
    gc.freeze()  # what is alive now (models, graphs, caches) lives for the run: the cyclic collector stops scanning it
    total = sum(num_turns(conv, config.turns) for _, conv in records)
    loop_start, stall_start = time.perf_counter(), memory_stall_seconds()
    with tqdm(total=total, desc="bench", unit="prompt", disable=not progress, dynamic_ncols=True) as bar:
        for suite, conv in records:
            key = f"{suite}/{conv.id}"
            if saved.restore(key, state):
                bar.update(num_turns(conv, config.turns))
                continue
            before = saved.snapshot(state)
            run_conversation(state, suite, conv, bar)
            saved.append(key, state, before)
    if hasattr(os, "getloadavg"):
        machine["load_average_at_end"] = os.getloadavg()
    machine.update(memory_stalls(loop_start, stall_start))
    policies = {str(spec): info for spec, method in methods.items() if (info := method.summary())}
    return {"config": config_to_dict(config), "machine": machine, "compile": compile_report,
            "models": {"target": target.name or config.target,
                       "draft": (context.draft.name or config.draft) if context.draft else None},
            "suites": list(config.suites), "summary": summarize(state), "policies": policies,
            "resumed_conversations": saved.restored,
            "compiled_vs_hf": [dict(row["compiled_vs_hf"], id=row["id"], turn=row["turn"]) for row in state.rows
                               if "compiled_vs_hf" in row],
            "per_prompt": state.rows}


def check_output_dir(config: BenchConfig, overwrite: bool) -> None:
    """Before any work: refuse an output directory that holds an earlier run (unless overwrite) or other runs."""
    if config.output_dir is None:
        return
    out = Path(config.output_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"output_dir={config.output_dir!r} is a file: give a directory (bench.json, bench.md and "
                        "the plots are written inside it)")
    refuse_folder_of_runs(out, "benchmark")
    if (out / RESULTS_FILE).exists() and not overwrite:
        raise UserError(f"output_dir={config.output_dir!r} already holds {RESULTS_FILE} of an earlier run: pass "
                        "--overwrite to replace it, or choose another output_dir")


def write_outputs(results: dict, config: BenchConfig) -> dict:
    """bench.json + bench.md (+ PNG plots, + a W&B run) for a finished run; returns what was written."""
    table = format_table(results)
    written: dict = {}
    if config.output_dir:
        out = Path(config.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        if config.plots:
            written["plots"] = [str(p) for p in write_plots(results, out / RESULTS_FILE)]
            results["plots"] = [Path(p).name for p in written["plots"]]
        atomic_write(out / RESULTS_FILE, lambda tmp: tmp.write_text(json.dumps(results, indent=2, default=str)))
        md = table + "\n" + "".join(f"\n![{Path(p).stem}]({Path(p).name})\n" for p in written.get("plots", []))
        atomic_write(out / "bench.md", lambda tmp: tmp.write_text(md))
        written.update(json=str(out / RESULTS_FILE), markdown=str(out / "bench.md"))
    if config.wandb:
        files = [Path(p) for p in [written.get("json"), written.get("markdown"), *written.get("plots", [])] if p]
        written["wandb"] = log_wandb(results, config.wandb_project, config.output_dir, files)
    return written


def parse_config(argv: list[str]):
    """(BenchConfig, flags) from the command line (`key=value` overrides, --config, --overwrite)."""
    parser = command_parser("python -m draftsmith.eval.bench", __doc__.split("\n\n")[0], BenchConfig)
    parser.epilog += "\n\n" + methods_help()
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier run's files in output_dir")
    return parse_command(parser, BenchConfig, argv)


def main(argv: list[str]) -> dict:
    config, flags = parse_config(argv)
    check_output_dir(config, flags.overwrite)
    results = run_benchmark(config, overwrite=flags.overwrite)
    print(format_table(results))
    written = write_outputs(results, config)
    if written:
        print("wrote " + ", ".join(str(v) for v in written.values() if not isinstance(v, list))
              + "".join(f", {p}" for p in written.get("plots", [])))
    return results


if __name__ == "__main__":
    exit_with(main)
