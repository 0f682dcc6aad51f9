"""Side-by-side benchmark: plain greedy, HF assisted generation and our decoder with each drafter.

    python -m eval.bench --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \
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

from eval.decoder import DecodeConfig, DecodeStats, SpeculativeDecoder
from eval.drafters.base import Drafter
from eval.drafters.lm import LMDrafter
from eval.drafters.ngram import NgramDrafter
from models.student import every_nth_layer, layer_subset_student
from models.target import TargetModel

SUITES = {"mt-bench": "mt-bench", "gsm8k": "gsm8k:test", "humaneval": "humaneval"}


@dataclass
class BenchConfig:
    target: str = "smollm2-135m-instruct"
    draft: str | None = None
    methods: list[str] = field(default_factory=lambda: ["plain", "loop-plain", "ngram", "ngram:branches=3"])
    suite: str = "mt-bench"  # mt-bench | gsm8k | humaneval | a load_source spec (e.g. jsonl:/p.jsonl)
    num_prompts: int = 4
    max_new_tokens: int = 64
    dtype: str = "float32"
    device: str = "cpu"
    threads: int = 0  # 0 = torch's default
    seed: int = 0
    max_tree_tokens: int = 64
    strict: bool = False
    out: str | None = None


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
    "medusa": "eval.drafters.medusa:build_from_spec",
    "dovetail": "eval.placement:build_from_spec",
    "hcmp": "eval.hcmp:build_from_spec",
    "arca": "eval.profile:build_from_spec",
    "minions": "eval.drafters.minions:build_from_spec",
    "llmcad": "eval.drafters.llmcad:build_from_spec",
    "self-draft": "eval.selfdraft:build_from_spec",
    "pipeline": "eval.pipeline:build_from_spec",
    "dgf": "eval.drafters.dgf:build_from_spec",
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


def load_prompts(suite: str, num_prompts: int, seed: int, tokenizer) -> list[dict]:
    """First-turn prompts of a suite, tokenised with the target's chat template."""
    from data.chat import prompt_ids
    from data.sources import load_source

    conversations = load_source(SUITES.get(suite, suite))
    if suite == "gsm8k":  # a seeded sample of the test set, as the issue asks
        generator = torch.Generator().manual_seed(seed)
        order = torch.randperm(len(conversations), generator=generator).tolist()
        conversations = [conversations[i] for i in order]
    chosen = conversations[:num_prompts]
    return [{"id": conv.id, "category": conv.category,
             "input_ids": torch.tensor([prompt_ids(tokenizer, conv.prompt_messages())])}
            for conv in chosen]


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


def run_benchmark(config: BenchConfig, target: TargetModel | None = None, draft: TargetModel | None = None,
                  progress: bool = True) -> dict:
    if config.threads:
        torch.set_num_threads(config.threads)
    target = target or TargetModel.from_pretrained(config.target, dtype=config.dtype, device=config.device)
    if draft is None and config.draft:
        draft = TargetModel.from_pretrained(config.draft, dtype=config.dtype, device=config.device)
    prompts = load_prompts(config.suite, config.num_prompts + 1, config.seed, target.tokenizer)
    warmup, prompts = prompts[0], prompts[1:]
    drafters = {m: build_drafter(m, target, draft) for m in config.methods if m not in ("plain", "hf-assisted")}
    if "hf-assisted" in config.methods and draft is None:
        raise ValueError("hf-assisted needs --draft")
    decode = DecodeConfig(max_new_tokens=config.max_new_tokens, max_tree_tokens=config.max_tree_tokens,
                          seed=config.seed)

    def run(method: str, input_ids: torch.Tensor) -> tuple[list[int], float, DecodeStats | None]:
        input_ids = input_ids.to(target.device)
        _sync(target.device)
        start = time.perf_counter()
        if method in ("plain", "hf-assisted"):
            extra = {"assistant_model": draft.model} if method == "hf-assisted" else {}
            out = target.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                        max_new_tokens=config.max_new_tokens, **extra)
            _sync(target.device)
            return out[0, input_ids.shape[1]:].tolist(), time.perf_counter() - start, None
        method_object = drafters[method]
        if hasattr(method_object, "make_decoder"):  # a policy that runs its own loop
            decoder = method_object.make_decoder(target, decode)
        else:
            decoder = SpeculativeDecoder(target, method_object, decode)
        result = decoder.generate(input_ids)
        _sync(target.device)
        return result.tokens, time.perf_counter() - start, result.stats

    for method in config.methods:  # warm-up: allocator, kernels, lazy imports
        run(method, warmup["input_ids"])

    per_method = {m: {"seconds": [], "tokens": [], "stats": DecodeStats(), "mismatches": []} for m in config.methods}
    per_prompt = []
    for index, prompt in enumerate(prompts):
        row = {"id": prompt["id"], "category": prompt["category"], "prompt_tokens": prompt["input_ids"].shape[1]}
        reference = None
        for method in config.methods:
            tokens, seconds, stats = run(method, prompt["input_ids"])
            if method == "plain":
                reference = tokens
            record = per_method[method]
            record["seconds"].append(seconds)
            record["tokens"].append(len(tokens))
            if stats is not None:
                record["stats"].merge(stats)
            if reference is not None and tokens != reference:
                record["mismatches"].append(prompt["id"])
                print(f"!!! MISMATCH: {method} output differs from plain greedy on prompt {prompt['id']} !!!")
                if config.strict:
                    raise AssertionError(f"{method} is not lossless on prompt {prompt['id']}")
            row[method] = {"seconds": seconds, "new_tokens": len(tokens),
                           "tau": stats.tau if stats else 1.0}
        per_prompt.append(row)
        if progress:
            print(f"[{index + 1}/{len(prompts)}] " + "  ".join(
                f"{m} {row[m]['new_tokens'] / row[m]['seconds']:.1f} tok/s" for m in config.methods), flush=True)

    summary = {}
    plain_seconds = per_method["plain"]["seconds"] if "plain" in per_method else None
    for method, record in per_method.items():
        total_s, total_tokens = sum(record["seconds"]), sum(record["tokens"])
        stats = record["stats"]
        entry = {"tokens_per_s": total_tokens / total_s, "seconds": total_s, "new_tokens": total_tokens,
                 "tau": stats.tau if stats.verify_forwards else None,
                 "depth_acceptance": {str(k): v for k, v in stats.depth_acceptance.items()},
                 "draft_s": stats.draft_s, "verify_s": stats.verify_s, "mismatches": record["mismatches"]}
        if method == "plain":
            entry["tau"] = 1.0
        if plain_seconds:
            ratios = [p / s for p, s in zip(plain_seconds, record["seconds"])]
            mean, half = mean_ci(ratios)
            entry.update(speedup=sum(plain_seconds) / total_s, speedup_mean=mean, speedup_ci95=half)
        summary[method] = entry
    return {"config": asdict(config), "machine": machine_info(target, config), "summary": summary,
            "per_prompt": per_prompt}


def format_table(results: dict) -> str:
    """Markdown table of the summary."""
    lines = ["| method | tokens/s | tau | speedup (95% CI) | per-depth acceptance | lossless |",
             "|---|---|---|---|---|---|"]
    for method, entry in results["summary"].items():
        tau = "-" if entry["tau"] is None else f"{entry['tau']:.2f}"
        speed = "-"
        if "speedup" in entry:
            ci = entry["speedup_ci95"]
            speed = f"{entry['speedup']:.2f}x" + ("" if math.isnan(ci) else f" (±{ci:.2f})")
        depths = " ".join(f"{v:.2f}" for v in entry["depth_acceptance"].values()) or "-"
        lossless = "yes" if not entry["mismatches"] else f"NO ({len(entry['mismatches'])} prompts)"
        lines.append(f"| {method} | {entry['tokens_per_s']:.2f} | {tau} | {speed} | {depths} | {lossless} |")
    machine = results["machine"]
    config = results["config"]
    lines.append("")
    lines.append(f"target {config['target']}, draft {config['draft']}, suite {config['suite']} "
                 f"({config['num_prompts']} prompts, {config['max_new_tokens']} new tokens), "
                 f"{machine['device']} {machine['dtype']}, {machine['cpu_count']} cores, "
                 f"{machine['torch_threads']} torch threads, {machine['platform']}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    defaults = BenchConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=defaults.target)
    parser.add_argument("--draft", default=defaults.draft)
    parser.add_argument("--methods", nargs="+", default=defaults.methods,
                        help="space-separated method specs, e.g. plain lm-tree:depth=4,topk=3 ngram")
    parser.add_argument("--suite", default=defaults.suite)
    parser.add_argument("--num-prompts", type=int, default=defaults.num_prompts)
    parser.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    parser.add_argument("--dtype", default=defaults.dtype)
    parser.add_argument("--device", default=defaults.device)
    parser.add_argument("--threads", type=int, default=defaults.threads)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--max-tree-tokens", type=int, default=defaults.max_tree_tokens)
    parser.add_argument("--strict", action="store_true")
    parser.add_argument("--out", default=defaults.out, help="JSON path (a .md table is written beside it)")
    args = parser.parse_args(argv)
    methods = list(args.methods)
    return BenchConfig(target=args.target, draft=args.draft, methods=methods, suite=args.suite,
                       num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens, dtype=args.dtype,
                       device=args.device, threads=args.threads, seed=args.seed,
                       max_tree_tokens=args.max_tree_tokens, strict=args.strict, out=args.out)


def main(argv: list[str] | None = None) -> dict:
    config = parse_args(argv)
    if "plain" not in config.methods:
        config.methods.insert(0, "plain")  # the reference for losslessness and speedup
    results = run_benchmark(config)
    table = format_table(results)
    print(table)
    if config.out:
        out = Path(config.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2))
        out.with_suffix(".md").write_text(table + "\n")
        print(f"wrote {out} and {out.with_suffix('.md')}")
    return results


if __name__ == "__main__":
    main()
