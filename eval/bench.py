"""Side-by-side benchmark: plain greedy, HF assisted generation and our decoder with each drafter.

    python -m draftsmith.eval.bench --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \
        --suite mt-bench --num-prompts 8 --max-new-tokens 128 --dtype bfloat16 \
        --methods plain hf-assisted lm-chain lm-tree ngram --out results/bench_qwen.json

Per prompt, every method runs back to back (interleaved, after one warm-up prompt), on the same
prompt tokens and the same number of new tokens. `plain` is HF `generate(do_sample=False)`; its
tokens are the reference every other method must reproduce at temperature 0 (a mismatch is
printed loudly and recorded; `--strict` makes it fatal). speedup = plain wall time / method wall
time summed over prompts; the per-prompt ratios give a 95% confidence interval.

Method specs: `plain`, `loop-plain` (our loop, no drafter: shows loop overhead), `hf-assisted`
(needs --draft), `lm-chain[:k=4]`, `lm-tree[:depth=4,topk=3,budget=16]` (the --draft model, another one
with `draft=<dir or zoo name>` (e.g. a train/distill.py export), or a layer-subset copy of the target
with `student=every2`), `ngram[:n=3,k=5,branches=1]`,
`medusa:<dir>` (trained heads). Options after ':' are comma-separated key=value pairs.

Suites (`--suite`, comma-separated for several in one run: `--suite mt-bench,gsm8k`): `mt-bench`
(both turns by default, `--turns 1` for first turns only), `gsm8k` (a sample of the test set drawn
with `--seed`), `humaneval`, or any `data.sources` spec (`jsonl:/path/prompts.jsonl`, ...).
`--num-prompts` is per suite. MT-Bench turn 2: the prompt is the chat template over [question 1,
the target's *plain greedy* answer to question 1 (the `plain` method's tokens, decoded), question
2], the same history for every method, so every method sees identical prompt tokens. The warm-up
run uses a fixed prompt (`WARMUP_MESSAGES`), so adding a suite never changes another's sample.

Temperature (`--temperature`): 0 = greedy, every method's tokens are compared with `plain` on every
prompt. At temperature > 0 outputs are random, so they are not compared token by token; `plain` is
HF `generate(do_sample=True, top_k=0, top_p=1)` (torch seeded per prompt), our methods use
speculative sampling (distributed exactly as the target's sampling; the chi-square tests in
tests/test_decoder_sampling.py check that), and the run records tau, tokens/s and the speedup as
a ratio of tokens/s (the methods' outputs differ in length, so wall-time ratios would not compare
equal work).

Outputs (`--out x.json`): x.json (config, machine, summary with per-suite/per-category/per-turn
breakdowns, per-prompt rows), x.md (tables), PNG plots (`x_acceptance.png`, `x_category_tps.png`,
`x_speedup_width.png` when one method kind appears with several tree sizes; see eval.report), and
with `--wandb` a W&B run (offline when there is no network) with the summary table, per-method
metrics, the plots as images and the files as an artifact.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from draftsmith.eval.decoder import DecodeConfig, DecodeStats, SpeculativeDecoder
from draftsmith.eval.drafters.base import Drafter
from draftsmith.eval.drafters.lm import LMDrafter
from draftsmith.eval.drafters.ngram import NgramDrafter
from draftsmith.models.student import every_nth_layer, layer_subset_student
from draftsmith.models.target import TargetModel

SUITES = {"mt-bench": "mt-bench", "gsm8k": "gsm8k:test", "humaneval": "humaneval"}
SAMPLED_SUITES = ("gsm8k",)  # suites drawn as a seeded random sample (the others: the first N records)
WARMUP_MESSAGES = [{"role": "user", "content": "Write two sentences about the sea."}]


@dataclass
class BenchConfig:
    target: str = "smollm2-135m-instruct"
    draft: str | None = None
    methods: list[str] = field(default_factory=lambda: ["plain", "loop-plain", "ngram", "ngram:branches=3"])
    suite: str = "mt-bench"  # mt-bench | gsm8k | humaneval | a load_source spec (e.g. jsonl:/p.jsonl); comma-separated
    num_prompts: int = 4  # per suite
    turns: int = 2  # conversation turns per record (MT-Bench has 2; 1 = first turns only)
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy (token-exact check); > 0 = sampling (tau/tokens/s only)
    dtype: str = "float32"
    device: str = "cpu"
    threads: int = 0  # 0 = torch's default
    seed: int = 0
    max_tree_tokens: int = 64
    strict: bool = False
    out: str | None = None
    plots: bool = True  # PNG plots beside --out
    wandb: bool = False  # log the run to W&B (offline when there is no network)
    wandb_project: str = "draftsmith-bench"


def parse_method(spec: str) -> tuple[str, dict[str, str]]:
    """'lm-tree:depth=4,topk=3' -> ('lm-tree', {'depth': '4', 'topk': '3'});
    'medusa:/dir,width=8' -> ('medusa', {'path': '/dir', 'width': '8'}) (a leading item without '='
    is the `path` option)."""
    kind, _, rest = spec.partition(":")
    options: dict[str, str] = {}
    for index, item in enumerate(rest.split(",") if rest else []):
        key, eq, value = item.partition("=")
        if not eq:
            if index == 0:
                options["path"] = item.strip()
                continue
            raise ValueError(f"bad option {item!r} in method {spec!r}: use key=value")
        options[key.strip()] = value.strip()
    return kind, options


# Methods implemented outside this file: kind -> "module:function". The function is called as
# build(options, target, draft, name) and must pop every option it understands from `options`
# (leftovers are rejected). It returns a Drafter (run by SpeculativeDecoder) or a decoding
# *policy*: any object with make_decoder(target, decode_config) -> obj with .generate((1, T)) ->
# DecodeResult (for methods that change the loop itself: Self-Draft, pipelines, placements).
EXTERNAL_METHODS: dict[str, str] = {
    "medusa": "draftsmith.eval.drafters.medusa:build_from_spec",
    "dovetail": "draftsmith.eval.placement:build_from_spec",
    "hcmp": "draftsmith.eval.hcmp:build_from_spec",
    "arca": "draftsmith.eval.profile:build_from_spec",
    "minions": "draftsmith.eval.drafters.minions:build_from_spec",
    "llmcad": "draftsmith.eval.drafters.llmcad:build_from_spec",
    "self-draft": "draftsmith.eval.selfdraft:build_from_spec",
    "pipeline": "draftsmith.eval.pipeline:build_from_spec",
    "dgf": "draftsmith.eval.drafters.dgf:build_from_spec",
}


def _import_builder(target_path: str):
    import importlib

    module, _, function = target_path.partition(":")
    return getattr(importlib.import_module(module), function)


_EXTRA_DRAFTS: dict[tuple, TargetModel] = {}


def _extra_draft(name_or_path: str, target: TargetModel):
    """(model, tokenizer) of a draft named in a method spec (`lm-chain:draft=<dir>`), loaded once per
    run in the target's dtype and device, so two drafts compare side by side in one run."""
    key = (name_or_path, str(target.dtype), str(target.device))
    if key not in _EXTRA_DRAFTS:
        _EXTRA_DRAFTS[key] = TargetModel.from_pretrained(name_or_path, dtype=target.dtype, device=target.device)
    loaded = _EXTRA_DRAFTS[key]
    return loaded.model, loaded.tokenizer


def build_drafter(spec: str, target: TargetModel, draft: TargetModel | None):
    """A drafter (or decoding policy) from a method spec (None for the plain loop)."""
    kind, opt = parse_method(spec)

    def take(key, default, cast=int):
        return cast(opt.pop(key, default))

    if kind == "loop-plain":
        drafter = None
    elif kind in ("lm-chain", "lm-tree"):
        student = opt.pop("student", None)
        other_draft = opt.pop("draft", None)  # another draft model dir / zoo name than --draft (e.g. a distilled student)
        if other_draft:
            model, tokenizer = _extra_draft(other_draft, target)
        elif student:
            if not student.startswith("every"):
                raise ValueError(f"student={student!r}: use everyN (keep every N-th target layer)")
            layers = every_nth_layer(target.num_layers, int(student[len("every"):]))
            model, tokenizer = layer_subset_student(target.model, layers), target.tokenizer
        elif draft is not None:
            model, tokenizer = draft.model, draft.tokenizer
        else:
            raise ValueError(f"{spec} needs --draft or student=everyN")
        if kind == "lm-chain":
            drafter = LMDrafter(model, tokenizer, mode="chain", num_tokens=take("k", 4), name=spec)
        else:
            drafter = LMDrafter(model, tokenizer, mode="tree", depth=take("depth", 4), topk=take("topk", 3),
                                beam=take("beam", 0) or None, budget=take("budget", 16), name=spec)
    elif kind == "ngram":
        drafter = NgramDrafter(max_ngram=take("n", 3), num_tokens=take("k", 5), num_branches=take("branches", 1),
                               name=spec)
    elif kind in EXTERNAL_METHODS:
        drafter = _import_builder(EXTERNAL_METHODS[kind])(opt, target, draft, spec)
    else:
        known = ["plain", "loop-plain", "hf-assisted", "lm-chain", "lm-tree", "ngram", *sorted(EXTERNAL_METHODS)]
        raise ValueError(f"unknown method {spec!r}; known: {', '.join(known)}")
    if opt:
        raise ValueError(f"unknown option(s) {sorted(opt)} for method {spec!r}")
    return drafter


def split_suites(suite: str) -> list[str]:
    """'mt-bench,gsm8k' -> ['mt-bench', 'gsm8k'] (duplicates and empty items refused)."""
    suites = [item.strip() for item in suite.split(",")]
    if not suite.strip() or any(not item for item in suites):
        raise ValueError(f"bad --suite {suite!r}: give one suite or a comma-separated list, e.g. mt-bench,gsm8k")
    if len(set(suites)) != len(suites):
        raise ValueError(f"--suite {suite!r} names a suite twice")
    return suites


def select_conversations(suite: str, num_prompts: int, seed: int) -> list:
    """`num_prompts` records of one suite: a seeded random sample for GSM8K test, else the first N."""
    from draftsmith.data.sources import load_source

    conversations = load_source(SUITES.get(suite, suite))
    if not conversations:
        raise ValueError(f"suite {suite!r} has no prompts")
    if suite in SAMPLED_SUITES:  # a seeded sample of the test set, as the issue asks
        generator = torch.Generator().manual_seed(seed)
        order = torch.randperm(len(conversations), generator=generator).tolist()
        conversations = [conversations[i] for i in order]
    return conversations[:num_prompts]


def turn_messages(conversation, answers: list[str]) -> list[dict]:
    """Messages of turn len(answers) + 1: the first question, then for each earlier turn the given
    assistant answer and the next follow-up question (MT-Bench turn 2 = [q1, answer 1, q2])."""
    for answer in answers:
        conversation = conversation.next_turn(answer)
    return conversation.prompt_messages()


def turn_input_ids(tokenizer, conversation, answers: list[str]) -> torch.Tensor:
    """(1, T) prompt ids of a turn through the tokenizer's chat template (generation prompt added)."""
    from draftsmith.data.chat import prompt_ids

    return torch.tensor([prompt_ids(tokenizer, turn_messages(conversation, answers))])


def num_turns(conversation, max_turns: int) -> int:
    return 1 + min(len(conversation.followups), max(max_turns, 1) - 1)


def load_prompts(suite: str, num_prompts: int, seed: int, tokenizer) -> list[dict]:
    """First-turn prompts of a suite, tokenised with the target's chat template."""
    return [{"id": conv.id, "category": conv.category, "input_ids": turn_input_ids(tokenizer, conv, [])}
            for conv in select_conversations(suite, num_prompts, seed)]


def category_of(suite: str, conversation) -> str:
    """'mt-bench/writing' for MT-Bench (its own categories), else the suite name."""
    return f"{suite}/{conversation.category}" if conversation.category else suite


def machine_info(target: TargetModel, config: BenchConfig) -> dict:
    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "device": str(target.device), "dtype": str(target.dtype)}
    if hasattr(os, "getloadavg"):
        info["load_average_at_start"] = os.getloadavg()
    if target.device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(target.device)
    return info


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mean_ci(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of a normal-approximation 95% interval."""
    if not values:
        return float("nan"), float("nan")
    if len(values) == 1:
        return values[0], float("nan")
    return statistics.fmean(values), 1.96 * statistics.stdev(values) / math.sqrt(len(values))


def _aggregate(runs: list[dict], plain_runs: list[dict] | None, sampled: bool) -> dict:
    """Totals of one method over some prompt runs (`runs[i]` and `plain_runs[i]` are the same prompt).

    Greedy: speedup = plain wall time / method wall time (the same tokens). Sampled: the ratio of
    tokens/s (outputs differ in length). The per-prompt ratios give the 95% interval either way."""
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
             "draft_s": stats.draft_s, "verify_s": stats.verify_s}
    if plain_runs:
        def rate(run):
            return run["tokens"] / run["seconds"] if run["seconds"] > 0 else float("nan")

        if sampled:
            ratios = [rate(run) / rate(plain) for run, plain in zip(runs, plain_runs)]
            plain_rate = sum(p["tokens"] for p in plain_runs) / sum(p["seconds"] for p in plain_runs)
            speedup = entry["tokens_per_s"] / plain_rate
        else:
            ratios = [plain["seconds"] / run["seconds"] for run, plain in zip(runs, plain_runs)]
            speedup = sum(p["seconds"] for p in plain_runs) / total_s
        mean, half = mean_ci(ratios)
        entry.update(speedup=speedup, speedup_mean=mean, speedup_ci95=half)
    return entry


def run_benchmark(config: BenchConfig, target: TargetModel | None = None, draft: TargetModel | None = None,
                  progress: bool = True) -> dict:
    """Run every method on every prompt (and turn) of every suite, interleaved per prompt.

    `target` / `draft`: already-loaded TargetModels (e.g. tiny in-process models in tests); else
    loaded from config.target / config.draft."""
    from tqdm.auto import tqdm

    if config.threads:
        torch.set_num_threads(config.threads)
    if config.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {config.temperature}")
    suites = split_suites(config.suite)
    target = target or TargetModel.from_pretrained(config.target, dtype=config.dtype, device=config.device)
    if draft is None and config.draft:
        draft = TargetModel.from_pretrained(config.draft, dtype=config.dtype, device=config.device)
    records = [(suite, conv) for suite in suites for conv in select_conversations(suite, config.num_prompts, config.seed)]
    drafters = {m: build_drafter(m, target, draft) for m in config.methods if m not in ("plain", "hf-assisted")}
    if "hf-assisted" in config.methods and draft is None:
        raise ValueError("hf-assisted needs --draft")
    sampled = config.temperature > 0
    decode = DecodeConfig(max_new_tokens=config.max_new_tokens, max_tree_tokens=config.max_tree_tokens,
                          temperature=config.temperature, seed=config.seed)
    machine = machine_info(target, config)

    def hf_generate(input_ids: torch.Tensor, do_sample: bool, **extra) -> list[int]:
        if do_sample:
            torch.manual_seed(config.seed)
            extra.update(temperature=config.temperature, top_k=0, top_p=1.0)
        out = target.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=do_sample,
                                    max_new_tokens=config.max_new_tokens, **extra)
        return out[0, input_ids.shape[1]:].tolist()

    def run(method: str, input_ids: torch.Tensor) -> tuple[list[int], float, DecodeStats | None]:
        input_ids = input_ids.to(target.device)
        _sync(target.device)
        start = time.perf_counter()
        if method in ("plain", "hf-assisted"):
            extra = {"assistant_model": draft.model} if method == "hf-assisted" else {}
            tokens = hf_generate(input_ids, sampled, **extra)
            _sync(target.device)
            return tokens, time.perf_counter() - start, None
        method_object = drafters[method]
        if hasattr(method_object, "make_decoder"):  # a policy that runs its own loop
            decoder = method_object.make_decoder(target, decode)
        else:
            decoder = SpeculativeDecoder(target, method_object, decode)
        result = decoder.generate(input_ids)
        _sync(target.device)
        return result.tokens, time.perf_counter() - start, result.stats

    from draftsmith.data.chat import prompt_ids

    warmup_ids = torch.tensor([prompt_ids(target.tokenizer, WARMUP_MESSAGES)])
    for method in config.methods:  # warm-up: allocator, kernels, lazy imports
        run(method, warmup_ids)

    per_method = {m: {"runs": [], "mismatches": []} for m in config.methods}
    per_prompt = []
    total = sum(num_turns(conv, config.turns) for _, conv in records)
    bar = tqdm(total=total, desc="bench", unit="prompt", disable=not progress, dynamic_ncols=True)
    for suite, conv in records:
        answers: list[str] = []  # the plain greedy answers of earlier turns: the history of the next turn
        turns = num_turns(conv, config.turns)
        for turn in range(1, turns + 1):
            input_ids = turn_input_ids(target.tokenizer, conv, answers)
            category = category_of(suite, conv)
            row = {"id": conv.id, "suite": suite, "category": category, "turn": turn,
                   "prompt_tokens": input_ids.shape[1]}
            if answers:
                row["history"] = list(answers)
            reference = None
            for method in config.methods:
                tokens, seconds, stats = run(method, input_ids)
                if method == "plain":
                    reference = tokens
                record = per_method[method]
                record["runs"].append({"suite": suite, "category": category, "turn": turn, "seconds": seconds,
                                       "tokens": len(tokens), "stats": stats})
                if not sampled and reference is not None and tokens != reference:
                    where = f"{conv.id} turn {turn}"
                    record["mismatches"].append(where)
                    tqdm.write(f"!!! MISMATCH: {method} output differs from plain greedy on {where} !!!")
                    if config.strict:
                        raise AssertionError(f"{method} is not lossless on {where}")
                row[method] = {"seconds": seconds, "new_tokens": len(tokens),
                               "tokens_per_s": len(tokens) / seconds if seconds > 0 else 0.0,
                               "tau": stats.tau if stats else 1.0}
            per_prompt.append(row)
            bar.update(1)
            bar.set_postfix_str(f"{suite} t{turn} " + " ".join(
                f"{m.split(':')[0]}={row[m]['tokens_per_s']:.1f}" for m in config.methods))
            if turn < turns:  # the next turn's history: the target's plain greedy answer to this one
                if sampled or reference is None:
                    history = hf_generate(input_ids.to(target.device), do_sample=False)
                else:
                    history = reference
                answers.append(target.tokenizer.decode(history, skip_special_tokens=True).strip())
    bar.close()

    plain_runs = per_method["plain"]["runs"] if "plain" in per_method else None
    groups = {"by_suite": "suite", "by_category": "category", "by_turn": "turn"}
    summary = {}
    for method, record in per_method.items():
        runs = record["runs"]
        entry = _aggregate(runs, plain_runs, sampled)
        entry["mismatches"] = record["mismatches"]
        for group, key in groups.items():
            entry[group] = {}
            for value in dict.fromkeys(run[key] for run in runs):
                index = [i for i, run in enumerate(runs) if run[key] == value]
                entry[group][str(value)] = _aggregate([runs[i] for i in index],
                                                      [plain_runs[i] for i in index] if plain_runs else None, sampled)
        if method == "plain":
            for sub in [entry, *(sub for group in groups for sub in entry[group].values())]:
                sub["tau"] = 1.0
        summary[method] = entry
    if hasattr(os, "getloadavg"):
        machine["load_average_at_end"] = os.getloadavg()
    models = {"target": target.name or config.target, "draft": (draft.name or config.draft) if draft else None}
    return {"config": asdict(config), "machine": machine, "models": models, "suites": suites, "summary": summary,
            "per_prompt": per_prompt}


def _speed_text(entry: dict) -> str:
    if "speedup" not in entry:
        return "-"
    ci = entry["speedup_ci95"]
    return f"{entry['speedup']:.2f}x" + ("" if math.isnan(ci) else f" (±{ci:.2f})")


def format_table(results: dict) -> str:
    """Markdown: the summary table, then (for several suites / turns / categories) breakdowns."""
    sampled = results["config"].get("temperature", 0.0) > 0
    last = "lossless" if not sampled else "output check"
    lines = [f"| method | tokens/s | tau | speedup (95% CI) | per-depth acceptance | {last} |",
             "|---|---|---|---|---|---|"]
    for method, entry in results["summary"].items():
        tau = "-" if entry["tau"] is None else f"{entry['tau']:.2f}"
        depths = " ".join(f"{v:.2f}" for v in entry["depth_acceptance"].values()) or "-"
        if sampled:
            lossless = "sampled (not compared)"
        else:
            lossless = "yes" if not entry["mismatches"] else f"NO ({len(entry['mismatches'])} prompts)"
        lines.append(f"| {method} | {entry['tokens_per_s']:.2f} | {tau} | {_speed_text(entry)} | {depths} | {lossless} |")
    summary = results["summary"]
    first = next(iter(summary.values()), {})
    for group, title in (("by_suite", "suite"), ("by_turn", "turn")):
        keys = list(first.get(group, {}))
        if len(keys) > 1:
            lines += ["", f"Per {title} (tau / speedup):", "",
                      "| method | " + " | ".join(f"{title} {k}" for k in keys) + " |",
                      "|---|" + "---|" * len(keys)]
            for method, entry in summary.items():
                cells = []
                for key in keys:
                    sub = entry[group].get(key)
                    tau = "-" if sub is None or sub["tau"] is None else f"{sub['tau']:.2f}"
                    cells.append(f"{tau} / {_speed_text(sub) if sub else '-'}")
                lines.append(f"| {method} | " + " | ".join(cells) + " |")
    keys = list(first.get("by_category", {}))
    if len(keys) > 1:
        lines += ["", "Tokens/s per category:", "", "| category | " + " | ".join(summary) + " |",
                  "|---|" + "---|" * len(summary)]
        for key in keys:
            lines.append(f"| {key} | " + " | ".join(
                f"{entry['by_category'][key]['tokens_per_s']:.2f}" if key in entry["by_category"] else "-"
                for entry in summary.values()) + " |")
    machine = results["machine"]
    config = results["config"]
    load = machine.get("load_average_at_start")
    mode = f"temperature {config.get('temperature', 0.0)}" if sampled else "greedy"
    lines.append("")
    models = results.get("models") or {"target": config["target"], "draft": config["draft"]}
    lines.append(f"target {models['target']}, draft {models['draft']}, suite {config['suite']} "
                 f"({config['num_prompts']} prompts per suite, up to {config.get('turns', 1)} turns, "
                 f"{config['max_new_tokens']} new tokens, {mode}), "
                 f"{machine['device']} {machine['dtype']}, {machine['cpu_count']} cores, "
                 f"{machine['torch_threads']} torch threads, {machine['platform']}"
                 + (f", load average at start {load[0]:.2f}" if load else ""))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    defaults = BenchConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=defaults.target)
    parser.add_argument("--draft", default=defaults.draft)
    parser.add_argument("--methods", nargs="+", default=defaults.methods,
                        help="space-separated method specs, e.g. plain lm-tree:depth=4,topk=3 ngram")
    parser.add_argument("--suite", default=defaults.suite, help="one suite or several, comma-separated")
    parser.add_argument("--num-prompts", type=int, default=defaults.num_prompts, help="per suite")
    parser.add_argument("--turns", type=int, default=defaults.turns, help="turns per conversation (MT-Bench: 2)")
    parser.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    parser.add_argument("--temperature", type=float, default=defaults.temperature,
                        help="0 = greedy (token-exact check); > 0 = sampling (tau, tokens/s)")
    parser.add_argument("--dtype", default=defaults.dtype)
    parser.add_argument("--device", default=defaults.device)
    parser.add_argument("--threads", type=int, default=defaults.threads)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--max-tree-tokens", type=int, default=defaults.max_tree_tokens)
    parser.add_argument("--strict", action="store_true")
    parser.add_argument("--out", default=defaults.out, help="JSON path (.md table and PNG plots are written beside it)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--wandb", action="store_true", help="log to W&B (offline mode when there is no network)")
    parser.add_argument("--wandb-project", default=defaults.wandb_project)
    args = parser.parse_args(argv)
    methods = list(args.methods)
    return BenchConfig(target=args.target, draft=args.draft, methods=methods, suite=args.suite,
                       num_prompts=args.num_prompts, turns=args.turns, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, dtype=args.dtype, device=args.device, threads=args.threads,
                       seed=args.seed, max_tree_tokens=args.max_tree_tokens, strict=args.strict, out=args.out,
                       plots=not args.no_plots, wandb=args.wandb, wandb_project=args.wandb_project)


def write_outputs(results: dict, config: BenchConfig) -> dict:
    """JSON + markdown (+ PNG plots, + W&B run) for a finished run; returns {"json": path, ...}."""
    from draftsmith.eval import report

    table = format_table(results)
    written: dict = {}
    if config.out:
        out = Path(config.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        if config.plots:
            written["plots"] = [str(p) for p in report.write_plots(results, out)]
            results["plots"] = [Path(p).name for p in written["plots"]]
        out.write_text(json.dumps(results, indent=2, default=str))
        md = table + "\n" + "".join(f"\n![{Path(p).stem}]({Path(p).name})\n" for p in written.get("plots", []))
        out.with_suffix(".md").write_text(md)
        written.update(json=str(out), markdown=str(out.with_suffix(".md")))
    if config.wandb:
        written["wandb"] = report.log_wandb(results, config, files=[Path(p) for p in
                                                                     [written.get("json"), written.get("markdown"),
                                                                      *written.get("plots", [])] if p])
    return written


def main(argv: list[str] | None = None) -> dict:
    config = parse_args(argv)
    if "plain" not in config.methods:
        config.methods.insert(0, "plain")  # the reference for losslessness and speedup
    results = run_benchmark(config)
    print(format_table(results))
    written = write_outputs(results, config)
    if written:
        print("wrote " + ", ".join(str(v) for v in written.values() if not isinstance(v, list))
              + "".join(f", {p}" for p in written.get("plots", [])))
    return results


if __name__ == "__main__":
    main()
